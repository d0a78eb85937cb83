"""SIGTERM to a pipeline job's main process at random points of a step: does every rank end, and how fast?

What SLURM preemption and Kubernetes do. Each trial starts ``tests/distributed/fault_script.py`` the way a user runs a
script (2 CPU ranks, Lightning's popen launcher: the main process is rank 0 and launches rank 1) with
``ModelCheckpoint(save_last=True, every_n_train_steps=10)``, validation every 7 batches and compute-bound layers
(10 ms per micro-batch each; ``--sleep``: sleeping layers, which let signal handlers run at once), waits until rank 0
finished a random global step in [3, 25], sleeps a random fraction of a step, sends SIGTERM to the main process and
measures the time until *both* processes have ended. Per trial: time to exit, rank 0's exit code, the step both ranks
stopped after, whether ``last.ckpt`` was written at that step, and the marks the script left (``stopping``: the
agreed stop reached ``on_exception``; ``exit``: the last atexit hook; the rest is interpreter shutdown).

``--without-faults N`` first runs N trials with ``lightning_pipe.lightning.faults`` switched off (Lightning's own
SIGTERM handler, which runs a broadcast inside the handler), capped at ``--cap`` seconds, for comparison.

Figures: ``sigterm_all_exited`` (the share of trials in which every rank ended within 30 s, exit code 0, both
ranks at the same step), ``max_s`` (the slowest time to exit) and ``median_s``.

    python -m bench sigterm [--trials 20] [--without-faults 3] [--cap 60]
"""

from __future__ import annotations

import argparse
import random
import signal
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import Benchmark, Outcome
from tests.distributed import fault_script as fs

LIMIT_S = 30.0


def step_seconds(out: Path, proc: object, at: int) -> float:
    """Seconds of one training step, from rank 0's progress file (two consecutive steps)."""
    fs.wait_for_step(out, proc, at)  # type: ignore[arg-type]
    t0 = time.monotonic()
    fs.wait_for_step(out, proc, at + 1)  # type: ignore[arg-type]
    return time.monotonic() - t0


def trial(out: Path, rng: random.Random, cap: float, without_faults: bool, busy: bool) -> dict:
    target = rng.randint(3, 25)
    proc = fs.start(out, "train", ckpt=True, without_faults=without_faults, busy=busy)
    try:
        step_s = step_seconds(out, proc, target - 1)
        offset = rng.uniform(0.0, step_s)
        time.sleep(offset)
        sent_wall, sent = time.time(), time.monotonic()
        proc.send_signal(signal.SIGTERM)
        seconds, codes = fs.time_to_exit(out, proc, sent, cap)
    finally:
        fs.cleanup(proc)
    step0, step1 = fs.read_int(out / "step0"), fs.read_int(out / "step1")
    marks = {}
    for line in (out / "times0").read_text().splitlines() if (out / "times0").exists() else []:
        event, stamp = line.split()
        marks[event] = float(stamp) - sent_wall
    saved = fs.last_checkpoint_step(out) == step0  # ours after SIGTERM, or ModelCheckpoint's own at that step
    return dict(target=target, step_s=step_s, offset=offset, seconds=seconds, code=codes[0], step0=step0,
                step1=step1, saved=saved, marks=marks)


def show(i: int, r: dict) -> str:
    marks = " ".join(f"{k}={v:.2f}s" for k, v in r["marks"].items())
    line = (f"trial {i:2d}: signal {r['offset']:.2f}s after step {r['target']} ended (it took {r['step_s']:.2f}s) -> "
            f"all ranks ended in {r['seconds']:.2f}s, rank 0 exit {r['code']}, stopped after step "
            f"{r['step0']}/{r['step1']} (rank 0/1), last.ckpt at that step: {r['saved']}  [{marks}]")
    print(line, flush=True)
    return line


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--without-faults", type=int, default=0, metavar="N")
    p.add_argument("--cap", type=float, default=60.0, help="seconds before a trial counts as hung")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sleep", action="store_true",
                   help="layers sleep instead of computing (signal handlers then run at once, hiding the hang)")


def run(args: argparse.Namespace) -> Outcome:
    rng = random.Random(args.seed)
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.without_faults:
            lines.append(f"--- without lightning_pipe.lightning.faults (Lightning's handler), cap {args.cap:.0f}s")
            hung = 0
            for i in range(args.without_faults):
                r = trial(Path(tmp) / f"without{i}", rng, args.cap, without_faults=True, busy=not args.sleep)
                lines.append(show(i, r))
                hung += r["seconds"] > LIMIT_S
            lines.append(f"without faults: {hung}/{args.without_faults} trials still running after {LIMIT_S:.0f}s")
        lines.append("--- with lightning_pipe.lightning.faults")
        results = []
        for i in range(args.trials):
            r = trial(Path(tmp) / f"trial{i}", rng, args.cap, without_faults=False, busy=not args.sleep)
            lines.append(show(i, r))
            results.append(r)
    times = [r["seconds"] for r in results]
    if not results:
        return Outcome("\n".join(lines), {})
    ok = sum(t <= LIMIT_S and r["code"] == 0 and r["step0"] == r["step1"] for t, r in zip(times, results))
    finite = [t for t in times if t != float("inf")]
    lines.append(f"every rank out within {LIMIT_S:.0f} s in {ok}/{len(results)}; same stop step on both ranks in "
                 f"{sum(r['step0'] == r['step1'] for r in results)}/{len(results)}; last.ckpt at the stop step in "
                 f"{sum(r['saved'] for r in results)}/{len(results)}")
    return Outcome("\n".join(lines), {"sigterm_all_exited": ok / len(results), "median_s": statistics.median(times),
                                      "max_s": max(finite) if finite else float("inf")})


BENCHMARK = Benchmark(
    "sigterm", "SIGTERM to a 2-rank training script's main process at a random point of a step: does every rank "
    "end, how fast, at the same step, with last.ckpt", run, arguments, quick=("--trials", "1"))
