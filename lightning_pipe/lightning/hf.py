""":class:`HFCausalLM`: a transformers causal LM as a :class:`~lightning_pipe.PipelineModule`, in one line.

From one of

* ``model=`` an instantiated ``*ForCausalLM`` (its modules are reused: same weights, built in ``__init__``);
* ``config=`` a transformers config: random init, seeded per layer (``seed + layer index``), so one device and every
  pipeline layout start from the same values;
* ``pretrained=`` a local directory (``config.json`` + safetensors, as ``save_pretrained`` writes it): each rank
  reads only the tensors of its own layers.

For ``config=`` / ``pretrained=`` the layers are built in ``configure_model`` — on the meta device under the
pipeline strategy, which then allocates this rank's layers and calls :meth:`HFCausalLM.reset_layer` for them only.

Batches are dicts as transformers' collators produce them: ``{"input_ids", "attention_mask", "labels"}``
(``labels`` = ``input_ids`` with -100 where no loss is wanted; the shift happens inside the loss, as in
transformers), optionally ``"position_ids"``; ``"position_ids"`` without ``"attention_mask"`` are packed rows
(:meth:`HFCausalLM.split_batch`). The loss is token-weighted: ``loss_fn``
returns ``(sum, count)``, so padded batches give the loss (and gradients) of the model's own ``.loss`` over the
whole batch, however the padding falls across micro-batches and replicas.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from lightning_pipe.hf.families import check_model_type
from lightning_pipe.hf.layers import CausalLMDecoderLayer, causal_lm_layers, layers_from_config
from lightning_pipe.hf.loss import IGNORE_INDEX, causal_lm_loss_sum_count
from lightning_pipe.hf.tensor_parallel import parallelize_decoder_layer
from lightning_pipe.hf.weights import SafetensorsCheckpoint, init_layer_, load_layer_weights_
from lightning_pipe.layers.packing import documents_from_positions
from lightning_pipe.lightning.module import PipelineModule


class HFCausalLM(PipelineModule):
    """A transformers causal LM (GPT-2, Llama, Mistral, Qwen2, Qwen3; the mixtures of experts Mixtral, Qwen2-MoE,
    Qwen3-MoE, OLMoE, DeepSeek-V3) trained as a pipeline layer list. With ``config.output_router_logits`` the loss
    is transformers' ``loss + router_aux_loss_coef * aux_loss``, the aux term per micro-batch and exact across
    stages ([Note: the load-balancing loss across stages] in lightning_pipe/hf/moe.py; docs/moe.md).

    Args:
        model: an instantiated ``*ForCausalLM``; its modules become ``self.layers`` (drop the model afterwards).
        config: a transformers config to build from, randomly initialised (no download).
        pretrained: a local checkpoint directory (no download).
        seed: base seed of the per-layer random init (``config=`` only).
        attn_implementation: ``"sdpa"`` / ``"eager"`` / ... for ``config=`` / ``pretrained=``.
        optimizer: ``params -> torch.optim.Optimizer``; default AdamW(lr=3e-4, weight_decay=0).
    """

    def __init__(self, model: torch.nn.Module | None = None, *, config: Any = None,
                 pretrained: str | os.PathLike[str] | None = None, seed: int = 0,
                 attn_implementation: str | None = None,
                 optimizer: Callable[[Any], torch.optim.Optimizer] | None = None) -> None:
        super().__init__()
        given = [name for name, value in (("model", model), ("config", config), ("pretrained", pretrained))
                 if value is not None]
        if len(given) != 1:
            raise ValueError(f"HFCausalLM takes exactly one of `model`, `config`, `pretrained`; got {given or 'none'}.")
        # an unsupported family is refused here, not at setup on every rank
        if config is not None:
            check_model_type(config)
        self.layers = causal_lm_layers(model) if model is not None else None
        self.hf_config = config
        self.pretrained = os.fspath(pretrained) if pretrained is not None else None
        self.seed = seed
        self.attn_implementation = attn_implementation
        self.optimizer_factory = optimizer
        self.checkpoint_reader: SafetensorsCheckpoint | None = None
        """The ``pretrained=`` directory's reader (``keys_read``: what this process read from it)."""

    # ---------------------------------------------------------------- building
    def configure_model(self) -> None:
        if self.layers is not None:
            return
        config = self.hf_config
        if self.pretrained is not None:
            from transformers import AutoConfig
            config = AutoConfig.from_pretrained(self.pretrained)
        # On the ambient device: meta under PipelineStrategy (nothing allocated), the real device otherwise.
        # transformers' own init is skipped: reset_layer fills every layer.
        self.layers = layers_from_config(config, attn_implementation=self.attn_implementation, init=False)
        for index, layer in enumerate(self.layers):
            self.reset_layer(index, layer)

    def reset_layer(self, index: int, layer: torch.nn.Module) -> None:
        """Fill one allocated layer: from the checkpoint (its own tensors only), or seeded random init."""
        if any(t.is_meta for t in layer.parameters()):
            return
        if self.pretrained is not None:
            if self.checkpoint_reader is None:
                self.checkpoint_reader = SafetensorsCheckpoint(self.pretrained)
            load_layer_weights_(layer, self.checkpoint_reader)
        else:
            init_layer_(layer, self.seed + index)

    def parallelize_layer(self, index: int, layer: torch.nn.Module, tp_mesh: DeviceMesh) -> None:
        """Tensor parallelism (``tensor_parallel_size > 1``): split each decoder layer by transformers' own plan
        for the family (``config.base_model_tp_plan``: Llama, Mistral, Qwen2); the embedding, norms and head stay
        whole (:mod:`lightning_pipe.hf.tensor_parallel`). Override it for other families or another split."""
        if isinstance(layer, CausalLMDecoderLayer):
            parallelize_decoder_layer(layer, layer.config, tp_mesh)

    # ---------------------------------------------------------------- contract
    def split_batch(self, batch: Any) -> tuple[Any, Any]:
        """``{"input_ids", "attention_mask"?, "position_ids"?, "labels"?}`` -> ``((input_ids, attention_mask
        [, position_ids]), labels)``; other batch shapes as :class:`PipelineModule` splits them.

        Packed rows — ``position_ids`` that restart per document and no ``attention_mask`` (optionally ``seq_idx``),
        as ``DataCollatorWithFlattening`` gives them — become ``(input_ids, ones, position_ids, seq_idx)``: attention
        stays inside each document, as ``model(input_ids, position_ids=..., use_cache=False)`` computes. Labels
        ``-100`` on each document's first token keep the shifted loss from predicting across documents."""
        if isinstance(batch, Mapping) and "input_ids" in batch:
            input_ids, labels = batch["input_ids"], batch.get("labels")
            if isinstance(labels, Tensor) and isinstance(input_ids, Tensor) and labels.shape != input_ids.shape:
                # on every rank, before the schedule: a mismatch would otherwise surface as a loss error on the
                # last stage only, after the other ranks started the step
                raise ValueError(
                    f"{type(self).__name__}: a batch's 'labels' must have the shape of its 'input_ids' (one label per "
                    f"token; the loss shifts them itself, as transformers' models do); got input_ids "
                    f"{tuple(input_ids.shape)} and labels {tuple(labels.shape)}. Pad or truncate both alike in the "
                    "collator (e.g. DataCollatorForLanguageModeling / DataCollatorForSeq2Seq).")
            mask, position_ids = batch.get("attention_mask"), batch.get("position_ids")
            for key, value in (("attention_mask", mask), ("position_ids", position_ids)):
                if isinstance(value, Tensor) and isinstance(input_ids, Tensor) and value.shape != input_ids.shape:
                    raise ValueError(  # on every rank, before the schedule (as for labels above)
                        f"{type(self).__name__}: a batch's '{key}' must have the shape of its 'input_ids' (one "
                        f"entry per token, [batch, sequence]); got input_ids {tuple(input_ids.shape)} and {key} "
                        f"{tuple(value.shape)}. Pad or truncate them alike in the collator (e.g. "
                        "DataCollatorWithPadding, or tokenizer(..., padding=True) on the whole batch).")
            if position_ids is not None and mask is None:
                # packed rows, as transformers' DataCollatorWithFlattening gives them ([Note: packed rows] in
                # lightning_pipe/hf/layers.py): the 4th tensor marks them, the mask slot holds a placeholder
                seq_idx = batch.get("seq_idx")
                if seq_idx is None:
                    seq_idx = documents_from_positions(position_ids)
                return (input_ids, torch.ones_like(input_ids), position_ids, seq_idx), labels
            if mask is None:
                inputs: Any = input_ids
            elif position_ids is None:
                inputs = (input_ids, mask)
            else:
                inputs = (input_ids, mask, position_ids)
            return inputs, labels
        if isinstance(batch, Mapping):
            raise TypeError(
                f"{type(self).__name__}.split_batch takes a dict with 'input_ids' (and optionally 'attention_mask', "
                f"'position_ids', 'labels'; training needs 'labels'), as transformers' collators give it; got a "
                f"dict with keys {sorted(map(str, batch))}. Rename the keys in the collator, or override "
                "split_batch.")
        return super().split_batch(batch)

    def loss_fn(self, logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """``(sum of token losses, counted tokens)``: labels -100 do not count; the batch loss is the global sum over
        the global count (== the model's own ``.loss`` over the whole batch)."""
        return causal_lm_loss_sum_count(logits, labels)

    def loss_count(self, labels: Tensor) -> Tensor:
        """The tokens :meth:`loss_fn` counts over the whole batch (shifted labels not -100): aux losses need it
        before the backward ([Note: auxiliary losses] in lightning_pipe/layers/aux.py)."""
        return (labels[..., 1:] != IGNORE_INDEX).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_factory is not None:
            return self.optimizer_factory(self.parameters())
        return torch.optim.AdamW(self.parameters(), lr=3e-4, weight_decay=0.0)
