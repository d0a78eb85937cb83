"""What every benchmark shares: the registry (one module per benchmark), the run's environment, rank processes, step
timing, interleaving the compared variants, the noise floor of a ratio, and the models and data they train.

A benchmark is a module of ``bench/`` that defines ``BENCHMARK = Benchmark(...)``: its name, a one-line summary,
``run(args) -> Outcome`` (a report and its figures, ``name -> number``), its arguments, the function its rank
processes run (:func:`run_ranks`), and the arguments of its quick form (``python -m bench all --quick``; ``None``
leaves it out, ``slow`` says why). Nothing else registers it. Module-level imports stay light (the standard library and
this module): torch, Lightning and the library are imported inside the functions, so listing the suite is instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import os
import pkgutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[1]
T = TypeVar("T")


# ---------------------------------------------------------------------------------------------------------- registry
@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a benchmark run gives: a report for people (tables) and its figures, under their stable names."""

    report: str
    figures: dict[str, float]


@dataclasses.dataclass(frozen=True)
class Benchmark:
    name: str
    summary: str
    run: Callable[[argparse.Namespace], Outcome]
    arguments: Callable[[argparse.ArgumentParser], None] | None = None
    worker: Callable[[argparse.Namespace], Any] | None = None
    """What each rank process runs (rank 0 writes its JSON result to ``args.out``), started by :func:`run_ranks`."""
    quick: tuple[str, ...] | None = None
    """Arguments of the quick form (``all --quick``); ``None``: not part of it."""
    slow: str = ""
    """Why a benchmark has no quick form."""

    def parser(self) -> argparse.ArgumentParser:
        module = sys.modules[self.run.__module__]
        parser = argparse.ArgumentParser(prog=f"python -m bench {self.name}", description=module.__doc__,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
        if self.arguments is not None:
            self.arguments(parser)
        parser.add_argument("--json", metavar="OUT", help="also write the figures and the environment as JSON")
        return parser


def benchmarks() -> dict[str, Benchmark]:
    """Every module of ``bench/`` that defines ``BENCHMARK``, by name."""
    import bench

    found = {}
    for info in pkgutil.iter_modules(bench.__path__):
        if info.ispkg or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"bench.{info.name}")
        spec = getattr(module, "BENCHMARK", None)
        if isinstance(spec, Benchmark):
            found[spec.name] = spec
    return dict(sorted(found.items()))


# ------------------------------------------------------------------------------------------------------- environment
def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else ""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "absent"


def environment() -> dict[str, Any]:
    """What a figure was measured on: the commit (``+dirty`` with uncommitted changes to tracked files), the date, the
    machine, the versions and the load average (1 minute) when the run started."""
    commit = _git("rev-parse", "--short", "HEAD")
    if commit and _git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    return {"commit": commit or "unknown", "date": datetime.date.today().isoformat(), "cores": os.cpu_count(),
            "cpu": _cpu_model(), "torch": _version("torch"), "lightning": _version("lightning"),
            "python": sys.version.split()[0], "load": round(os.getloadavg()[0], 2)}


