"""Tiny configs of every transformers mixture-of-experts family, shared by the unit and the multi-rank MoE tests."""

from __future__ import annotations

from typing import Any

MOE_TINY = {"vocab_size": 96, "hidden_size": 16, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 32, "max_position_embeddings": 64, "pad_token_id": 0}


def moe_config(model_type: str, aux: bool = True, **overrides: Any) -> Any:
    """A tiny config of each MoE family: 4 experts, top-2, a strong aux coefficient so the term shows."""
    import transformers

    extra: dict[str, Any] = {"output_router_logits": aux, "router_aux_loss_coef": 0.5}
    if model_type == "mixtral":
        extra.update(num_local_experts=4, num_experts_per_tok=2)
    elif model_type == "qwen2_moe":  # a shared expert; layer 0 dense (mlp_only_layers)
        extra.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                     shared_expert_intermediate_size=24, mlp_only_layers=[0])
    elif model_type in ("qwen3_moe", "olmoe"):
        extra.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    elif model_type == "deepseek_v3":  # no aux loss in transformers; first layer dense
        extra = {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "n_group": 1,
                 "topk_group": 1, "first_k_dense_replace": 1, "kv_lora_rank": 8, "q_lora_rank": 8,
                 "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 4, "n_shared_experts": 1,
                 "num_key_value_heads": 4}
    return transformers.AutoConfig.for_model(model_type, **{**MOE_TINY, **extra, **overrides})
