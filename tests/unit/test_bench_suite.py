"""The benchmark suite's plumbing, without running a benchmark: the registry finds one module per benchmark, every
quick form parses, ``compare`` reads runs, recorded figures keep their fields, the shared helpers do what they say."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.common import REPO, Benchmark, benchmarks, interleave, kendall_tau, noise_floor, paired_ratio
from bench.records import FIELDS, load, table

EXPECTED = {"async_checkpoint", "breakdown", "bubble", "cluster", "compile", "dp_overlap", "gpt2", "hostcost", "lost_host",
            "memory", "offload", "overhead", "planner", "rebalance", "schedules", "sigterm", "varlen"}


def test_the_registry_finds_every_benchmark_module() -> None:
    found = benchmarks()
    assert set(found) == EXPECTED, set(found) ^ EXPECTED
    for name, spec in found.items():
        assert isinstance(spec, Benchmark) and spec.summary and spec.run.__module__ == f"bench.{name}"
        assert spec.quick is not None or spec.slow, f"{name}: no quick form and no reason why"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_quick_form_parses(name: str) -> None:
    spec = benchmarks()[name]
    args = spec.parser().parse_args(list(spec.quick or ()) + ["--json", "out.json"])
    assert args.json == "out.json"


def test_listing_needs_no_heavy_import() -> None:
    done = subprocess.run([sys.executable, "-c", "import sys, runpy; sys.argv = ['bench']; "
                           "runpy.run_module('bench', run_name='__main__')\n"
                           "assert 'torch' not in sys.modules and 'lightning' not in sys.modules"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode in (0, None), done.stderr
    assert "| overhead |" in done.stdout and "python -m bench.gpu" in done.stdout


def _run(path: Path, figures: dict[str, float], commit: str) -> str:
    env = {"commit": commit, "date": "2026-12-05", "cores": 2, "cpu": "test CPU", "torch": "2.13.0", "load": 0.5}
    path.write_text(json.dumps({"environment": env, "quick": True,
                                "benchmarks": {"overhead": {"argv": [], "figures": figures, "seconds": 1.0}}}))
    return str(path)


def test_compare_prints_the_ratio_of_each_shared_figure(tmp_path: Path) -> None:
    a = _run(tmp_path / "a.json", {"overhead_ratio": 1.05, "noise_floor": 0.01}, "aaa")
    b = _run(tmp_path / "b.json", {"overhead_ratio": 1.02}, "bbb")
    done = subprocess.run([sys.executable, "-m", "bench", "compare", a, b], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "| overhead.overhead_ratio | 1.050 | 1.020 | 0.971 |" in done.stdout
    assert "only in A: overhead.noise_floor" in done.stdout and "commit aaa" in done.stdout


def test_recorded_figures_have_every_field_and_a_table() -> None:
    records = load()
    assert records and all(set(FIELDS) <= set(r) for r in records)
    assert "| `overhead_ratio` |" in table("overhead")
    assert table("no such benchmark") == "(no figures recorded yet)\n"


def test_interleave_reverses_every_other_round() -> None:
    seen: list[str] = []
    out = interleave(["a", "b", "c"], 3, lambda v: seen.append(v) or len(seen))
    assert seen == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert out == {"a": [1, 6, 7], "b": [2, 5, 8], "c": [3, 4, 9]}


def test_noise_floor_and_paired_ratio() -> None:
    assert noise_floor([1.0, 1.0, 1.0, 1.0]) == 0.0
    assert noise_floor([1.0, 1.1, 1.0, 1.1]) == pytest.approx(1 - 1 / 1.1)
    assert paired_ratio([2.0, 3.0, 4.0], [1.0, 3.0, 2.0]) == 2.0


def test_kendall_tau_counts_concordant_and_discordant_pairs() -> None:
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)  # 5 concordant pairs, 1 discordant
    assert kendall_tau([1, 1, 2], [1, 2, 3]) == pytest.approx(2 / (3 * 2) ** 0.5)  # tau-b: a tie in the first