# ---------------------------------------------------------------------------------------------------- rank processes
def run_ranks(name: str, nproc: int, args: argparse.Namespace, timeout: float = 1800,
              wrap: Sequence[str] = (), env: dict[str, str] | None = None) -> Any:
    """Run benchmark ``name``'s worker on ``nproc`` local CPU ranks (torchrun, one thread per rank) with ``args``;
    return what rank 0 wrote to ``args.out`` (JSON). A failure keeps every rank's output in a log file it names.
    ``wrap``: a command each rank's Python runs under (e.g. valgrind), ``env``: more environment for the ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        settings, out = Path(tmp) / "args.json", Path(tmp) / "result.json"
        settings.write_text(json.dumps({**vars(args), "out": str(out)}))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
               "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(env or {})}
        python = ["--no-python", *wrap, sys.executable] if wrap else []
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               *python, "-m", "bench", "--worker", name, str(settings)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
        if proc.returncode != 0:
            # the whole output kept: a rank's native abort message is often far above the last lines
            log = Path(tempfile.mkstemp(prefix=f"bench-{name}-failed-", suffix=".log")[1])
            log.write_text(proc.stdout + proc.stderr)
            raise SystemExit(f"{name}: rank processes failed ({proc.returncode}; every rank's output: {log}):\n"
                             f"{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def worker_main(name: str, settings: str) -> None:
    """The rank-process side of :func:`run_ranks`."""
    import torch

    torch.set_num_threads(1)
    args = argparse.Namespace(**json.loads(Path(settings).read_text()))
    spec = benchmarks()[name]
    assert spec.worker is not None, f"benchmark {name} has no rank worker"
    spec.worker(args)


def with_args(args: argparse.Namespace, **changes: Any) -> argparse.Namespace:
    """A copy of ``args`` with some values changed (one launch of several with different settings)."""
    return argparse.Namespace(**{**vars(args), **changes})


# ------------------------------------------------------------------------------------------------------------ timing
_CLOCK_CLASS: list[type] = []


def step_clock(on_step: Callable[[int], None] | None = None) -> Any:
    """A Lightning callback recording when each training batch ends; a step's time is the gap between consecutive
    ends (data loading, schedule, gradient sync, optimizer: everything a step costs). ``on_step(n)`` runs after the
    n-th step. ``.durations(warmup)``: the step times after the first ``warmup`` steps."""
    if not _CLOCK_CLASS:
        from lightning.pytorch.callbacks import Callback

        class StepClock(Callback):
            def __init__(self, on_step: Callable[[int], None] | None) -> None:
                self.ends: list[float] = []
                self.on_step = on_step

            def on_train_batch_end(self, *args: Any) -> None:
                self.ends.append(time.perf_counter())
                if self.on_step is not None:
                    self.on_step(len(self.ends))

            def durations(self, warmup: int) -> list[float]:
                return [b - a for a, b in zip(self.ends, self.ends[1:])][warmup - 1:]

        _CLOCK_CLASS.append(StepClock)
    return _CLOCK_CLASS[0](on_step)


def interleave(variants: Sequence[str], rounds: int, run: Callable[[str], T]) -> dict[str, list[T]]:
    """Each variant once per round, the order reversed every other round (A B C, C B A, ...): a drift of the machine
    over the rounds falls on every variant alike, and none always runs first."""
    results: dict[str, list[T]] = {v: [] for v in variants}
    for i in range(rounds):
        for variant in (variants if i % 2 == 0 else list(reversed(variants))):
            results[variant].append(run(variant))
    return results


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """The median of the per-pair ratios a[i] / b[i] of two variants measured in pairs (step by step)."""
    return statistics.median(x / y for x, y in zip(a, b))


def noise_floor(samples: Sequence[float]) -> float:
    """How far one variant's samples disagree with themselves: |median of the even-numbered / median of the odd-
    numbered - 1|. A ratio between two variants of the same run that is closer to 1 than this is not resolved."""
    even, odd = samples[0::2], samples[1::2]
    if not even or not odd:
        return float("nan")
    return abs(statistics.median(even) / statistics.median(odd) - 1)


def kendall_tau(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's rank correlation (tau-b, ties allowed) of two paired sequences: 1 when they order every pair alike,
    -1 when every pair is reversed, near 0 when the orders are unrelated."""
    concordant = discordant = ties_a = ties_b = 0
    for i in range(len(a)):
        for j in range(i + 1, len(a)):
            x, y = a[i] - a[j], b[i] - b[j]
            if x == 0 and y == 0:
                continue
            if x == 0:
                ties_a += 1
            elif y == 0:
                ties_b += 1
            elif (x > 0) == (y > 0):
                concordant += 1
            else:
                discordant += 1
    pairs = concordant + discordant
    denominator = ((pairs + ties_a) * (pairs + ties_b)) ** 0.5
    return (concordant - discordant) / denominator if denominator else float("nan")


def least_disturbed(samples: Sequence[float]) -> float:
    """The fastest sample: on a shared machine contention only adds time, so the least-disturbed run is the closest
    to the code's own cost."""
    return min(samples)


# ------------------------------------------------------------------------------------------------- models and data
def residual_mlp(width: int, blocks: int) -> Any:
    """``blocks`` residual ``x + tanh(Linear(x))`` blocks of one width, MSE loss, SGD: equal cost per layer."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from lightning_pipe import PipelineModule

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.tanh(self.fc(x))

    class ResidualMLP(PipelineModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layers = nn.Sequential(*[Block() for _ in range(blocks)])

        def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(output, target)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    return ResidualMLP()


def gpt(n_layer: int = 4, n_embd: int = 128, block_size: int = 64, vocab_size: int = 256, **kwargs: Any) -> Any:
    """The GPT recipe's model (``recipes/gpt``), seeded, no dropout."""
    import torch

    from recipes.gpt.model import GPT

    torch.manual_seed(0)
    kwargs = {"n_head": 4, "dropout": 0.0, "warmup_steps": 5, "max_steps": 1000, **kwargs}
    return GPT(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_embd=n_embd, **kwargs)


def token_batches(rows: int, seq: int, batch: int, vocab: int = 256, seed: int = 0) -> Any:
    """``rows`` random token rows of ``seq + 1`` tokens as (inputs, next tokens) batches, in order, the last partial
    batch dropped."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    tokens = torch.randint(0, vocab, (rows, seq + 1), generator=torch.Generator().manual_seed(seed))
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch, shuffle=False, drop_last=True)


def balanced_split(n_blocks: int, n_stages: int) -> list[int]:
    """GPT layer counts per stage: blocks spread evenly, the embedding on the first stage, norm + head on the last."""
    base, extra = divmod(n_blocks, n_stages)
    counts = [base + (1 if s < extra else 0) for s in range(n_stages)]
    counts[0] += 1
    counts[-1] += 2
    return counts


def trainer(strategy: Any, steps: int, callbacks: Sequence[Any] = (), devices: int | None = None,
            **kwargs: Any) -> Any:
    """A Trainer as every benchmark runs one: CPU, ``devices`` ranks (default: the launch's world size), no logger,
    checkpoints, progress bar or validation, and the data in the loader's order on every rank."""
    import lightning.pytorch as L

    devices = devices if devices is not None else int(os.environ.get("WORLD_SIZE", "1"))
    settings = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
                "enable_model_summary": False, "limit_val_batches": 0, "use_distributed_sampler": False, **kwargs}
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=steps,
                     callbacks=list(callbacks), **settings)


def gather(obj: Any) -> list[Any]:
    """Every rank's ``obj``, on every rank."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def write_result(args: argparse.Namespace, result: Any) -> None:
    """Rank 0 writes its JSON result where :func:`run_ranks` reads it."""
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.out).write_text(json.dumps(result))
