"""Packed sequences: the packer, positions and the block-diagonal mask, and the recipes' GPT / Llama computing on a
packed row exactly what each document computes alone ([Note: packed sequences])."""

from __future__ import annotations

import pytest
import torch

from lightning_pipe.layers.packing import (
    block_diagonal_causal_mask,
    documents_from_positions,
    pack_documents,
    plan_rows,
    positions_from_documents,
)


def test_plan_rows_is_best_fit_decreasing_and_refuses_a_document_longer_than_a_row() -> None:
    assert plan_rows([3, 4, 2, 5, 1], 6) == [[3, 4], [1, 2], [0]]  # 5+1, 4+2, 3
    lengths = torch.randint(8, 65, (2000,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = plan_rows(lengths, 64)
    assert sorted(i for row in rows for i in row) == list(range(2000))
    assert all(sum(lengths[i] for i in row) <= 64 for row in rows)
    assert 1 - sum(lengths) / (64 * len(rows)) < 0.03  # padding
    with pytest.raises(ValueError, match=r"document 1 has 7 and row_length is 6.*data.max_doc_length"):
        plan_rows([3, 7], 6)


def test_pack_documents_lays_out_tokens_document_ids_and_padding() -> None:
    docs = [torch.tensor([5, 6, 7]), torch.tensor([8, 9]), torch.tensor([1, 2, 3, 4])]
    rows = [[0, 1], [2]]
    packed, ids = pack_documents(docs, rows, 6, pad_value=0)
    assert packed.tolist() == [[5, 6, 7, 8, 9, 0], [1, 2, 3, 4, 0, 0]]
    assert ids.tolist() == [[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0]]
    labels, _ = pack_documents(docs, rows, 6, pad_value=-100)  # the same plan: aligned with the inputs
    assert labels[0, -1] == -100 and labels[1, -2:].tolist() == [-100, -100]
    assert positions_from_documents(ids).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]
    # transformers' rule on position ids gives the same documents back (numbered from 0)
    assert documents_from_positions(positions_from_documents(ids)).tolist() == [[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 1, 1]]


def test_block_diagonal_causal_mask() -> None:
    mask = block_diagonal_causal_mask(torch.tensor([[1, 1, 2, 2, 2, 0]]))
    assert mask.shape == (1, 1, 6, 6)
    want = torch.tensor([[1, 0, 0, 0, 0, 0],
                         [1, 1, 0, 0, 0, 0],
                         [0, 0, 1, 0, 0, 0],
                         [0, 0, 1, 1, 0, 0],
                         [0, 0, 1, 1, 1, 0],
                         [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(mask[0, 0], want)
    assert mask[0, 0].any(-1).all()  # every query sees at least itself (padding too): no NaN row in SDPA


def _gpt() -> torch.nn.Module:
    from recipes.gpt.model import GPT

    return GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def _llama() -> torch.nn.Module:
    from recipes.llama.model import Llama

    model = Llama(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, multiple_of=16)
    model.configure_model()
    return model


@pytest.mark.parametrize("build", [_gpt, _llama], ids=["gpt", "llama"])
def test_a_packed_row_computes_each_document_as_if_alone(build) -> None:
    torch.manual_seed(0)
    model = build().eval()
    docs = [torch.randint(0, 64, (n,)) for n in (5, 7, 3)]
    rows = [[0, 1, 2]]
    packed, ids = pack_documents(docs, rows, 16, pad_value=0)
    with torch.no_grad():
        got = model((packed, ids))[0]
        alone = torch.cat([model(d.unsqueeze(0))[0] for d in docs])
    torch.testing.assert_close(got[:15], alone, atol=1e-6, rtol=0)
    # the loss counts real tokens only: padding labels are -100
    labels, _ = pack_documents([torch.roll(d, -1) for d in docs], rows, 16, pad_value=-100)
    total, count = model.loss_fn(got.unsqueeze(0), {"labels": labels})
    assert int(count) == 15
    inputs, target = model.split_batch({"input_ids": packed, "document_ids": ids, "labels": labels})
    assert inputs[1] is ids and target["labels"] is labels
    # (x, y) windows keep the mean loss
    assert model.loss_fn(got.unsqueeze(0), packed.clamp_min(0)).dim() == 0


def test_recipe_data_options_pad_per_batch_and_pack_rows(tmp_path) -> None:
    from recipes.gpt.data_varlen import DynamicPaddingDataModule, PackedDataModule

    text = tmp_path / "corpus.txt"
    text.write_bytes(bytes(range(32, 127)) * 300)
    padded = DynamicPaddingDataModule(block_size=32, batch_size=4, text_path=str(text), min_doc_length=4)
    padded.setup()
    lengths = set()
    for batch, _ in zip(padded.train_dataloader(), range(20)):
        x, y = batch["input_ids"], batch["labels"]
        lengths.add(x.shape[1])
        real = y != -100
        assert x.shape == y.shape and x.shape[1] <= 32 and real.sum(1).max() == x.shape[1]  # the longest fills it
        assert (real[:, :-1] | ~real[:, 1:]).all()  # right padding only
    assert len(lengths) > 2, lengths  # every batch its own length

    packed = PackedDataModule(block_size=32, batch_size=4, text_path=str(text), min_doc_length=4)
    packed.setup()
    batch = next(iter(packed.train_dataloader()))
    x, ids, y = batch["input_ids"], batch["document_ids"], batch["labels"]
    assert x.shape == ids.shape == y.shape == (4, 32)
    assert ((ids == 0) == (y == -100)).all() and (ids.max(1).values >= 1).all()
    assert packed.train_dataloader().dataset.padding_fraction() < 0.05
    with pytest.raises(ValueError, match=r"max_doc_length=40, block_size=32.*data.max_doc_length"):
        PackedDataModule(block_size=32, text_path=str(text), max_doc_length=40)
