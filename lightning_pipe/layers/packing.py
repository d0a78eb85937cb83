"""Packed sequences: several documents in one row, attention that stays inside each document (plain torch).

[Note: packed sequences]
A packed row holds documents end to end, padded at its tail: ``tokens [B, T]`` plus ``document_ids [B, T]`` that
number the row's documents 1, 2, ... (0 = the tail's padding). Everything a layer needs follows from the document
ids, so they are the one extra per-token tensor that crosses stage boundaries (a tuple output is the next layer's
positional arguments: ``(hidden, document_ids)``, see docs/module-contract.md):

* position ids restart at 0 in each document (:func:`positions_from_documents`): position embeddings and RoPE see
  every document as if it were alone;
* attention is causal *and* block-diagonal (:func:`block_diagonal_causal_mask`): a token sees only earlier tokens of
  its own document. The padding forms a "document" of its own (id 0), so no row of the mask is empty (SDPA would
  return NaN for a query that sees nothing) and no real token sees padding.

So a packed row computes, document by document, what each document alone computes (tested to 1e-6 in fp32 against
the documents run one by one, and in parity tests against one device).

Labels: each document is a window of ``n + 1`` corpus tokens cut into its ``n`` inputs and their ``n`` next tokens
(:func:`pack_documents` packs inputs and labels with one plan), so no label crosses a document boundary and only
the padding's labels are ``-100``. With transformers' convention (``labels = input_ids``, shifted inside the loss)
the first label of every document is ``-100`` instead, as ``DataCollatorWithFlattening`` writes it: the shifted
loss would otherwise ask a document's last token to predict the next document's first. Either way the loss is
token-weighted, ``(sum, count)``, and exact however documents fall across micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["IGNORE_INDEX", "block_diagonal_causal_mask", "documents_from_positions", "pack_documents", "plan_rows",
           "positions_from_documents"]

IGNORE_INDEX = -100


def plan_rows(lengths: Sequence[int], row_length: int) -> list[list[int]]:
    """Best-fit decreasing: documents longest first (ties in order), each into the fullest row that still has room,
    a new row when none has; returns each row's document indices (in row order). Deterministic, so the same lengths
    give the same rows on every rank; padding is typically a few percent where next-fit wastes a quarter of each row
    for lengths up to the row. ``O(documents x row_length)`` in the worst case: fine for recipe-sized rows."""
    for index, n in enumerate(lengths):
        if not 0 < n <= row_length:
            raise ValueError(f"Every packed document needs 1..row_length tokens; document {index} has {n} and "
                             f"row_length is {row_length}. Cut documents to at most the row length "
                             "(the recipes: `data.max_doc_length` <= `model.block_size`).")
    rows: list[list[int]] = []
    by_space: list[list[int]] = [[] for _ in range(row_length + 1)]  # free space -> rows with exactly that space
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[index]
        space = next((s for s in range(n, row_length + 1) if by_space[s]), None)
        if space is None:
            rows.append([])
            row, space = len(rows) - 1, row_length
        else:
            row = by_space[space].pop()
        rows[row].append(index)
        by_space[space - n].append(row)
    return rows


def pack_documents(documents: Sequence[Tensor], rows: Sequence[Sequence[int]], row_length: int,
                   pad_value: int) -> tuple[Tensor, Tensor]:
    """``(packed [R, row_length], document_ids [R, row_length])`` of 1-D ``documents`` laid out by ``rows``
    (:func:`plan_rows`): the row's documents end to end, then ``pad_value``; document ids 1.. per row, 0 on padding.
    Pack inputs and labels with the same ``rows`` to keep them aligned."""
    dtype = documents[0].dtype if documents else torch.long
    packed = torch.full((len(rows), row_length), pad_value, dtype=dtype)
    doc_ids = torch.zeros((len(rows), row_length), dtype=torch.long)
    for r, members in enumerate(rows):
        start = 0
        for number, index in enumerate(members, start=1):
            doc = documents[index]
            packed[r, start:start + len(doc)] = doc
            doc_ids[r, start:start + len(doc)] = number
            start += len(doc)
    return packed, doc_ids


def _starts(document_ids: Tensor) -> Tensor:
    """Index of the first token of each token's document (a new document wherever the id changes)."""
    t = document_ids.shape[-1]
    index = torch.arange(t, device=document_ids.device).expand_as(document_ids)
    new = torch.ones_like(document_ids, dtype=torch.bool)
    new[..., 1:] = document_ids[..., 1:] != document_ids[..., :-1]
    return torch.where(new, index, torch.zeros_like(index)).cummax(dim=-1).values


def positions_from_documents(document_ids: Tensor) -> Tensor:
    """Position ids ``[B, T]`` that restart at 0 where the document id changes: ``[1 1 1 2 2 0] -> [0 1 2 0 1 0]``."""
    index = torch.arange(document_ids.shape[-1], device=document_ids.device).expand_as(document_ids)
    return index - _starts(document_ids)


def documents_from_positions(position_ids: Tensor) -> Tensor:
    """Document index per token (0, 1, ...) from position ids: a new document wherever a position is not the
    previous one + 1 — transformers' rule (``masking_utils.find_packed_sequence_indices``), so ``[0 1 2 0 1]`` gives
    ``[0 0 0 1 1]``. ``position_ids`` ``[B, T]`` (or ``[1, T]``)."""
    diff = torch.diff(position_ids, prepend=position_ids[..., :1] - 1, dim=-1)
    return (diff != 1).cumsum(-1)


def block_diagonal_causal_mask(document_ids: Tensor) -> Tensor:
    """Boolean attention mask ``[B, 1, T, T]`` (True = attend) for SDPA: query i sees key j iff ``j <= i`` and both
    lie in the same document. Built per stage from the document ids (T x T booleans per row: cheap beside attention
    itself, and nothing of size T x T crosses a stage)."""
    t = document_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=document_ids.device).tril()
    same = document_ids.unsqueeze(-1) == document_ids.unsqueeze(-2)
    return (same & causal).unsqueeze(1)
