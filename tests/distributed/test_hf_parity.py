"""``HFCausalLM`` (transformers GPT-2, Llama, Mistral, Qwen2) on a 2-rank pipeline vs the transformers model's own
forward and loss on one device: every parameter after 3 SGD steps, the loss of every step and a validation loss, on
unevenly padded batches with -100 labels (token-weighted loss), and a Llama on packed rows. Plus local weights: each
rank reads only its layers."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from tests.distributed.launcher import launch
from tests.distributed.parity import ATOL
from tests.distributed.scenarios.hf import HFCase, make_config, padded_data, run_reference
from tests.models import SameOrderAsDistributedSampler
from tests.torch_tiers import refused

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.parity, pytest.mark.distributed]

FAMILIES = ["gpt2", "llama", "mistral", "qwen2"]


def check_parity(results: list, index: int, case: HFCase) -> None:
    ref, full = run_reference(case)
    seen: set[str] = set()
    for rank, rank_results in enumerate(results):
        got = rank_results[index]
        for name, value in got["params"].items():  # a tie's copies on both ranks are each checked
            torch.testing.assert_close(value, full[name], atol=ATOL, rtol=0,
                                       msg=lambda m, name=name, rank=rank: f"{case} rank {rank} {name}: {m}")
        seen |= set(got["params"])
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), atol=ATOL, rtol=0)
        assert abs(got["val_loss"] - ref["val_loss"]) < ATOL, (case, got["val_loss"], ref["val_loss"])
    assert seen == set(ref["params"]), f"{case}: parameters not covered: {set(ref['params']) ^ seen}"
    # the step actually moved the weights (parity is not vacuous)
    assert ref["losses"][0] != ref["losses"][-1]


@pytest.mark.compact  # make test-torch: on every supported torch
@pytest.mark.timeout(600)
def test_hf_models_match_transformers_on_one_device(tmp_path) -> None:
    pretrained = tmp_path / "llama_tied"
    torch.manual_seed(0)
    config = make_config("llama")
    config.tie_word_embeddings = True
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(pretrained)
    schedules = ("1f1b",) if refused("split_backward") else ("1f1b", "zbv")  # restricted torch tier: zbv refused
    cases = [HFCase(family=f, schedule=s, stages_per_rank=2 if s == "zbv" else None)
             for f in FAMILIES for s in schedules]
    cases.append(HFCase(family="gpt2", from_model=True))  # HFCausalLM(model): built whole, then split
    cases.append(HFCase(family="llama", sliced=True))  # ids, mask and labels as strided views (the mask crosses)
    cases.append(HFCase(family="llama", packed=True))  # packed rows: attention inside each document (seq_idx)
    cases.append(HFCase(pretrained=str(pretrained)))  # last: the keys-read checks below
    # the padding is uneven across micro-batches (a mean of micro-batch means would not be the batch loss)
    first = next(iter(DataLoader(padded_data(32), batch_size=8, sampler=SameOrderAsDistributedSampler(32))))
    counts = (first["labels"][:, 1:] != -100).sum(1).view(4, 2).sum(1)
    assert len(set(counts.tolist())) > 1, counts
    results = launch("hf", 2, cases, tmp_path / "run", timeout=540)
    for i, case in enumerate(cases):
        check_parity(results, i, case)
    # local weights: each rank read only its own layers' tensors, each tensor once, all of them between the ranks
    from lightning_pipe.hf import SafetensorsCheckpoint

    read = [rank_results[-1]["keys_read"] for rank_results in results]
    assert all(len(keys) == len(set(keys)) for keys in read), read
    # the tied embedding / head is stored once, as the embedding: both ends read it (rank 1 for its head's copy)
    assert set(read[0]) & set(read[1]) == {"model.embed_tokens.weight"}, read
    assert set(read[0]) | set(read[1]) == SafetensorsCheckpoint(pretrained).keys()
    assert {k.split(".")[1] for k in read[0]} == {"embed_tokens", "layers"}  # embedding, decoder layers 0-1
    assert {k.split(".")[1] for k in read[1]} == {"norm", "embed_tokens"}  # final norm, head (tied)


@pytest.mark.timeout(600)
def test_hf_models_split_by_their_tensor_parallel_plan_match_one_device(tmp_path) -> None:
    """Pipeline 2 x tensor 2 (4 ranks): each decoder layer split by transformers' ``base_model_tp_plan`` (q/k/v
    and gate/up column-wise, o and down row-wise; grouped-query attention: 4 heads, 2 key/value heads, one of
    each per tensor rank). Llama with its embedding and head tied across the stages; Qwen2 with a sliding window
    on one layer. Families without a usable plan are refused by name on every rank."""
    cases = [HFCase(family="llama", tp=2, tied=True), HFCase(family="qwen2", tp=2, schedule="gpipe")]
    refused = [HFCase(family="gpt2", tp=2, steps=1, expect_error=True)]
    results = launch("hf", 4, cases + refused, tmp_path / "run", timeout=540)
    for i, case in enumerate(cases):
        check_parity(results, i, case)
    for rank_results in results:
        error = rank_results[len(cases)]["error"]
        assert "base_model_tp_plan" in error and "gpt2" in error and "tensor_parallel_size" in error, error
