"""The attention masks a transformers model's forward hands its decoder layers, built with transformers' own mask
functions (``masking_utils``) for each layer's attention type ([Note: which mask a family's forward builds] in
families.py), whatever this transformers 5.x calls their keywords."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

try:
    from transformers import masking_utils
except ImportError as err:  # pragma: no cover - exercised only without the optional dependency
    raise ImportError(
        "lightning_pipe.hf needs the `transformers` package (>=5,<6): `pip install 'transformers>=5,<6' safetensors`."
    ) from err

__all__ = ["make_mask"]

_MASK_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "full_attention": masking_utils.create_causal_mask,
    "sliding_attention": masking_utils.create_sliding_window_causal_mask,
}


@functools.cache
def _mask_parameters(fn: Callable[..., Any]) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def make_mask(kind: str, config: Any, hidden: Tensor, attention_mask: Tensor | None,
              position_ids: Tensor) -> Any:
    """The mask the model's forward would hand its decoder layers (4-D, or ``None`` for SDPA's ``is_causal``).

    Keyword names moved within transformers 5.x (``cache`` was ``past_key_values``; ``input_embeds``;
    ``cache_position``): pass what this version's signature has.
    """
    fn = _MASK_FUNCTIONS[kind]
    params = _mask_parameters(fn)
    kwargs: dict[str, Any] = {"config": config, "attention_mask": attention_mask, "position_ids": position_ids}
    kwargs["inputs_embeds" if "inputs_embeds" in params else "input_embeds"] = hidden
    for name in ("cache", "past_key_values"):
        if name in params:
            kwargs[name] = None
    if "cache_position" in params:
        kwargs["cache_position"] = torch.arange(hidden.shape[1], device=hidden.device)
    return fn(**kwargs)
