"""Token ids outside the vocabulary on one device: the embedding's bare IndexError becomes one that names the
largest id, the vocabulary size and the setting ([Note: token ids out of range]); other IndexErrors stay as they are."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipe.layers.stages import run_layers
from lightning_pipe.layers.vocab import TokenIdError
from recipes.gpt.model import GPT


def test_gpt_with_a_small_vocabulary_names_the_largest_id_and_the_setting() -> None:
    model = GPT(vocab_size=100, block_size=16, n_layer=1, n_head=2, n_embd=16)
    ids = torch.tensor([[3, 250, 7, 99]])  # byte data: ids up to 255
    with pytest.raises(TokenIdError) as err:
        model(ids)
    message = str(err.value)
    assert "Token id 250 is outside the vocabulary of layer 0's embedding Embedding.wte" in message, message
    assert "vocab_size=100" in message and "Hydra: model.vocab_size" in message and "at least 251" in message
    assert isinstance(err.value, IndexError) and err.value.__cause__ is None
    with pytest.raises(TokenIdError, match=r"Token id -1 .*Got ids in \[-1, 7\]"):
        model(torch.tensor([[-1, 7]]))


def test_other_index_errors_and_plain_layers_are_left_alone() -> None:
    class Picks(nn.Module):  # an embedding fed positions it makes itself, and an IndexError of its own
        def __init__(self) -> None:
            super().__init__()
            self.pos = nn.Embedding(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.pos(torch.arange(x.shape[1]))[x.shape[1]]

    with pytest.raises(IndexError) as err:
        run_layers(nn.Sequential(Picks()), torch.zeros(1, 3, dtype=torch.long))
    assert not isinstance(err.value, TokenIdError)
    embedding = nn.Sequential(nn.Embedding(5, 2))
    with pytest.raises(TokenIdError, match=r"layer 0's embedding Embedding \(nn.Embedding\(5, 2\).*Change the "
                                           r"model's vocabulary size"):
        run_layers(embedding, torch.tensor([[1, 9]]))
