"""The bundled GPT (embedding and head tied across the first and last stage, AdamW + warm-up/cosine schedule,
clipping) under the pipeline vs the same GPT on one device."""

from __future__ import annotations

import pytest

from tests.distributed.launcher import launch
from tests.distributed.test_parity_core import assert_case_parity

pytestmark = [pytest.mark.parity, pytest.mark.distributed]

CASES = {
    2: [dict(model="gpt", schedule="1f1b", clip=1.0, tied=True, n_data=64),
        # V placement: both ends of the tied weight on rank 0 (one object, two stages)
        dict(model="gpt", schedule="zbv", stages_per_rank=2, acc=2, tied=True, n_data=64),
        # built on the meta device; both ends of the tie on rank 0 must be re-tied after allocation
        dict(model="meta", schedule="zbv", stages_per_rank=2, tied=True, clip=0.05)],
    4: [dict(model="gpt", schedule="gpipe", clip=1.0, tied=True, n_data=64)],
}


@pytest.mark.parametrize("pp", [2, 4], ids=["pp2", "pp4"])
@pytest.mark.timeout(420)
def test_gpt_with_tied_weights_matches_single_device(pp: int, tmp_path) -> None:
    cases = CASES[pp]
    results = launch("training", pp, [dict(c) for c in cases], tmp_path, timeout=300)
    for i, case in enumerate(cases):
        assert_case_parity(results, i, case)
