"""Which transformers causal-LM families :mod:`lightning_pipe.hf` cuts, where each keeps its parts, and which
attention each decoder layer uses (no transformers import: plain attribute reads of the config)."""

from __future__ import annotations

from typing import Any

__all__ = ["MOE_MODEL_TYPES", "SUPPORTED_MODEL_TYPES", "Family", "attention_type", "check_model_type", "family",
           "is_mixture_of_experts"]


class Family:
    """Where a family keeps its parts, as attribute paths of the ``*ForCausalLM`` model."""

    def __init__(self, base: str, embed: str, layers: str, norm: str, pos_embed: str | None = None,
                 drop: str | None = None, rotary: str | None = None, full_attention_only: bool = False) -> None:
        self.base, self.embed, self.layers, self.norm = base, embed, layers, norm
        self.pos_embed, self.drop, self.rotary = pos_embed, drop, rotary
        self.full_attention_only = full_attention_only
        """The model's forward always builds the full causal mask (OLMoE, DeepSeek-V3), whatever the config says."""


_LLAMA_LIKE = Family(base="model", embed="embed_tokens", layers="layers", norm="norm", rotary="rotary_emb")
_FULL_ONLY = Family(base="model", embed="embed_tokens", layers="layers", norm="norm", rotary="rotary_emb",
                    full_attention_only=True)

# Families whose model forward is exactly: embed -> [mask, rotary] -> decoder layers -> norm -> lm_head.
# (Others, e.g. Gemma, scale embeddings or soft-cap logits inside forward: they need their own entry and a test.)
_DENSE: dict[str, Family] = {
    "gpt2": Family(base="transformer", embed="wte", pos_embed="wpe", drop="drop", layers="h", norm="ln_f"),
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
}
# Mixtures of experts (issue 25): the decoder layers hold the routers; the load-balancing loss: lightning_pipe/hf/moe.py
_MOE: dict[str, Family] = {
    "mixtral": _LLAMA_LIKE,
    "qwen2_moe": _LLAMA_LIKE,
    "qwen3_moe": _LLAMA_LIKE,
    "olmoe": _FULL_ONLY,
    "deepseek_v3": _FULL_ONLY,
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
    """``"full_attention"`` or ``"sliding_attention"`` for decoder layer ``index``, as the model's forward picks it."""
    if family(config).full_attention_only:
        return "full_attention"
    layer_types = getattr(config, "layer_types", None)
    if layer_types:  # Qwen2 / Qwen3 (and their MoE): per layer
        return layer_types[index]
    # Mistral / Mixtral: every layer slides when config.sliding_window is set; Llama / GPT-2 have no sliding window.
    return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"
