"""transformers causal LMs as a pipeline layer list (plain torch + transformers; no Lightning import).

A ``*ForCausalLM`` model of the GPT-2, Llama, Mistral, Qwen2 or Qwen3 family becomes an ``nn.ModuleList``::

    [embedding, decoder_0, ..., decoder_{n-1}, final_norm, head]

built from the model's own modules (so weights are the same objects, and a tied embedding / head stays ONE
``nn.Parameter`` used by the first and the last layer — the pipeline detects and syncs it).

[Note: layer I/O]
Only tensors cross stage boundaries, all with the batch in dim 0. Each layer takes its inputs as positional tensors
(the library's layer I/O contract: a tuple output is the next layer's positional arguments, on one device, inside a
stage and across stages) or, for hand-written loops, as one tuple of them, and returns:

=================  ===========================================================  ===================================
layer              input                                                        output
=================  ===========================================================  ===================================
embedding          ``input_ids`` [, ``attention_mask`` [, ``pos`` [, ``seq``]]]  ``hidden`` [, the same tensors]
decoder i          ``hidden`` [, ``attention_mask`` [, ``pos`` [, ``seq``]]]     same arity, same tensors
final norm         ``hidden`` [, ...]                                           ``hidden``
head               ``hidden``                                                   ``logits`` [B, T, vocab]
=================  ===========================================================  ===================================

``attention_mask`` is the 2-D ``[B, T]`` padding mask (1 = token, 0 = padding) as tokenizers / collators give it;
``pos`` are optional ``[B, T]`` position ids (default ``arange(T)``, as the model uses). ``seq`` (``[B, T]``
document index per token, transformers' ``seq_idx``) marks *packed* rows, see [Note: packed rows].

[Note: packed rows]
transformers' own packed-sequence support: called without a 2-D attention mask and without a cache, the model
derives documents from ``position_ids`` that restart (``masking_utils.find_packed_sequence_indices``) and every
attention implementation keeps attention inside them (sdpa / eager: a block-diagonal causal mask, tested; flash
attention reads the same position ids for its variable-length kernels — not run here, no flash kernels on CPU).
A 2-D mask switches that off: ``model(ids, attention_mask=ones, position_ids=resets)`` attends across documents —
and so does ``model(ids, position_ids=resets)`` with the default ``use_cache=True`` (5.24 builds a ``DynamicCache``
in forward, and packing is detected only without a cache; pass ``use_cache=False``). Only tensors cross stages, so
"no mask" cannot travel as ``None``: a packed batch carries a fourth tensor, the document ids, and a decoder layer
that receives it builds its mask exactly as the model's forward does for a packed batch — without the 2-D mask (an
all-ones placeholder in its slot), from the position ids.

[Note: HF names]
Every layer records, for each of its parameters (and persistent buffers), the candidate keys under which the
model's ``state_dict`` / safetensors file stores it (``hf_keys``); a tied head weight also lists the embedding's
key (tied checkpoints often store only that one). :func:`~lightning_pipe.hf.weights.load_layers` /
:func:`~lightning_pipe.hf.weights.load_layer_weights_` read exactly those keys with ``safetensors.safe_open``, so a
rank reads only the tensors of its own layers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch
from torch import Tensor, nn

from lightning_pipe.hf.families import attention_type, family
from lightning_pipe.hf.masks import make_mask
from lightning_pipe.hf.moe import RouterBalance, find_routers, release_carry, router_logits_source

__all__ = [
    "CausalLMDecoderLayer",
    "CausalLMEmbedding",
    "CausalLMHead",
    "CausalLMNorm",
    "HFLayer",
    "causal_lm_layers",
    "layers_from_config",
]


def _unpack(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Positional tensors, or one tuple of them (see [Note: layer I/O])."""
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        return tuple(args[0])
    return args


def _default_position_ids(hidden: Tensor) -> Tensor:
    # What the model's forward uses without a cache: arange(T), unsqueezed (broadcast over the batch).
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


