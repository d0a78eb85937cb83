"""Private transformers names :mod:`lightning_pipe.hf` touches (transformers 5.x).

transformers is an optional extra, so unlike the torch / Lightning modules nothing is resolved at import: each helper
reaches its private name on an object the caller got from transformers, and ``tests/unit/test_hf.py`` runs them on
the installed version.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import nn


def init_weights_function(model_class: Any, config: Any) -> Callable[[nn.Module], None] | None:
    """The model class's private ``_init_weights(module)``, without a model instance (keeping one would pin every
    weight); ``None`` when the class has none.

    ``_init_weights`` reads only ``self.config``; an uninitialised instance of the class carrying the config stands
    in as ``self`` (so ``super()._init_weights`` inside it works too).
    """
    if model_class is None or config is None or not hasattr(model_class, "_init_weights"):
        return None
    shim = model_class.__new__(model_class)
    object.__setattr__(shim, "config", config)

    def init(module: nn.Module) -> None:
        model_class._init_weights(shim, module)

    return init


def clear_initialized_flags(objects: Iterable[Any]) -> None:
    """Unset ``_is_hf_initialized`` on tensors / modules that carry it: transformers' init functions skip flagged
    ones."""
    for obj in objects:
        if hasattr(obj, "_is_hf_initialized"):
            obj._is_hf_initialized = False


def set_attn_implementation(config: Any, name: str) -> None:
    """Choose the attention kernel on a config before a model is built from it (its private
    ``_attn_implementation``)."""
    config._attn_implementation = name
