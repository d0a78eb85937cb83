"""Host cost per micro-batch and per step, on one process: plain torch, torch.distributed.pipelining, the strategy.

A near-zero-compute layer list (17 ``Linear(8, 8)`` layers, batch 32, MSE loss, SGD) makes a step's time almost all
host work: Python, autograd bookkeeping, the schedule's and our per-micro-batch logic. Three ways to train it with
``m`` micro-batches per step, each timed as the median of 60 steps, for m = 1, 4, 16:

* ``plain``: one-device gradient accumulation (m forward/backward calls, one optimizer step);
* ``torch-pp``: torch.distributed.pipelining's ``Schedule1F1B`` over one ``PipelineStage`` holding all 17 layers, in a
  gloo process group of world size 1 (a 1-stage schedule: the schedule's own per-micro-batch work without P2P, the
  fair reference for what the strategy adds per micro-batch); the loop around it as a user would write it;
* ``strategy``: ``Trainer(strategy=PipelineStrategy("1f1b", microbatches=m), devices=1)``: one stage, the same torch
  schedule underneath, plus Lightning's loop and our per-step and per-micro-batch work.

The three ways run step by step in one Trainer run per ``m`` (:func:`paired`: after each strategy step a callback
runs one step of each other way on the same batch), so that a slow phase of a shared machine slows all three alike.
A least-squares line through t(m) gives the per-micro-batch slope and the fixed per-step cost (Lightning's loop is in
the strategy's fixed cost). The same line through the number of function calls per step (``sys.setprofile``; a count,
so the same on a busy machine) shows host work where timings are noise. Last lines: ``slope_ratio=<strategy /
torch-pp>``, ``fixed_ratio`` and ``calls_slope_ratio``.

    python bench/hostcost.py [--steps 60] [--microbatches 1 4 16]
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
    """torch.distributed.pipelining's ``Schedule1F1B`` over one stage holding every layer, looped as a user would."""

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


def _loop(make: Any, m: int, steps: int) -> float:
    loop = make(m)
    ends = []
    for x, y in _batches(steps + WARMUP + 1):
        loop.step(x, y)
        ends.append(CLOCK())
    return _median_gap(ends)


def plain(m: int, steps: int) -> float:
    return _loop(Plain, m, steps)


def torch_pp(m: int, steps: int) -> float:
    return _loop(TorchPP, m, steps)


def _trainer(m: int, steps: int, callback: Any) -> Any:
    import lightning.pytorch as L

    from lightning_pipe import PipelineStrategy

    return L.Trainer(strategy=PipelineStrategy("1f1b", microbatches=m), accelerator="cpu", devices=1,
                     max_steps=steps + WARMUP + 1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
                     use_distributed_sampler=False)


def strategy(m: int, steps: int) -> float:
    from bench._timing import StepClock

    clock = StepClock()
    clock_now = CLOCK
    clock.on_train_batch_end = lambda *a: clock.ends.append(clock_now())  # type: ignore[method-assign]
    _trainer(m, steps, clock).fit(_module(), _loader(_batches(steps + WARMUP + 1)))
    return _median_gap(clock.ends)


def paired(m: int, steps: int) -> dict[str, float]:
    """The three ways step by step, in one run: after each of the Trainer's batches a callback runs one torch-pp and
    one plain step on the same batch, each timed on its own; the strategy's step is the time from the end of that
    callback to the next batch's end. A slow phase of the machine then falls on all three ways alike. Medians."""
    from lightning.pytorch.callbacks import Callback

    others = {"torch-pp": TorchPP(m), "plain": Plain(m)}
    times: dict[str, list[float]] = {"strategy": [], "torch-pp": [], "plain": []}

    class Pairs(Callback):
        last: float | None = None

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            start = CLOCK()
            if self.last is not None:
                times["strategy"].append(start - self.last)
            for name, loop in others.items():
                begin = CLOCK()
                loop.step(*batch)
                times[name].append(CLOCK() - begin)
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
    times: dict[str, list[float]] = {name: [] for name in ways}
    for m in args.microbatches:
        medians = paired(m, args.steps)
        for name in ways:
            times[name].append(medians[name])
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
