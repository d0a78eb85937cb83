"""The benchmark suite.

    python -m bench                              # list the benchmarks
    python -m bench NAME [options] [--json OUT]  # run one (python -m bench NAME --help: its options)
    python -m bench all --quick [--json OUT]     # every benchmark with a quick form, one JSON with every figure
    python -m bench compare A.json B.json        # the ratios between two runs' figures
    python -m bench record RUN.json [--note TEXT] [--figures a,b]   # add a run's figures to bench/records.json

Each benchmark prints its report, then its figures as ``name=value`` lines. A JSON file holds the environment
(commit, date, machine, torch, load) and, per benchmark, its figures, arguments and duration.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, Outcome, benchmarks, environment, worker_main


def figure(value: float) -> str:
    """3 decimals for ratios and small values, 1 for large ones, integers as they are."""
    if abs(value - round(value)) < 1e-9:
        return str(int(value))
    return f"{value:.1f}" if abs(value) >= 100 else f"{value:.3f}"


def show(outcome: Outcome) -> None:
    print(outcome.report.rstrip("\n"))
    for name, value in outcome.figures.items():
        print(f"{name}={figure(value)}")


def run_one(name: str, argv: list[str]) -> int:
    spec = benchmarks()[name]
    args = spec.parser().parse_args(argv)
    env, start = environment(), time.perf_counter()
    outcome = spec.run(args)
    show(outcome)
    if args.json:
        settings = [a for i, a in enumerate(argv) if a != "--json" and (i == 0 or argv[i - 1] != "--json")]
        entry = {"argv": settings, "figures": outcome.figures, "seconds": round(time.perf_counter() - start, 1)}
        write(args.json, {"environment": env, "quick": False, "benchmarks": {name: entry}})
    return 0


def write(path: str, run: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(run, indent=1) + "\n")
    print(f"wrote {path}")


def run_all(argv: list[str]) -> int:
    """Every benchmark with a quick form, each in a process of its own (one that fails is reported, the rest run)."""
    if "--quick" not in argv:
        print("python -m bench all needs --quick (the full forms take hours on 2 cores: run them one by one)")
        return 2
    out = argv[argv.index("--json") + 1] if "--json" in argv else None
    run: dict[str, Any] = {"environment": environment(), "quick": True, "benchmarks": {}}
    start = time.perf_counter()
    for name, spec in benchmarks().items():
        if spec.quick is None:
            print(f"=== {name}: skipped ({spec.slow or 'no quick form'})", flush=True)
            continue
        print(f"=== {name} {' '.join(spec.quick)}", flush=True)
        began = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            part = Path(tmp) / "part.json"
            done = subprocess.run([sys.executable, "-m", "bench", name, *spec.quick, "--json", str(part)], cwd=REPO,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
            entry: dict[str, Any] = ({"error": f"exit status {done.returncode}"} if done.returncode
                                     else json.loads(part.read_text())["benchmarks"][name])
        entry["seconds"] = round(time.perf_counter() - began, 1)
        run["benchmarks"][name] = entry
        print(f"=== {name}: {entry['seconds']:.0f} s", flush=True)
    run["seconds"] = round(time.perf_counter() - start, 1)
    print(f"all --quick: {run['seconds']:.0f} s, {sum('error' in e for e in run['benchmarks'].values())} failed")
    if out:
        write(out, run)
    return 1 if any("error" in e for e in run["benchmarks"].values()) else 0


def figures(path: str) -> tuple[dict[str, Any], dict[str, float]]:
    run = json.loads(Path(path).read_text())
    flat = {f"{name}.{figure}": value for name, entry in run["benchmarks"].items()
            for figure, value in entry.get("figures", {}).items()}
    return run["environment"], flat


def compare(a: str, b: str) -> int:
    """The figures two runs share, side by side, with B / A; then those only one of them has."""
    env_a, fig_a = figures(a)
    env_b, fig_b = figures(b)
    for label, env, path in (("A", env_a, a), ("B", env_b, b)):
        print(f"{label}: {path}: commit {env['commit']}, {env['date']}, {env['cores']} cores ({env['cpu']}), "
              f"torch {env['torch']}, load {env['load']}")
    print("\n| figure | A | B | B / A |\n|---|---|---|---|")
    for key in sorted(set(fig_a) & set(fig_b)):
        x, y = fig_a[key], fig_b[key]
        ratio = f"{y / x:.3f}" if x else "—"
        print(f"| {key} | {figure(x)} | {figure(y)} | {ratio} |")
    for label, only in (("A", set(fig_a) - set(fig_b)), ("B", set(fig_b) - set(fig_a))):
        if only:
            print(f"\nonly in {label}: {', '.join(sorted(only))}")
    return 0


def listing() -> int:
    print(__doc__.strip() + "\n")
    print("| benchmark | quick form | what it measures |\n|---|---|---|")
    for name, spec in benchmarks().items():
        quick = " ".join(spec.quick) if spec.quick is not None else f"— ({spec.slow})"
        print(f"| {name} | {quick or '(defaults)'} | {spec.summary} |")
    print("| gpu | — (needs a CUDA GPU) | the one-GPU check: `python -m bench.gpu` (docs/gpu-check.md) |")
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "list"):
        return listing()
    command, rest = argv[0], argv[1:]
    if command == "--worker":
        worker_main(*rest)
        return 0
    if command == "all":
        return run_all(rest)
    if command == "compare":
        return compare(*rest)
    if command == "record":
        from bench.records import record_main

        return record_main(rest)
    if command not in benchmarks():
        print(f"unknown benchmark {command!r}; `python -m bench` lists them")
        return 2
    return run_one(command, rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
