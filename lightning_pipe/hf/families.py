"""Which transformers causal-LM families :mod:`lightning_pipe.hf` cuts, where each keeps its parts, and which
attention each decoder layer uses (no transformers import: plain attribute reads of the config)."""

from __future__ import annotations

from typing import Any

__all__ = ["MOE_MODEL_TYPES", "SUPPORTED_MODEL_TYPES", "Family", "attention_type", "check_model_type", "family",
           "is_mixture_of_experts"]


# [Note: which mask a family's forward builds]
# Each family's model forward picks its decoder layers' masks by its own rule, and a config can carry keys its
# model never reads (transformers keeps unknown keys as attributes: a Llama config.json with a non-null
# `sliding_window`, a Mistral config with Ministral-style `layer_types`). A rule read off the config alone would
# then slide where the model does not. So each family names the rule its forward follows (transformers 5.x):
#   FULL:        always the full causal mask (GPT-2, Llama, OLMoE, DeepSeek-V3), whatever the config says;
#   EVERY_LAYER: every layer slides when `config.sliding_window` is set (Mistral, Mixtral, Qwen3-MoE), layer_types
#                unread;
#   PER_LAYER:   `config.layer_types[i]` (Qwen2, Qwen3, Qwen2-MoE).
# tests/unit/test_hf.py checks each rule against the model's own logits with the keys the model ignores set.
FULL, EVERY_LAYER, PER_LAYER = "full", "every_layer", "per_layer"


class Family:
    """Where a family keeps its parts, as attribute paths of the ``*ForCausalLM`` model, and which mask rule its
    forward follows ([Note: which mask a family's forward builds])."""

    def __init__(self, base: str, embed: str, layers: str, norm: str, pos_embed: str | None = None,
                 drop: str | None = None, rotary: str | None = None, masks: str = FULL) -> None:
        self.base, self.embed, self.layers, self.norm = base, embed, layers, norm
        self.pos_embed, self.drop, self.rotary = pos_embed, drop, rotary
        self.masks = masks


def _llama_like(masks: str) -> Family:
    return Family(base="model", embed="embed_tokens", layers="layers", norm="norm", rotary="rotary_emb", masks=masks)

# Families whose model forward is exactly: embed -> [mask, rotary] -> decoder layers -> norm -> lm_head.
# (Others, e.g. Gemma, scale embeddings or soft-cap logits inside forward: they need their own entry and a test.)
_DENSE: dict[str, Family] = {
    "gpt2": Family(base="transformer", embed="wte", pos_embed="wpe", drop="drop", layers="h", norm="ln_f"),
    "llama": _llama_like(FULL),
    "mistral": _llama_like(EVERY_LAYER),
    "qwen2": _llama_like(PER_LAYER),
    "qwen3": _llama_like(PER_LAYER),
}
# Mixtures of experts: the decoder layers hold the routers; the load-balancing loss: lightning_pipe/hf/moe.py
_MOE: dict[str, Family] = {
    "mixtral": _llama_like(EVERY_LAYER),
    "qwen2_moe": _llama_like(PER_LAYER),
    "qwen3_moe": _llama_like(EVERY_LAYER),
    "olmoe": _llama_like(FULL),
    "deepseek_v3": _llama_like(FULL),
}
_FAMILIES = {**_DENSE, **_MOE}
SUPPORTED_MODEL_TYPES = tuple(_FAMILIES)
MOE_MODEL_TYPES = tuple(_MOE)
_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def is_mixture_of_experts(config: Any) -> bool:
    """Whether ``config`` describes a mixture-of-experts model (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3,
    ...): transformers names the expert count in one of a few ways, and the model type says ``moe`` for the rest."""
    sub = getattr(config, "ffn_config", None)  # DBRX
    return (any(getattr(c, key, None) for c in (config, sub) for key in _EXPERT_COUNTS)
            or "moe" in str(getattr(config, "model_type", "")).lower())


def check_model_type(config: Any) -> None:
    """Refuse a config whose family :mod:`lightning_pipe.hf` cannot cut (at construction, on every rank alike)."""
    family(config)


def family(config: Any) -> Family:
    model_type = getattr(config, "model_type", None)
    if model_type not in _FAMILIES:
        kind = "mixture-of-experts " if is_mixture_of_experts(config) else ""
        raise NotImplementedError(
            f"lightning_pipe.hf turns causal LMs of the model types {list(SUPPORTED_MODEL_TYPES)} into layer lists; "
            f"got the {kind}model_type={model_type!r}. Other families need an entry in "
            "lightning_pipe.hf.families (and a parity test): their forward may do more than embed -> decoder "
            "layers -> norm -> head" + (", and their router and aux loss must match lightning_pipe.hf.moe's" if kind
                                        else "") + "."
        )
    return _FAMILIES[model_type]


def attention_type(config: Any, index: int) -> str:
    """``"full_attention"`` or ``"sliding_attention"`` for decoder layer ``index``, as the model's forward picks it
    ([Note: which mask a family's forward builds])."""
    masks = family(config).masks
    if masks == PER_LAYER:
        return config.layer_types[index]
    if masks == EVERY_LAYER and getattr(config, "sliding_window", None) is not None:
        return "sliding_attention"
    return "full_attention"
