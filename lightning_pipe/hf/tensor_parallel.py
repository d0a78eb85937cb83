"""Tensor parallelism for transformers decoder layers, from the model's own plan (``config.base_model_tp_plan``).

transformers ships, per model family, which projections of a decoder layer are split column-wise and which
row-wise (Llama, Mistral, Qwen2: q/k/v and gate/up column-wise, o and down row-wise) — Megatron's split, two
all-reduces per layer forward. :func:`parallelize_decoder_layer` applies exactly those entries with DTensor's
``ColwiseParallel`` / ``RowwiseParallel`` to one :class:`~lightning_pipe.hf.layers.CausalLMDecoderLayer`; the
embedding, the norms and the head stay whole (so a tied embedding / head stays tied). The attention code of these
families reads the head count from the projection's width (``view(..., -1, head_dim)``), so each rank runs its own
heads unchanged.

Refused with a clear error (plain data, the same on every rank): a family without a plan (GPT-2: its fused
``c_attn`` is a ``Conv1D``, transposed), plan styles other than column-/row-wise (e.g. Qwen3's per-head q/k norms,
``replicated_with_grad_allreduce``: their gradients differ per tensor rank and would need a sum we do not do), and
head / width counts the tensor-parallel size does not divide.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from lightning_pipe.config import config_error

LAYER_PREFIX = "layers.*."
STYLES: dict[str, type[ParallelStyle]] = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
DIVIDED = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
"""Config counts each tensor rank takes an equal part of."""


def decoder_layer_plan(config: Any, size: int) -> dict[str, ParallelStyle]:
    """The decoder-layer entries of ``config.base_model_tp_plan`` as DTensor styles, for ``size`` tensor ranks."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(text_config, "model_type", type(text_config).__name__)
    plan = getattr(text_config, "base_model_tp_plan", None) or {}
    entries = {key[len(LAYER_PREFIX):]: style for key, style in plan.items() if key.startswith(LAYER_PREFIX)}
    if not entries:
        raise config_error(
            f"Tensor parallelism splits a transformers decoder layer by the model's own plan "
            f"(config.base_model_tp_plan), and {model_type} has none for its layers.",
            f"model_type={model_type!r}, tensor_parallel_size={size}", "tensor_parallel_size", "or set it to 1",
            fix="Subclass HFCausalLM and implement `parallelize_layer(index, layer, tp_mesh)`")
    unsupported = {key: style for key, style in entries.items() if style not in STYLES}
    if unsupported:
        raise config_error(
            f"Tensor parallelism applies the plan styles {sorted(STYLES)} of config.base_model_tp_plan; "
            f"{model_type}'s plan also has others (their gradients would need handling we do not do).",
            f"model_type={model_type!r} with {unsupported}", "tensor_parallel_size", "or set it to 1",
            fix="Subclass HFCausalLM and implement `parallelize_layer(index, layer, tp_mesh)`")
    uneven = {name: getattr(text_config, name) for name in DIVIDED
              if isinstance(getattr(text_config, name, None), int) and getattr(text_config, name) % size}
    if uneven:
        raise config_error(
            "Tensor parallelism gives each tensor rank an equal share of the attention heads, key/value heads and "
            "MLP width: each must be divisible by the tensor-parallel size.",
            f"tensor_parallel_size={size} with {model_type} {uneven}", "tensor_parallel_size")
    return {key: STYLES[style]() for key, style in entries.items()}


def parallelize_decoder_layer(layer: nn.Module, config: Any, tp_mesh: DeviceMesh) -> None:
    """Split one wrapped decoder layer in place over ``tp_mesh`` (its ``block`` is the model's own layer)."""
    block = layer.get_submodule("block")
    parallelize_module(block, tp_mesh, decoder_layer_plan(config, tp_mesh.size()))
