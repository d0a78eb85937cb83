"""Issue 23.3: each pipeline stage draws from its own random stream ([Note: random streams per stage] in
lightning_pipe/runtime/rng.py). Every rank is seeded alike, as ``seed_everything`` does; dropout masks are recorded
row by row (64 positions: equal rows by chance have probability 2**-64)."""

from __future__ import annotations

from collections import defaultdict
from itertools import combinations
from typing import Any

import pytest
import torch

from tests.distributed.launcher import launch
from tests.distributed.scenarios.rng import RngCase, run_reference

pytestmark = [pytest.mark.distributed]

N_LAYERS = 8
CASES = [
    RngCase(schedule="1f1b"),  # 2 stages
    RngCase(schedule="1f1b"),  # the same again: bit-identical
    RngCase(schedule="1f1b", recompute=1),  # every layer recomputed in backward: replays its draws exactly
    RngCase(schedule="interleaved_1f1b", stages_per_rank=2),  # 4 stages, 2 per rank
    RngCase(schedule="gpipe", seed=99),
]


def rows_per_stage(results: list[list[dict[str, Any]]], i: int, stages: int) -> dict[int, set[bytes]]:
    out: dict[int, set[bytes]] = defaultdict(set)
    for rank in results:
        for layer, row in rank[i]["masks"]:
            out[layer // (N_LAYERS // stages)].add(row)
    return out


def params(results: list[list[dict[str, Any]]], i: int) -> dict[str, torch.Tensor]:
    return {name: p for rank in results for name, p in rank[i]["params"].items()}


@pytest.mark.compact  # make test-torch: the stage's compute overrides, on every supported torch
@pytest.mark.timeout(600)
def test_each_stage_draws_its_own_stream_reproducibly(tmp_path) -> None:
    results = launch("rng", 2, CASES, tmp_path, timeout=300)
    one_device = {row for _, row in run_reference(1234)["masks"]}
    other_seed = {row for _, row in run_reference(99)["masks"]}
    assert len(one_device) == 2 * 6 * 8 and not one_device & other_seed  # 2 steps x 6 blocks x 8 rows
    for i, case in enumerate(CASES):
        stages = 2 * (case.stages_per_rank or 1)
        rows = rows_per_stage(results, i, stages)
        assert sorted(rows) == list(range(stages)), (case, sorted(rows))
        for a, b in combinations(range(stages), 2):
            assert not rows[a] & rows[b], f"{case}: stages {a} and {b} drew {len(rows[a] & rows[b])} equal masks"
        # the pipeline differs from one device as another seed does: no mask in common
        drawn = set().union(*rows.values())
        assert len(drawn) >= 2 * 6 * 8 and not drawn & one_device, case
    # same seed, same layout: the same draws in the same order, the same parameters, bit for bit
    assert [r[0]["masks"] for r in results] == [r[1]["masks"] for r in results]
    for name, want in params(results, 0).items():
        assert torch.equal(params(results, 1)[name], want), name
        # recomputation replays the forward's draws: the same training, up to the order of float operations
        torch.testing.assert_close(params(results, 2)[name], want, atol=1e-6, rtol=0)
