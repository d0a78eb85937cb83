"""Soak (issue 23): 240 tiny training steps on 2 ranks, timeline on, epochs and validation along the way; after a
warm-up nothing grows — open files and threads exactly, live tensors in none of the last three samples, Python
objects within a few; resident memory by its robust slope.

An outside 1,500-step soak measured +2.1 MiB of RSS per 1,000 steps. That growth is torch's flight recorder (a ring
of the last 2,000 collectives, default on, also for gloo): bounded, it stops once the ring is full. Measured here
(2026-12-01, 2 shared cores, 500 steps): 6.6 MiB per 1,000 steps with it, 0.35 with ``TORCH_FR_BUFFER_SIZE=0``; a
plain gloo all-reduce loop grows the same way for 2,000 calls, then stays flat. So the soak turns the recorder off
and returns freed memory to the OS before each sample (``malloc_trim``): what stays resident is held by someone, and
the limit (4 MiB per 1,000 steps, 10 times the measured slope) catches a kept graph or batch per step."""

from __future__ import annotations

import statistics
from itertools import combinations
from pathlib import Path

import pytest

from tests.distributed.launcher import launch, launch_runs
from tests.distributed.parity import assert_case_parity
from tests.distributed.scenarios import TrainingCase
from tests.distributed.scenarios.soak import RefitCase, SoakCase

pytestmark = [pytest.mark.distributed]

# torch's shape inference, the first epochs' and validation's buffers, the timeline's window (its last 64 records)
WARMUP_STEPS = 80
RSS_LIMIT = 4 * 2**20 / 1000  # bytes per step: 4 MiB per 1,000 steps


def theil_sen(points: list[tuple[int, int]]) -> float:
    """The median of the pairwise slopes: one jump of the allocator moves it little (a least-squares fit a lot)."""
    return statistics.median((y2 - y1) / (x2 - x1) for (x1, y1), (x2, y2) in combinations(points, 2) if x2 != x1)


@pytest.mark.timeout(240)
def test_soak_nothing_grows_per_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):  # the flight recorder (see above)
        monkeypatch.setenv(name, "0")
    results = launch("soak", 2, [SoakCase()], tmp_path, timeout=200)
    for rank, (result,) in enumerate(results):
        samples = [s for s in result["samples"] if s["step"] >= WARMUP_STEPS]
        assert len(samples) >= 8, result
        first, last = samples[0], samples[-1]
        summary = f"rank {rank}: {first} -> {last}; tensors by step {[(s['step'], s['tensors']) for s in samples]}"
        # Growth that stays: the last sample 2 tensors over (seen once in CI, 2026-12-03; not in 5 runs here, on idle
        # and on loaded cores) is a snapshot's accident; a leak per step or per epoch is over in all of the last three.
        assert min(s["tensors"] for s in samples[-3:]) <= first["tensors"], summary
        assert last["objects"] <= first["objects"] + 50, summary
        assert max(s["fds"] for s in samples) <= first["fds"], summary
        assert max(s["threads"] for s in samples) <= first["threads"], summary
        assert max(s["os_threads"] for s in samples) <= first["os_threads"], summary
        slope = theil_sen([(s["step"], s["rss"]) for s in samples])
        print(f"rank {rank}: RSS slope {slope * 1000 / 2**20:.2f} MiB per 1000 steps, {summary}")
        assert slope < RSS_LIMIT, f"RSS grows by {slope * 1000 / 2**20:.1f} MiB per 1000 steps: {summary}"


@pytest.mark.compact  # make test-torch: torch's group registry and mesh naming, on every supported torch
@pytest.mark.timeout(240)
def test_fits_in_one_process_reuse_their_process_groups_and_stay_exact(tmp_path: Path) -> None:
    """[Note: process groups are reused]: a fit leaves no process group behind (before: 2 gloo groups, 6 threads and
    10 file descriptors per fit on each of 2 ranks); a fit that ended in an exception makes every rank start afresh
    once; then a tied interleaved run on the kept groups still matches one device."""
    refit = RefitCase()
    exact = TrainingCase(schedule="interleaved_1f1b", tied=True, optimizer="adamw", acc=2, clip=0.05,
                         check_grad_norms=False)
    results = launch_runs(2, [("refit", refit), ("training", exact)], tmp_path, timeout=200)
    for rank, (result, _) in enumerate(results):
        fits = result["fits"]
        summary = f"rank {rank}: {fits}"
        assert [f["ok"] for f in fits] == [i != refit.fail_at for i in range(len(fits))], summary
        before, after = fits[: refit.fail_at], fits[refit.fail_at + 1:]
        # one group for every fit before the failure, a fresh one after it, kept from then on
        assert len({f["pipeline_group"] for f in before}) == 1, summary
        assert len({f["pipeline_group"] for f in after}) == 1, summary
        assert after[0]["pipeline_group"] != before[0]["pipeline_group"], summary
        for run in (before, after):  # nothing grows from fit to fit (the forgotten groups are left, once)
            assert all(f["os_threads"] <= run[0]["os_threads"] and f["fds"] <= run[0]["fds"] for f in run), summary
    assert_case_parity(results, 1, exact)
