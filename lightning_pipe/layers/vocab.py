"""Token ids outside the vocabulary: torch's bare ``IndexError: index out of range in self`` from an embedding,
translated into the rule, the ids seen, the vocabulary size and the setting that sets it.

[Note: token ids out of range]
An ``nn.Embedding`` given an id >= ``num_embeddings`` (or < 0) raises an ``IndexError`` that names nothing. Checking
every batch would cost a max() per step on the hot path, so nothing is checked until a layer raises: then (on that
rank only, once) the layer is run again under ``no_grad`` with a pre-hook on each of its embeddings that looks for
the ones fed one of the layer's own integer inputs (the token ids the batch brought, not positions the layer makes
itself). If one of those got an id out of its range, the error says which; any other ``IndexError`` is left as it
was, and so is one from a layer with sharded or split (DTensor) parameters: its forward is a collective (FSDP's
all-gather), which this rank must not run alone. A layer says which setting sizes its vocabulary with a ``vocab_setting`` attribute (the GPT recipe's
embedding: ``model.vocab_size``; ``HFCausalLM``'s: the config's ``vocab_size``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor


class TokenIdError(IndexError):
    """A token id outside an embedding's vocabulary (still an ``IndexError``, as torch's)."""


def explain_index_error(layer: nn.Module, index: int, args: Sequence[Any]) -> TokenIdError | None:
    """The :class:`TokenIdError` for ``layer`` (layer ``index`` of the list) having raised an ``IndexError`` on
    ``args``, or ``None`` when no embedding of it got an out-of-range id from those inputs."""
    ids = [a for a in args if isinstance(a, torch.Tensor) and not a.is_floating_point() and not a.is_complex()
           and a.dtype != torch.bool and a.numel() > 0]
    embeddings = [(name, m) for name, m in layer.named_modules() if isinstance(m, nn.Embedding)]
    if not ids or not embeddings or any(isinstance(p, DTensor) for p in layer.parameters()):
        return None  # (a sharded or split layer's forward is collective: this rank must not run it alone)
    found: list[tuple[str, nn.Embedding, int, int]] = []

    def watch(name: str) -> Any:
        def hook(module: nn.Embedding, inputs: tuple[Any, ...]) -> None:
            tokens = inputs[0] if inputs else None
            if isinstance(tokens, torch.Tensor) and any(tokens is a for a in ids) and not found:
                low, high = int(tokens.min()), int(tokens.max())
                if low < 0 or high >= module.num_embeddings:
                    found.append((name, module, low, high))
        return hook

    handles = [m.register_forward_pre_hook(watch(name)) for name, m in embeddings]
    try:
        with torch.no_grad():
            layer(*args)
    except IndexError:
        pass
    except Exception:  # the re-run only looks for the embedding; the first error stands
        return None
    finally:
        for h in handles:
            h.remove()
    if not found:
        return None
    name, embedding, low, high = found[0]
    n = embedding.num_embeddings
    bad = high if high >= n else low
    where = f"{type(layer).__name__}" + (f".{name}" if name else "")
    setting = getattr(layer, "vocab_setting", None)
    change = (f"Change {setting}" if setting else
              "Change the model's vocabulary size (the embedding's num_embeddings)")
    return TokenIdError(
        f"Token id {bad} is outside the vocabulary of layer {index}'s embedding {where} "
        f"(nn.Embedding({n}, {embedding.embedding_dim}): ids 0..{n - 1}). Rule: every token id of the inputs is in "
        f"[0, vocab_size). Got ids in [{low}, {high}] with vocab_size={n}. {change} to at least {high + 1}, or the "
        "data / tokenizer so that its ids fit.")
