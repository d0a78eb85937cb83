"""Fused expert tensors from per-expert checkpoints: [Note: expert tensors on disk].

[Note: expert tensors on disk]
transformers 5 holds a MoE layer's experts fused: ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (each expert's gate
rows, then its up rows) and ``mlp.experts.down_proj`` ``[E, H, I]``. Its ``save_pretrained`` and every hub checkpoint
keep the original per-expert layout instead — ``mlp.experts.<e>.{gate,up,down}_proj.weight`` (Qwen2/3-MoE, OLMoE,
DeepSeek-V3) or Mixtral's ``block_sparse_moe.experts.<e>.{w1,w3,w2}.weight`` and ``block_sparse_moe.gate.weight``
— and converts on load. A layer reads only its own keys ([Note: HF names]), so the conversion is ours: for a fused
key the checkpoint lacks, :func:`expert_sources` names the per-expert keys and :func:`fuse` builds the tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

# (gate, up, down) weight names per expert, and the layer's MoE block name, by checkpoint convention
_CONVENTIONS = ((("gate_proj.weight", "up_proj.weight", "down_proj.weight"), "mlp."),
                (("w1.weight", "w3.weight", "w2.weight"), "block_sparse_moe."))


def router_alias(key: str) -> str | None:
    """Mixtral's router on disk for the in-memory ``mlp.gate.weight``."""
    return key.replace("mlp.gate.", "block_sparse_moe.gate.") if key.endswith("mlp.gate.weight") else None


def expert_sources(key: str, experts: int, present: Callable[[str], bool]) -> list[list[str]] | None:
    """For a fused ``...mlp.experts.gate_up_proj`` / ``down_proj`` key: per expert, the checkpoint keys it is built
    from (``[gate, up]`` or ``[down]``); ``None`` when no convention's keys are all present."""
    for fused, part in (("experts.gate_up_proj", (0, 1)), ("experts.down_proj", (2,))):
        if not key.endswith("mlp." + fused):
            continue
        layer = key[: -len("mlp." + fused)]
        for names, block in _CONVENTIONS:
            sources = [[f"{layer}{block}experts.{e}.{names[i]}" for i in part] for e in range(experts)]
            if all(present(k) for group in sources for k in group):
                return sources
    return None


def fused_sources(candidates: Sequence[str], base_prefix: str, experts: int,
                  present: Callable[[str], bool]) -> list[list[str]] | None:
    """:func:`expert_sources` for the first of a layer's candidate keys that a checkpoint holds per expert, each
    candidate tried as it is and without the layer's ``base_prefix``."""
    for candidate in candidates:
        stripped = candidate[len(base_prefix):] if base_prefix and candidate.startswith(base_prefix) else candidate
        for key in (candidate, stripped):
            sources = expert_sources(key, experts, present)
            if sources is not None:
                return sources
    return None


def fuse(sources: list[list[str]], tensors: Mapping[str, Tensor]) -> Tensor:
    """Stack the experts; within one expert, gate rows then up rows (transformers' ``gate_up_proj`` order)."""
    return torch.stack([torch.cat([tensors[k] for k in group], dim=0) for group in sources])
