"""Host cost per micro-batch and per step, on one process: plain torch, torch.distributed.pipelining, the strategy.

A near-zero-compute layer list (17 ``Linear(8, 8)`` layers, batch 32, MSE loss, SGD) makes a step's time almost all
host work: Python, autograd bookkeeping, the schedule's and our per-micro-batch logic. Three ways to train it with
``m`` micro-batches per step, each timed as the median of 60 steps, for m = 1, 4, 16, in ``--rounds`` interleaved
rounds (the least disturbed round's median is kept: on a shared machine, contention only adds time):

* ``plain``: one-device gradient accumulation (m forward/backward calls, one optimizer step);
* ``torch-pp``: torch.distributed.pipelining's ``Schedule1F1B`` over one ``PipelineStage`` holding all 17 layers, in a
  gloo process group of world size 1 (a 1-stage schedule: the schedule's own per-micro-batch work without P2P, the
  fair reference for what the strategy adds per micro-batch); the loop around it as a user would write it;
* ``strategy``: ``Trainer(strategy=PipelineStrategy("1f1b", microbatches=m), devices=1)``: one stage, the same torch
  schedule underneath, plus Lightning's loop and our per-step and per-micro-batch work.

A least-squares line through t(m) gives the per-micro-batch slope and the fixed per-step cost (Lightning's loop is in
the strategy's fixed cost). The same line through the number of function calls per step (``sys.setprofile``; a count,
so the same on a busy machine) shows host work where timings are noise. Last lines: ``slope_ratio=<strategy /
torch-pp>``, ``fixed_ratio`` and ``calls_slope_ratio``.

    python bench/hostcost.py [--steps 60] [--microbatches 1 4 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LAYERS, WIDTH, BATCH, WARMUP = 17, 8, 32, 5
CLOCK = time.process_time
"""Step times are CPU time of this process by default (``--clock wall``: wall time): on a shared machine the
process's CPU time is its host work, not counting the time it waits for a core."""


def _module() -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from lightning_pipe import PipelineModule

    class Tiny(PipelineModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layers = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])

        def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(output, target)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    return Tiny()


def _batches(n: int) -> list[tuple[Any, Any]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return [(torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)) for _ in range(n)]


def _loader(batches: list[tuple[Any, Any]]) -> Any:
    """The same batches, in order, from a DataLoader (what Lightning iterates)."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    xs, ys = (torch.cat(part) for part in zip(*batches))
    return DataLoader(TensorDataset(xs, ys), batch_size=BATCH, shuffle=False, drop_last=True)


def _median_gap(ends: list[float]) -> float:
    return statistics.median(b - a for a, b in list(zip(ends, ends[1:]))[WARMUP:])


def plain(m: int, steps: int) -> float:
    import torch

    module = _module()
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)
    ends = []
    for x, y in _batches(steps + WARMUP + 1):
        opt.zero_grad(set_to_none=True)
        for xs, ys in zip(x.chunk(m), y.chunk(m)):
            (module.loss_fn(module.layers(xs), ys) / m).backward()
        opt.step()
        ends.append(CLOCK())
    return _median_gap(ends)


def torch_pp(m: int, steps: int) -> float:
    import torch
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    module = _module()
    stage = PipelineStage(module.layers, 0, 1, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=lambda out, tgt: module.loss_fn(out, tgt) / m,
                            scale_grads=False)
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)
    ends = []
    for x, y in _batches(steps + WARMUP + 1):
        opt.zero_grad(set_to_none=True)
        schedule.step(x, target=y, losses=[])
        opt.step()
        ends.append(CLOCK())
    return _median_gap(ends)


def strategy(m: int, steps: int) -> float:
    import lightning.pytorch as L

    from bench._timing import StepClock
    from lightning_pipe import PipelineStrategy

    clock = StepClock()
    clock_now = CLOCK
    clock.on_train_batch_end = lambda *a: clock.ends.append(clock_now())  # type: ignore[method-assign]
    trainer = L.Trainer(strategy=PipelineStrategy("1f1b", microbatches=m), accelerator="cpu", devices=1,
                        max_steps=steps + WARMUP + 1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[clock],
                        use_distributed_sampler=False)
    trainer.fit(_module(), _loader(_batches(steps + WARMUP + 1)))
    return _median_gap(clock.ends)


def calls_per_step(run: Any, m: int, steps: int = 10) -> float:
    """Python and C function calls per step (a count, not a time: the same on a busy machine): the calls of a run of
    ``2 * steps`` minus those of a run of ``steps``, over ``steps`` (setup and teardown cancel out)."""
    counted = [0]

    def count(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            counted[0] += 1

    totals = []
    for n in (steps, 2 * steps):
        counted[0] = 0
        sys.setprofile(count)
        try:
            run(m, n)
        finally:
            sys.setprofile(None)
        totals.append(counted[0])
    return (totals[1] - totals[0]) / steps


def fit_line(ms: list[int], ts: list[float]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through (m, t)."""
    mean_m, mean_t = statistics.fmean(ms), statistics.fmean(ts)
    slope = sum((a - mean_m) * (b - mean_t) for a, b in zip(ms, ts)) / sum((a - mean_m) ** 2 for a in ms)
    return slope, mean_t - slope * mean_m


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--microbatches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    p.add_argument("--rounds", type=int, default=3, help="runs of each way and m; the least disturbed is kept")
    args = p.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)  # torch-pp's stage needs one; the strategy reuses it
    import warnings

    warnings.filterwarnings("ignore")
    ways = {"plain": plain, "torch-pp": torch_pp, "strategy": strategy}
    runs: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):  # the ways interleaved round by round: the least disturbed median of each
        for m in args.microbatches:
            for name, run in ways.items():
                runs.setdefault((name, m), []).append(run(m, args.steps))
    times = {name: [min(runs[name, m]) for m in args.microbatches] for name in ways}
    fits = {name: fit_line(args.microbatches, ts) for name, ts in times.items()}
    # (m = 4 and 16, the lower of two counts: a first run in a process can count one-off work)
    calls = {name: fit_line([4, 16], [min(calls_per_step(run, m) for _ in range(2)) for m in (4, 16)])
             for name, run in ways.items()}
    cols = " | ".join(f"m={m} (ms)" for m in args.microbatches)
    print(f"| way | {cols} | per micro-batch (us) | fixed per step (ms) | calls per micro-batch | calls per step |")
    print("|---" * (len(args.microbatches) + 5) + "|")
    for name, ts in times.items():
        (slope, fixed), (call_slope, call_fixed) = fits[name], calls[name]
        print(f"| {name} | " + " | ".join(f"{t * 1e3:.2f}" for t in ts)
              + f" | {slope * 1e6:.0f} | {fixed * 1e3:.2f} | {call_slope:.0f} | {call_fixed:.0f} |")
    print(f"layers={LAYERS} width={WIDTH} batch={BATCH} steps={args.steps} (median step time, {args.clock} clock)")
    print(f"slope_ratio={fits['strategy'][0] / fits['torch-pp'][0]:.3f}")
    print(f"fixed_ratio={fits['strategy'][1] / fits['torch-pp'][1]:.3f}")
    print(f"calls_slope_ratio={calls['strategy'][0] / calls['torch-pp'][0]:.3f}")


if __name__ == "__main__":
    main()