# ------------------------------------------------------------------------------------------------ layers
class HFLayer(nn.Module):
    """Base of the layer wrappers: knows the checkpoint keys of its tensors (see [Note: HF names]).

    ``hf_keys``: local name (as in ``self.state_dict()``) -> candidate keys in the model's checkpoint, best first.
    ``base_prefix``: the base model's attribute (``"model."`` / ``"transformer."``); checkpoints saved from the bare
    base model store keys without it, so it is tried stripped too.
    """

    hf_keys: dict[str, tuple[str, ...]]
    base_prefix: str = ""
    tied: frozenset[str] = frozenset()
    """Local names of parameters that are a tie's second use (the head's weight): left alone by :func:`init_layer_`."""

    def _record_hf_keys(self, model: nn.Module, base_prefix: str) -> None:
        names_of: dict[int, list[str]] = {}
        for name, tensor in _state_tensors(model):
            names_of.setdefault(id(tensor), []).append(name)
        keys: dict[str, tuple[str, ...]] = {}
        for local, tensor in _state_tensors(self):
            candidates = names_of.get(id(tensor))
            if not candidates:
                continue  # not part of the model's state (cannot happen for the supported families)
            keys[local] = tuple(candidates)
        self.hf_keys = keys
        self.base_prefix = f"{base_prefix}." if base_prefix else ""

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (they hold garbage after ``to_empty`` from the meta device)."""


def _state_tensors(module: nn.Module) -> Iterable[tuple[str, Tensor]]:
    """Parameters (duplicates kept) and persistent buffers, with their state-dict names."""
    for prefix, sub in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, param in sub._parameters.items():
            if param is not None:
                yield dot + name, param
        for name, buf in sub._buffers.items():
            if buf is not None and name not in sub._non_persistent_buffers_set:
                yield dot + name, buf


class CausalLMEmbedding(HFLayer):
    """``input_ids [, attention_mask [, position_ids]] -> hidden [, attention_mask [, position_ids]]``.

    Token embedding (+ GPT-2's learned position embedding and embedding dropout). The mask and position ids are
    passed on untouched for the decoder layers.
    """

    vocab_setting = "the transformers config's `vocab_size` (HFCausalLM(config=...))"  # named by a TokenIdError
    carry_experts = 0  # MoE with the load-balancing loss: the expert count of the carry it starts (moe.py)

    def __init__(self, embed_tokens: nn.Embedding, position_embedding: nn.Embedding | None = None,
                 dropout: nn.Module | None = None) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.position_embedding = position_embedding
        self.dropout = dropout

    def forward(self, *args: Any) -> Any:
        input_ids, *rest = _unpack(args)
        hidden = self.embed_tokens(input_ids)
        if self.position_embedding is not None:
            if len(rest) > 1:
                position_ids = rest[1]
            else:  # positions 0..T-1: a shape check, no host read (an explicit id out of range stays torch's error)
                self._check_length(hidden.shape[1])
                position_ids = _default_position_ids(hidden)
            hidden = hidden + self.position_embedding(position_ids).to(hidden.device)
        if self.dropout is not None:
            hidden = self.dropout(hidden)
        if self.carry_experts:  # [Note: the load-balancing loss across stages] in moe.py
            rest.append(torch.zeros(hidden.shape[0], self.carry_experts, device=hidden.device))
        return (hidden, *rest) if rest else hidden

    def _check_length(self, length: int) -> None:
        positions = self.position_embedding.num_embeddings  # type: ignore[union-attr]
        if length > positions:
            raise ValueError(
                f"Sequence length {length} exceeds the {positions} learned positions of the model's position "
                f"embedding ({type(self).__name__}.position_embedding). Rule: a sequence is at most the transformers "
                f"config's `n_positions` tokens long (GPT-2). Got {length} tokens with n_positions={positions}. Crop "
                f"or split the sequences to at most {positions} tokens, or build the model with n_positions >= {length}."
            )


class CausalLMDecoderLayer(HFLayer):
    """``hidden [, attention_mask [, position_ids [, seq_idx]]] -> the same arity``.

    Wraps one of the model's decoder layers (``seq_idx``: packed rows, [Note: packed rows]). Builds the 4-D mask for its attention type (full / sliding window) with
    transformers' mask functions, and — for rotary families — ``(cos, sin)`` with its own copy of the rotary module,
    exactly as the model's forward does once for all layers.
    """

    def __init__(self, block: nn.Module, config: Any, layer_index: int, rotary: nn.Module | None = None) -> None:
        super().__init__()
        self.block = block
        self.rotary_emb = rotary
        self.layer_index = layer_index
        self.attention_type = attention_type(config, layer_index)
        # The model's config object itself (shared, not copied): set_attn_implementation on the model reaches us.
        self.config = config
        self.balance: RouterBalance | None = None  # an MoE layer's part of the load-balancing loss (moe.py)
        self.carries = False  # the layer tuple ends with the MoE carry: [Note: the load-balancing loss across stages]

    @contextlib.contextmanager
    def meta_forward_context(self) -> Iterator[None]:
        """Around a forward on meta tensors (the pipeline's shape planning, [Note: shapes without re-inference] in
        lightning_pipe/runtime/shapes.py): transformers' ``grouped_mm`` experts call torch's grouped matrix
        multiply, whose meta kernel refuses fp32; its ``batched_mm`` experts compute the same output shapes from
        plain indexing and batched matmuls, so they stand in while shapes are planned. Nothing changes otherwise."""
        config = self.config
        implementation = getattr(config, "_experts_implementation", None)
        if implementation != "grouped_mm":
            yield
            return
        config._experts_implementation = "batched_mm"
        try:
            yield
        finally:
            config._experts_implementation = implementation

    def forward(self, *args: Any) -> Any:
        hidden, *rest = _unpack(args)
        carry = rest.pop() if self.carries else None
        if self.balance is not None:
            self.balance.start()
        hidden = self._block_forward(hidden, rest)
        if carry is None:
            return (hidden, *rest) if rest else hidden
        if self.balance is not None:
            hidden, carry = self.balance.add_term(hidden, carry, rest[0] if rest else None)
        return (hidden, *rest, carry)

    def _block_forward(self, hidden: Tensor, rest: list[Any]) -> Tensor:
        attention_mask = rest[0] if rest else None
        position_ids = rest[1] if len(rest) > 1 else _default_position_ids(hidden)
        if len(rest) > 2:  # packed rows: the mask transformers builds from position resets ([Note: packed rows])
            attention_mask = None
        # On meta tensors (the shape planner: [Note: shapes without re-inference]) the mask's values cannot be read
        # (transformers inspects them), and no output shape depends on them: plan with the causal path.
        mask = (None if hidden.is_meta
                else make_mask(self.attention_type, self.config, hidden, attention_mask, position_ids))
        kwargs: dict[str, Any] = {"attention_mask": mask, "position_ids": position_ids, "use_cache": False}
        if self.rotary_emb is not None:
            kwargs["position_embeddings"] = self.rotary_emb(hidden, position_ids)
        out = self.block(hidden, **kwargs)
        return out[0] if isinstance(out, tuple) else out  # older layer classes returned (hidden, ...)

    def reset_buffers(self) -> None:
        rotary: Any = self.rotary_emb
        if rotary is None or not hasattr(rotary, "inv_freq") or rotary.inv_freq.is_meta:
            return
        rope_type = getattr(rotary, "rope_type", "default")
        if rope_type == "default" and hasattr(rotary, "compute_default_rope_parameters"):
            fn = rotary.compute_default_rope_parameters
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
            fn = ROPE_INIT_FUNCTIONS[rope_type]
        inv_freq, scaling = fn(rotary.config)
        with torch.no_grad():
            rotary.inv_freq.copy_(inv_freq)
            if getattr(rotary, "original_inv_freq", None) is not None:
                rotary.original_inv_freq.copy_(inv_freq)
        rotary.attention_scaling = scaling

    def extra_repr(self) -> str:
        return f"layer_index={self.layer_index}, attention_type={self.attention_type}"


class CausalLMNorm(HFLayer):
    """``hidden [, ...] -> hidden``: the final norm; the mask and position ids end here."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    carries = False

    def forward(self, *args: Any) -> Any:
        parts = _unpack(args)
        return (self.norm(parts[0]), parts[-1]) if self.carries else self.norm(parts[0])


class CausalLMHead(HFLayer):
    """``hidden -> logits``. With tied embeddings ``lm_head.weight`` IS the embedding's Parameter."""

    def __init__(self, lm_head: nn.Module) -> None:
        super().__init__()
        self.lm_head = lm_head

    carries = False

    def forward(self, *args: Any) -> Tensor:
        parts = _unpack(args)
        logits = self.lm_head(parts[0])
        return release_carry(logits, parts[1]) if self.carries else logits


# ------------------------------------------------------------------------------------------------ building
def causal_lm_layers(model: nn.Module) -> nn.ModuleList:
    """The layer list of an instantiated transformers ``*ForCausalLM`` model, reusing its modules (same weights).

    ``[CausalLMEmbedding, CausalLMDecoderLayer x num_hidden_layers, CausalLMNorm, CausalLMHead]``; see
    [Note: layer I/O]. With ``config.tie_word_embeddings`` the head's weight is the embedding's Parameter object.
    The model object itself is not kept: drop it and keep the list.
    """
    config: Any = model.config
    fam = family(config)
    base: Any = getattr(model, fam.base)
    if base is None or not hasattr(model, "lm_head"):
        raise TypeError(f"Expected a transformers *ForCausalLM model with `.{fam.base}` and `.lm_head`; "
                        f"got {type(model).__name__}.")
    embed = CausalLMEmbedding(
        getattr(base, fam.embed),
        getattr(base, fam.pos_embed) if fam.pos_embed else None,
        getattr(base, fam.drop) if fam.drop else None,
    )
    rotary = getattr(base, fam.rotary) if fam.rotary else None
    blocks = list(getattr(base, fam.layers))[: config.num_hidden_layers]
    decoders = []
    for i, block in enumerate(blocks):
        # Each decoder layer owns a copy of the rotary module (buffers only): a stage needs no other stage's module.
        own_rotary = _copy_rotary(rotary) if rotary is not None else None
        decoders.append(CausalLMDecoderLayer(block, config, i, own_rotary))
    norm = CausalLMNorm(getattr(base, fam.norm))
    head = CausalLMHead(cast(nn.Module, model.lm_head))
    parts: list[HFLayer] = [embed, *decoders, norm, head]
    _balance_routers(model, embed, decoders, norm, head)

    embed_weights = {id(p) for p in embed.parameters()}
    head.tied = frozenset(n for n, p in head.named_parameters() if id(p) in embed_weights)
    for layer in parts:
        layer._record_hf_keys(model, fam.base)
        # Plain attributes (picklable): what init_layer_ needs to run the model class's own _init_weights.
        layer.__dict__["hf_model_class"] = type(model)
        layer.__dict__["hf_config"] = config
    return nn.ModuleList(parts)


def _balance_routers(model: nn.Module, embed: CausalLMEmbedding, decoders: list[CausalLMDecoderLayer],
                     norm: CausalLMNorm, head: CausalLMHead) -> None:
    """With ``config.output_router_logits`` (transformers then adds the load-balancing loss): the carry through
    every layer and each MoE layer's :class:`RouterBalance` ([Note: the load-balancing loss across stages])."""
    config: Any = model.config
    source = router_logits_source(model)
    if source is None or not getattr(config, "output_router_logits", False) \
            or not hasattr(model, "router_aux_loss_coef"):
        return
    routers = [find_routers(d.block, source[0]) for d in decoders]
    moe_layers = sum(bool(r) for r in routers)
    m: Any = model
    embed.carry_experts = int(m.num_experts)
    norm.carries = head.carries = True
    for decoder, found in zip(decoders, routers):
        decoder.carries = True
        if found:
            decoder.balance = RouterBalance(found[0], source[1], int(m.num_experts), int(m.num_experts_per_tok),
                                            moe_layers, float(m.router_aux_loss_coef))


def _copy_rotary(rotary: nn.Module) -> nn.Module:
    import copy
    return copy.deepcopy(rotary, memo={id(rotary.config): rotary.config})


def layers_from_config(config: Any, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                       attn_implementation: str | None = None, init: bool = True) -> nn.ModuleList:
    """Build the layer list of ``config``'s causal LM without any download.

    ``device="meta"`` (or an ambient ``with torch.device("meta")``, as ``configure_model`` runs under the pipeline)
    allocates nothing: allocate the layers you hold with
    :func:`~lightning_pipe.hf.weights.materialize_layers_`, then fill them with
    :func:`~lightning_pipe.hf.weights.init_layer_` (seeded random init) or
    :func:`~lightning_pipe.hf.weights.load_layer_weights_` (a local checkpoint). ``init=False``
    skips transformers' random init on a real device (when the weights are loaded right after).
    """
    from transformers import AutoModelForCausalLM

    family(config)  # fail early, with the list of supported families
    kwargs: dict[str, Any] = {}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    meta = device is not None and torch.device(device).type == "meta"
    skip_init = meta or not init
    with contextlib.ExitStack() as stack:
        if device is not None:
            stack.enter_context(torch.device(device))
        if skip_init:
            from transformers.initialization import no_init_weights
            stack.enter_context(no_init_weights())
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    if config.tie_word_embeddings and model.lm_head.weight is not model.get_input_embeddings().weight:
        model.tie_weights()
    return causal_lm_layers(model)
