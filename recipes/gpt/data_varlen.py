"""Documents of random lengths cut from the recipe's corpus, fed two ways: dynamically padded, or packed.

The corpus is :class:`~recipes.gpt.data.ByteCorpusDataModule`'s (standard library, a text file or a ``.bin``); a
*document* is a window of ``n + 1`` tokens, ``n`` drawn uniformly from ``[min_doc_length, max_doc_length]``
(``max_doc_length`` defaults to ``block_size``): inputs ``w[:-1]``, targets ``w[1:]``. Train documents start at
random offsets drawn once from ``seed``; validation documents tile the val split in order (the same every time).

* ``data=dynamic_padding`` (:class:`DynamicPaddingDataModule`): batches ``{"input_ids", "labels"}`` padded on the
  right to the batch's longest document, so every batch has its own length; padding labels are ``-100`` (not counted
  by the token-weighted loss) and causal attention never lets a real token see the padding after it.
* ``data=packed`` (:class:`PackedDataModule`): documents packed best-fit decreasing into rows of ``block_size``
  tokens, batches ``{"input_ids", "document_ids", "labels"}`` of one fixed shape: positions restart per document,
  attention stays inside it, only the rows' tail padding has labels ``-100`` ([Note: packed sequences] in
  ``lightning_pipe/layers/packing.py``).

Dict batches make the recipes' loss token-weighted (``recipes.gpt.model.recipe_loss``); ``(x, y)`` windows keep the
mean.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_pipe.layers.packing import IGNORE_INDEX, pack_documents, plan_rows
from recipes.gpt.data import ByteCorpusDataModule, ResumableDataLoader


def document_spans(n_tokens: int, min_len: int, max_len: int, seed: int, contiguous: bool) -> tuple[np.ndarray, np.ndarray]:
    """``(offsets, lengths)`` of documents over ``n_tokens`` tokens; each needs ``length + 1`` tokens from its offset.

    ``contiguous``: back to back from 0 (validation); otherwise as many documents as fit, at random offsets."""
    rng = np.random.default_rng(seed)
    mean = (min_len + max_len) / 2
    lengths = rng.integers(min_len, max_len + 1, size=max(1, int(n_tokens / (mean + 1))), dtype=np.int64)
    if contiguous:
        offsets = np.concatenate(([0], np.cumsum(lengths + 1)[:-1]))
        keep = offsets + lengths + 1 <= n_tokens
        return offsets[keep], lengths[keep]
    # `high` is exclusive: o + length + 1 <= n_tokens
    return rng.integers(0, n_tokens - lengths, dtype=np.int64), lengths


class Documents(Dataset):
    """Document ``i`` as ``(x, y)`` LongTensors of its own length."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> None:
        self.tokens, self.offsets, self.lengths = tokens, offsets, lengths

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        o, n = int(self.offsets[i]), int(self.lengths[i])
        window = torch.from_numpy(np.asarray(self.tokens[o : o + n + 1], dtype=np.int64))
        return window[:-1], window[1:]


def pad_collate(items: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad to the batch's longest document: ``input_ids`` with 0, ``labels`` with -100."""
    longest = max(len(x) for x, _ in items)
    x = torch.zeros(len(items), longest, dtype=torch.long)
    y = torch.full((len(items), longest), IGNORE_INDEX, dtype=torch.long)
    for row, (xi, yi) in enumerate(items):
        x[row, : len(xi)], y[row, : len(yi)] = xi, yi
    return {"input_ids": x, "labels": y}


class PackedRows(Dataset):
    """Rows of ``row_length`` tokens packed best-fit decreasing (:func:`plan_rows`), as ``{"input_ids",
    "document_ids", "labels"}``; built on access, so only the plan (each row's document indices) is held."""

    def __init__(self, documents: Documents, row_length: int) -> None:
        self.documents, self.row_length = documents, row_length
        self.rows = plan_rows([int(n) for n in documents.lengths], row_length)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, r: int) -> dict[str, torch.Tensor]:
        members = self.rows[r]
        pairs = [self.documents[i] for i in members]
        plan = [list(range(len(members)))]
        x, ids = pack_documents([p[0] for p in pairs], plan, self.row_length, pad_value=0)
        y, _ = pack_documents([p[1] for p in pairs], plan, self.row_length, pad_value=IGNORE_INDEX)
        return {"input_ids": x[0], "document_ids": ids[0], "labels": y[0]}

    def padding_fraction(self) -> float:
        """Share of the rows' tokens that are padding (each row's unfilled tail)."""
        used = int(self.documents.lengths.sum())
        return 1.0 - used / (len(self.rows) * self.row_length) if self.rows else 0.0


class _DocumentsDataModule(ByteCorpusDataModule):
    """The corpus of :class:`ByteCorpusDataModule`, cut into documents of random lengths (see the module doc)."""

    def __init__(self, *args: Any, min_doc_length: int = 8, max_doc_length: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        longest = self.block_size if max_doc_length is None else max_doc_length
        if not 1 <= min_doc_length <= longest <= self.block_size:
            raise ValueError(
                f"Document lengths must satisfy 1 <= min_doc_length <= max_doc_length <= block_size; got "
                f"min_doc_length={min_doc_length}, max_doc_length={longest}, block_size={self.block_size}. Change "
                "`data.min_doc_length` / `data.max_doc_length` (or `model.block_size`).")
        self.min_doc_length, self.max_doc_length = min_doc_length, longest

    def documents(self, split: str) -> Documents:
        tokens = self.train_tokens if split == "train" else self.val_tokens
        assert tokens is not None, "call setup() first"
        seed = self.seed if split == "train" else self.seed + 1
        offsets, lengths = document_spans(len(tokens), self.min_doc_length, self.max_doc_length, seed,
                                          contiguous=split != "train")
        return Documents(tokens, offsets, lengths)


class DynamicPaddingDataModule(_DocumentsDataModule):
    """Batches of whole documents, right-padded to each batch's longest (``data=dynamic_padding``)."""

    def train_dataloader(self) -> DataLoader:
        return ResumableDataLoader(self.documents("train"), batch_size=self.batch_size, shuffle=True,
                                   drop_last=True, collate_fn=pad_collate, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.documents("val"), batch_size=self.batch_size, shuffle=False, drop_last=True,
                          collate_fn=pad_collate, num_workers=self.num_workers)


class PackedDataModule(_DocumentsDataModule):
    """Batches of packed rows of ``block_size`` tokens with their document ids (``data=packed``)."""

    def train_dataloader(self) -> DataLoader:
        return ResumableDataLoader(PackedRows(self.documents("train"), self.block_size), batch_size=self.batch_size,
                                   shuffle=True, drop_last=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(PackedRows(self.documents("val"), self.block_size), batch_size=self.batch_size,
                          shuffle=False, drop_last=True, num_workers=self.num_workers)
