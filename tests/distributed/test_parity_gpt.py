"""The bundled GPT (embedding and head tied across the first and last stage, AdamW + warm-up/cosine schedule,
clipping) under the pipeline vs the same GPT on one device; and both recipes on packed rows."""

from __future__ import annotations

import pytest

from tests.distributed.launcher import launch
from tests.distributed.parity import assert_case_parity
from tests.distributed.scenarios import TrainingCase

pytestmark = [pytest.mark.parity, pytest.mark.distributed]

# The tiny GPT's layer list: embedding, 3 blocks, final norm, head. Its tie spans two stages (or, under V
# placement, two stages of one rank): per-stage gradient norms do not add up, so that check is off.
GPT = dict(model="gpt", n_layers=6, tied=True, optimizer="adamw", n_data=64, check_grad_norms=False)

PACKED = dict(GPT, model="gpt_packed", dp=2)

CASES = {
    2: [TrainingCase(schedule="1f1b", clip=1.0, **GPT),
        # accumulation: the tie sum rides the agreement only on the batch the optimizer step follows (the first
        # batch's part is summed then), [Note: tie sums in the agreement]
        TrainingCase(schedule="1f1b", acc=2, **GPT),
        # V placement: both ends of the tied weight on rank 0 (one object, two stages)
        TrainingCase(schedule="zbv", stages_per_rank=2, acc=2, **GPT),
        # built on the meta device; both ends of the tie on rank 0 must be re-tied after allocation
        TrainingCase(model="meta", schedule="zbv", stages_per_rank=2, tied=True, clip=0.05, check_grad_norms=False),
        # the Llama recipe: meta-built, seeded per layer, its tied head on the last stage
        TrainingCase(model="llama", n_layers=6, tied=True, optimizer="adamw", n_data=64, clip=1.0,
                     check_grad_norms=False),
        # the Llama recipe on packed rows: RoPE restarts per document (one replica: the logged losses compare too)
        TrainingCase(model="llama_packed", n_layers=6, tied=True, optimizer="adamw", n_data=64, clip=1.0,
                     check_grad_norms=False)],
    4: [TrainingCase(schedule="gpipe", clip=1.0, **GPT),
        # packed rows (data=packed): documents with their own positions and block-diagonal attention, -100 on the
        # rows' padding (uneven token counts per micro-batch and replica), data parallel 2 x pipeline 2
        TrainingCase(schedule="1f1b", clip=0.05, **PACKED),
        TrainingCase(schedule="interleaved_1f1b", stages_per_rank=2, acc=2, **PACKED),
        TrainingCase(schedule="zbv", stages_per_rank=2, **PACKED),
        TrainingCase(schedule="dualpipev", stages_per_rank=2, clip=0.05, **PACKED)],
}


@pytest.mark.parametrize("pp", [2, 4], ids=["pp2", "pp4"])
@pytest.mark.timeout(420)
def test_gpt_with_tied_weights_matches_single_device(pp: int, tmp_path) -> None:
    cases = CASES[pp]
    results = launch("training", pp, cases, tmp_path, timeout=300)
    for i, case in enumerate(cases):
        assert_case_parity(results, i, case)
