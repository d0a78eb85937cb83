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
the strategy's fixed cost). The row ``strategy: training step`` is the part of the strategy's step inside the engine's
training step (the schedule with our per-micro-batch work, and our work before and after it; timed by a wrapper
in this process, never in the library): what the strategy's step adds per micro-batch outside it is Lightning's
fixed per-step work running slower after a longer step, not work done per micro-batch (docs/performance.md, "Host
cost per micro-batch"). The same line through the number of function calls per step (``sys.setprofile``; a
count, so the same on a busy machine) shows host work where timings are noise. Last lines: ``slope_ratio=<strategy /
torch-pp>``, ``step_slope_ratio=<strategy's training step / torch-pp>``, ``fixed_ratio`` and ``calls_slope_ratio``.

``--instructions`` counts instead, with valgrind's callgrind (installed separately; about 10 minutes on 2 cores): the
instructions each way executes per micro-batch, from whole runs at m = 1 and m = 16 in fresh processes (their
difference over the extra micro-batches; setup cancels). An exact count of the host work, C++ included, that no
machine noise moves; last line ``instructions_slope_ratio=<strategy / torch-pp>``. What a count cannot show is what
the same instructions cost in time (caches, memory), which the timed slope includes.

    python -m bench hostcost [--steps 60] [--microbatches 1 4 16] [--rounds 3]
    python -m bench hostcost --instructions [--steps 20]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, Benchmark, Outcome

LAYERS, WIDTH, BATCH, WARMUP = 17, 8, 32, 5
STEP = "strategy: training step"
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

    from lightning_pipe.runtime.engine import PipelineEngine

    loops: dict[str, Plain | TorchPP] = {"plain": Plain(m), "torch-pp": TorchPP(m)}
    times: dict[str, list[float]] = {"strategy": [], STEP: [], **{name: [] for name in loops}}
    train_step = PipelineEngine._train_step

    def timed_train_step(engine: Any, *args: Any) -> Any:  # this process only (restored below)
        began = CLOCK()
        try:
            return train_step(engine, *args)
        finally:
            times[STEP].append(CLOCK() - began)

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

    setattr(PipelineEngine, "_train_step", timed_train_step)  # noqa: B010 (a method swapped for this run)
    try:
        _trainer(m, steps, Pairs()).fit(_module(), _loader(_batches(steps + WARMUP + 1)))
    finally:
        setattr(PipelineEngine, "_train_step", train_step)  # noqa: B010
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


def _setup() -> None:
    """One process of world size 1 (torch-pp's stage needs a process group; the strategy reuses it)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import warnings

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    warnings.filterwarnings("ignore")


WAYS = {"plain": _loop(Plain), "torch-pp": _loop(TorchPP), "strategy": strategy}


def instructions(way: str, m: int, steps: int, out: Path) -> int:
    """Instructions a fresh process executes running ``way`` at ``m`` for ``steps`` (+ warm-up) steps, all threads,
    counted by callgrind (this file's ``--one`` mode under valgrind)."""
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out / f'{way}.{m}.out'}", sys.executable,
           "-m", "bench", "hostcost", "--one", way, str(m), "--steps", str(steps)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=REPO)
    found = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return int(found.group(1).replace(",", ""))


def count_instructions(steps: int) -> Outcome:
    """Instructions per micro-batch of torch-pp and the strategy: (count at m = 16 - count at m = 1) over the extra
    micro-batches, two processes at a time."""
    from concurrent.futures import ThreadPoolExecutor

    if shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind (e.g. `apt install valgrind`)")
    runs = [(way, m) for way in ("torch-pp", "strategy") for m in (1, 16)]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(2) as pool:
        counts = dict(zip(runs, pool.map(lambda run: instructions(run[0], run[1], steps, Path(tmp)), runs)))
    extra = 15 * (steps + WARMUP + 1)  # micro-batches the m = 16 run adds
    per = {way: (counts[way, 16] - counts[way, 1]) / extra for way in ("torch-pp", "strategy")}
    lines = ["| way | instructions at m=1 | at m=16 | per micro-batch |", "|---|---|---|---|"]
    lines += [f"| {way} | {counts[way, 1]:,} | {counts[way, 16]:,} | {value:,.0f} |" for way, value in per.items()]
    lines.append(f"layers={LAYERS} width={WIDTH} batch={BATCH} steps={steps} (+{WARMUP + 1} warm-up; callgrind, "
                 "all threads)")
    return Outcome("\n".join(lines), {"instructions_slope_ratio": per["strategy"] / per["torch-pp"]})


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 60; 20 with --instructions)")
    p.add_argument("--microbatches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    p.add_argument("--rounds", type=int, default=3, help="runs of each way and m; the least disturbed is kept")
    p.add_argument("--instructions", action="store_true", help="count instructions with valgrind instead of timing")
    p.add_argument("--one", nargs=2, metavar=("WAY", "M"), help=argparse.SUPPRESS)  # one run (under valgrind)


def run(args: argparse.Namespace) -> Outcome:
    if args.instructions:
        return count_instructions(args.steps or 20)
    steps = args.steps or 60
    _setup()
    if args.one:
        WAYS[args.one[0]](int(args.one[1]), steps)
        return Outcome("", {})
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    runs: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):  # the least disturbed round's median of each way (contention only adds time)
        for m in args.microbatches:
            for name, t in paired(m, steps).items():
                runs.setdefault((name, m), []).append(t)
    times = {name: [min(runs[name, m]) for m in args.microbatches] for name in [*WAYS, STEP]}
    fits = {name: fit_line(args.microbatches, ts) for name, ts in times.items()}
    # (m = 4 and 16, the lower of two counts: a first run in a process can count one-off work)
    calls = {name: fit_line([4, 16], [min(calls_per_step(run, m) for _ in range(2)) for m in (4, 16)])
             for name, run in WAYS.items()}
    cols = " | ".join(f"m={m} (ms)" for m in args.microbatches)
    lines = [f"| way | {cols} | per micro-batch (us) | fixed per step (ms) | calls per micro-batch | calls per step |",
             "|---" * (len(args.microbatches) + 5) + "|"]
    for name, ts in times.items():
        slope, fixed = fits[name]
        counted = " | ".join(f"{c:.0f}" for c in calls[name]) if name in calls else " | "
        lines.append(f"| {name} | " + " | ".join(f"{t * 1e3:.2f}" for t in ts)
                     + f" | {slope * 1e6:.0f} | {fixed * 1e3:.2f} | {counted} |")
    lines.append(f"layers={LAYERS} width={WIDTH} batch={BATCH} steps={steps} (median step time, {args.clock} clock)")
    return Outcome("\n".join(lines), {
        "slope_ratio": fits["strategy"][0] / fits["torch-pp"][0],
        "step_slope_ratio": fits[STEP][0] / fits["torch-pp"][0],
        "fixed_ratio": fits["strategy"][1] / fits["torch-pp"][1],
        "calls_slope_ratio": calls["strategy"][0] / calls["torch-pp"][0],
        "calls_per_microbatch_strategy": calls["strategy"][0], "calls_per_microbatch_torch_pp": calls["torch-pp"][0]})


BENCHMARK = Benchmark(
    "hostcost", "host work per micro-batch and per step on one process: plain accumulation, torch's 1-stage "
    "schedule, the strategy (CPU time, function calls; --instructions: callgrind)", run, arguments,
    quick=("--steps", "30", "--rounds", "1"))
