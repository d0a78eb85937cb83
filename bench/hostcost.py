"""Host cost per micro-batch and per step, on one process: plain torch, torch.distributed.pipelining, the strategy.

A near-zero-compute layer list (17 ``Linear(8, 8)`` layers, batch 32, MSE loss, SGD) makes a step's time almost all
host work: Python, autograd bookkeeping, the schedule's and our per-micro-batch logic. Three ways to train it with
``m`` micro-batches per step, for m = 1, 4, 16, interleaved step by step (:func:`paired`: a slow phase of a shared
machine slows the three alike), each timed as the median of 60 steps, in ``--rounds`` rounds (the least disturbed
round's median is kept: contention only adds time):

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


class Plain:
    """One-device gradient accumulation: m forward/backward calls, one optimizer step."""

    def __init__(self, m: int) -> None:
        import torch

        self.m, self.module = m, _module()
        self.opt = torch.optim.SGD(self.module.parameters(), lr=1e-3)

    def step(self, x: Any, y: Any) -> None:
        self.opt.zero_grad(set_to_none=True)
        for xs, ys in zip(x.chunk(self.m), y.chunk(self.m)):
            (self.module.loss_fn(self.module.layers(xs), ys) / self.m).backward()
        self.opt.step()


class TorchPP:
    """torch.distributed.pipelining's ``Schedule1F1B`` over one stage holding every layer, the loop as a user would
    write it."""

    def __init__(self, m: int) -> None:
        import torch
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        module = _module()
        stage = PipelineStage(module.layers, 0, 1, torch.device("cpu"))
        self.schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=lambda out, tgt: module.loss_fn(out, tgt) / m,
                                     scale_grads=False)
        self.opt = torch.optim.SGD(module.parameters(), lr=1e-3)

    def step(self, x: Any, y: Any) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.schedule.step(x, target=y, losses=[])
        self.opt.step()


def _loop(way: type[Plain] | type[TorchPP]) -> Any:
    def run(m: int, steps: int) -> None:
        loop = way(m)
        for x, y in _batches(steps + WARMUP + 1):
            loop.step(x, y)

    return run


def _trainer(m: int, steps: int, callback: Any) -> Any:
    import lightning.pytorch as L

    from lightning_pipe import PipelineStrategy

    return L.Trainer(strategy=PipelineStrategy("1f1b", microbatches=m), accelerator="cpu", devices=1,
                     max_steps=steps + WARMUP + 1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
                     use_distributed_sampler=False)


def strategy(m: int, steps: int) -> None:
    from lightning.pytorch.callbacks import Callback

    _trainer(m, steps, Callback()).fit(_module(), _loader(_batches(steps + WARMUP + 1)))


def paired(m: int, steps: int) -> dict[str, float]:
    """Median step time of each way at ``m``, the ways interleaved step by step: after each of the Trainer's
    batches a callback runs one plain step and one torch-pp step on the same batch, so a slow phase of the machine
    slows the three ways alike. A strategy step is the time from the end of that callback to the next batch's end
    (Lightning's loop, data loading, schedule, optimizer)."""
    from lightning.pytorch.callbacks import Callback

    loops = {"plain": Plain(m), "torch-pp": TorchPP(m)}
    times: dict[str, list[float]] = {"strategy": [], **{name: [] for name in loops}}

    class Pairs(Callback):
        last: float | None = None

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            start = CLOCK()
            if self.last is not None:
                times["strategy"].append(start - self.last)
            for name, loop in loops.items():
                began = CLOCK()
                loop.step(*batch)
                times[name].append(CLOCK() - began)
            self.last = CLOCK()

    _trainer(m, steps, Pairs()).fit(_module(), _loader(_batches(steps + WARMUP + 1)))
    return {name: statistics.median(ts[WARMUP:]) for name, ts in times.items()}


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
    ways = {"plain": _loop(Plain), "torch-pp": _loop(TorchPP), "strategy": strategy}
    runs: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):  # the least disturbed round's median of each way (contention only adds time)
        for m in args.microbatches:
            for name, t in paired(m, args.steps).items():
                runs.setdefault((name, m), []).append(t)
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
