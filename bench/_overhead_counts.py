"""``python -m bench overhead --instructions``: the instructions a training step executes, counted with valgrind's
callgrind on every rank, for the three loops of ``bench/overhead.py`` (the hand-written torch loop, the Lightning
floor, the strategy).

Each rank's Python runs under ``valgrind --tool=callgrind --instr-atstart=no`` (torchrun ``--no-python``): imports,
setup and the warm-up steps run uninstrumented; a small C helper built at the start (``cc`` and valgrind's
``callgrind.h``) issues callgrind's client requests from the loops, after each step: instrumentation starts after the
``--warmup``-th step, and the counts are dumped (and zeroed) after ``--count-steps`` more steps and again after as
many more. Each window holds whole steps only — for a Trainer, from one ``on_train_batch_end`` to another: data
loading, Lightning's loop, the schedule, the collectives, the optimizer — so setup and teardown never enter a count,
and the two windows of one loop are two measurements of the same steps (their spread is printed). Every thread of a
rank is counted, Python and C++ (torch, gloo's transport threads), except work that runs on a clock instead of per
step: the strategy's failure watch (a thread polling the rendezvous store every half second, another checking the
time every second: [Note: heartbeats] in lightning_pipe/runtime/heartbeat.py) would count, under valgrind's
slowdown of some hundred times, a hundred times the wake-ups a step meets natively (where they cost a few
microseconds per second), so the counting processes stop it when training starts.

Figures: ``instructions_overhead_ratio`` (strategy / hand-written) and ``instructions_over_floor`` (strategy / the
Lightning floor, automatic optimization), per step summed over the ranks; the report lists the functions (callgrind's
symbols, self instructions) whose count per step the strategy adds most over the floor. A function of the
interpreter (``_PyEval_EvalFrameDefault``, ``PyObject_GetAttr`` ...) there means more Python run per step."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import Outcome, run_ranks, with_args, write_result

LOOPS = ("hand", "floor", "strategy")
LABELS = {"hand": "hand-written torch.distributed.pipelining", "floor": "Lightning floor (automatic optimization)",
          "strategy": "Trainer(strategy=PipelineStrategy)"}
SSE_KERNELS = {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}
"""MKL's AVX2 matrix kernels run some 25x slower under valgrind than its SSE4.2 ones (a step of the GPT here: 150 s
against 6 s, uninstrumented); the counting processes take the SSE4.2 kernels unless ``--native-kernels``. The host
work — Python, Lightning, the library, torch's dispatch — is the same instructions either way; the matrix products
count more instructions with the narrower kernels, which brings every ratio a little closer to 1."""
HELPER = r"""
#include <valgrind/callgrind.h>
void bench_start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void bench_dump(const char *name) { CALLGRIND_DUMP_STATS_AT(name); }
void bench_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; }
"""


def build_helper(folder: Path) -> Path:
    """The client-request helper as a shared library (callgrind's requests are machine-code sequences only its
    header's macros write)."""
    for tool in ("valgrind", "cc"):
        if shutil.which(tool) is None:
            raise SystemExit(f"--instructions needs {tool} (e.g. `apt install valgrind gcc`)")
    source, library = folder / "callgrind_marks.c", folder / "callgrind_marks.so"
    source.write_text(HELPER)
    done = subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", str(library), str(source)], capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"building the callgrind helper failed (valgrind's headers: valgrind/callgrind.h):\n"
                         f"{done.stderr}")
    return library


class Windows:
    """Marks one loop's counted windows: after each step call :meth:`step`; instrumentation starts after step
    ``warmup`` and the counts are dumped as ``<loop>.a`` after ``warmup + n`` steps and ``<loop>.b`` after
    ``warmup + 2n``."""

    def __init__(self, helper: str, loop: str, warmup: int, n: int) -> None:
        import ctypes

        self.lib = ctypes.CDLL(helper)
        self.loop, self.warmup, self.n, self.done = loop, warmup, n, 0

    def step(self) -> None:
        self.done += 1
        if self.done == self.warmup:
            self.lib.bench_start()
        elif self.done == self.warmup + self.n:
            self.lib.bench_dump(f"{self.loop}.a".encode())
        elif self.done == self.warmup + 2 * self.n:
            self.lib.bench_dump(f"{self.loop}.b".encode())
            self.lib.bench_stop()


def _stop_clock_threads(trainer: Any) -> None:
    """The strategy's failure watch stops in the counting processes once training starts (see the module's
    docstring): its two threads wake on a clock, not per step."""
    watch = getattr(getattr(trainer.strategy, "_faults", None), "watch", None)
    if watch is not None:
        watch.stop()


def worker(args: argparse.Namespace, hand_written: Callable[..., Any], floor_module: Callable[..., Any],
           make_trainer: Callable[..., Any], model: Callable[[], Any], data: Callable[..., Any]) -> None:
    """One rank: the three loops one after another, each marking its windows (bench/overhead.py's pieces)."""
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback

    class Marks(Callback):
        def __init__(self, windows: Windows) -> None:
            self.windows = windows

        def on_train_start(self, trainer: Any, module: Any) -> None:
            _stop_clock_threads(trainer)

        def on_train_batch_end(self, *unused: Any) -> None:
            self.windows.step()

    dist.init_process_group("gloo")
    hand = Windows(args.helper, "hand", args.warmup, args.count_steps)
    loop = hand_written(args)
    for x, y in data(args):
        loop.step(x, y)
        hand.step()
    dist.barrier()
    make_trainer(args, Marks(Windows(args.helper, "floor", args.warmup, args.count_steps)),
                 stock=True).fit(floor_module(args, "auto"), data(args))
    dist.barrier()
    make_trainer(args, Marks(Windows(args.helper, "strategy", args.warmup, args.count_steps))).fit(model(), data(args))
    dist.barrier()
    write_result(args, {})
    dist.destroy_process_group()


def _windows(folder: Path) -> dict[tuple[int, str], Path]:
    """The dump files by (rank, window name)."""
    found = {}
    for path in folder.glob("callgrind.*.*"):
        rank = int(path.name.split(".")[1])
        trigger = re.search(r"^desc: Trigger: Client Request: (\S+)$", path.read_text(errors="replace")[:4000], re.M)
        if trigger:
            found[rank, trigger.group(1)] = path
    return found


def _total(path: Path) -> int:
    found = re.search(r"^totals: (\d+)", path.read_text(errors="replace"), re.M)
    if found is None:
        raise SystemExit(f"{path}: no totals line (callgrind's output format?)")
    return int(found.group(1))


def _functions(path: Path) -> dict[str, int]:
    """Self instructions per function (callgrind_annotate, every function)."""
    done = subprocess.run(["callgrind_annotate", "--inclusive=no", "--threshold=100", str(path)], capture_output=True,
                          text=True, check=True)
    out: dict[str, int] = {}
    for line in done.stdout.splitlines():
        found = re.match(r"^\s*([\d,]+)\s+(?:\([^)]*\)\s+)?(\S.*?)\s*$", line)
        if found and ":" in found.group(2):
            name = re.sub(r"^[^:]*:", "", found.group(2), count=1)  # the source file: '???' where it has no symbols
            out[name] = out.get(name, 0) + int(found.group(1).replace(",", ""))
    return out


def _short(name: str, width: int = 110) -> str:
    name = re.sub(r" \[(?:.*/)?([^/\]]+)\]$", r" [\1]", name)  # the object's file name only
    return name if len(name) <= width else name[:width - 3] + "..."


def count(args: argparse.Namespace) -> Outcome:
    """Run the three loops under callgrind on 2 ranks; per-step counts, their ratios and the functions added."""
    n = args.count_steps
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        helper = build_helper(folder)
        wrap = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--dump-line=no",
                f"--callgrind-out-file={folder}/callgrind.%q{{RANK}}"]
        env = {"PYTHONHASHSEED": "0"} if args.native_kernels else {"PYTHONHASHSEED": "0", **SSE_KERNELS}
        run_ranks("overhead", 2, with_args(args, steps=2 * n, helper=str(helper)), wrap=wrap, env=env, timeout=7200)
        files = _windows(folder)
        missing = [(r, f"{loop}.{w}") for r in (0, 1) for loop in LOOPS for w in "ab" if (r, f"{loop}.{w}") not in files]
        if missing:
            raise SystemExit(f"callgrind wrote no dump for {missing} (found {sorted(files)})")
        window = {(loop, w): sum(_total(files[r, f"{loop}.{w}"]) for r in (0, 1)) / n for loop in LOOPS for w in "ab"}
        added: dict[str, float] = {}
        for loop, sign in (("strategy", 1), ("floor", -1)):
            for (_, name), path in files.items():
                if name.startswith(loop + "."):
                    for fn, ir in _functions(path).items():
                        added[fn] = added.get(fn, 0.0) + sign * ir / (2 * n)
    per_step = {loop: (window[loop, "a"] + window[loop, "b"]) / 2 for loop in LOOPS}
    spread = max(abs(window[loop, "a"] / window[loop, "b"] - 1) for loop in LOOPS)
    lines = ["| loop | instructions per step (both ranks) | window a | window b |", "|---|---|---|---|"]
    lines += [f"| {LABELS[loop]} | {per_step[loop]:,.0f} | {window[loop, 'a']:,.0f} | {window[loop, 'b']:,.0f} |"
              for loop in LOOPS]
    lines.append(f"GPT 4 blocks x 128, {args.schedule}, m={args.microbatches}, batch {args.batch}, 2 ranks; "
                 f"{args.warmup} warm-up steps, then 2 windows of {n} steps each (callgrind, every thread)")
    lines += ["", f"functions the strategy adds most over the floor (self instructions per step; the strategy's "
                  f"total adds {per_step['strategy'] - per_step['floor']:,.0f}):", "",
              "| instructions per step | function |", "|---|---|"]
    top = sorted(added.items(), key=lambda item: -item[1])[:10]
    lines += [f"| {ir:+,.0f} | `{_short(fn)}` |" for fn, ir in top]
    return Outcome("\n".join(lines), {
        "instructions_per_step_hand": per_step["hand"], "instructions_per_step_floor": per_step["floor"],
        "instructions_per_step_strategy": per_step["strategy"], "instructions_window_spread": spread,
        "instructions_overhead_ratio": per_step["strategy"] / per_step["hand"],
        "instructions_over_floor": per_step["strategy"] / per_step["floor"]})
