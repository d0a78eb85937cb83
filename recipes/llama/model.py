"""A Llama-style decoder written as a layer list: RMSNorm, rotary position embeddings, SwiGLU, grouped-query attention.

``self.layers = [Embedding, Block x n_layer, FinalNorm, Head]``; every layer maps one tensor to one tensor:

    LongTensor[B, T] -> Embedding -> [B, T, C] -> Block ... Block -> FinalNorm -> Head -> logits [B, T, V]

Packed rows (``data=packed``): batches ``{"input_ids", "document_ids", "labels"}``; the embedding and blocks pass
``(hidden, document_ids)`` on, RoPE restarts at each document and attention stays inside it ([Note: packed
sequences] in ``lightning_pipe/layers/packing.py``).

Rotary embeddings are recomputed inside each block from the sequence length (cheap, and no buffer has to cross a
stage boundary or survive the meta device). The layers are built in ``configure_model`` on the meta device under
``PipelineStrategy`` and initialised per layer by :meth:`Llama.reset_layer` (seeded by the layer index), so a
billion-parameter model never exists whole on any rank, and one device and every pipeline layout start equal.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_pipe import PipelineModule
from lightning_pipe.layers.aux import attach_aux_loss
from lightning_pipe.layers.packing import block_diagonal_causal_mask, positions_from_documents
from recipes.gpt.model import adamw_with_warmup_cosine, recipe_loss, split_recipe_batch
from recipes.llama.moe import MoEFeedForward, SwiGLU


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32 (as Llama does): bf16 squares lose too much.
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def rotary(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos/sin tables [T, head_dim / 2] for positions 0..T-1 (fp32)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x[..., :d/2], x[..., d/2:]) of x [B, H, T, D] by the position angles (the "rotate half" form)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


class Attention(nn.Module):
    """Causal self-attention with ``n_kv_head`` key/value heads shared by groups of ``n_head // n_kv_head`` queries."""

    def __init__(self, n_embd: int, n_head: int, n_kv_head: int, rope_theta: float) -> None:
        super().__init__()
        if n_embd % n_head or n_head % n_kv_head:
            raise ValueError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head}), and n_head by "
                             f"n_kv_head ({n_kv_head}).")
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, n_embd // n_head
        self.rope_theta = rope_theta
        self.wq = nn.Linear(n_embd, n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(n_embd, n_kv_head * self.head_dim, bias=False)
        self.wv = nn.Linear(n_embd, n_kv_head * self.head_dim, bias=False)
        self.wo = nn.Linear(n_head * self.head_dim, n_embd, bias=False)

    def forward(self, x: Tensor, document_ids: Tensor | None = None) -> Tensor:
        b, t, _ = x.shape
        # Head counts from the projections' widths: under tensor parallelism (Llama.parallelize_layer) this rank
        # holds only its own query and key/value heads, in the same ratio.
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        cos, sin = rotary(t, self.head_dim, self.rope_theta, x.device)
        if document_ids is not None:  # packed rows: each token's angle is its position in its own document
            positions = positions_from_documents(document_ids)
            cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [B, 1, T, D/2]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        groups = q.size(1) // k.size(1)
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if document_ids is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=block_diagonal_causal_mask(document_ids))
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x)); ``(x, document_ids)`` for packed rows. The
    MLP is a :class:`MoEFeedForward` when ``moe`` is given (its balance loss, times ``moe.aux_coef``, enters the
    training loss through the activation)."""

    def __init__(self, n_embd: int, n_head: int, n_kv_head: int, hidden: int, rope_theta: float, eps: float,
                 moe: MoESettings | None = None) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(n_embd, eps)
        self.attention = Attention(n_embd, n_head, n_kv_head, rope_theta)
        self.ffn_norm = RMSNorm(n_embd, eps)
        self.feed_forward: nn.Module = (SwiGLU(n_embd, hidden) if moe is None else
                                        MoEFeedForward(n_embd, hidden, moe.experts, moe.top_k, moe.shared_expert))
        self.aux_coef = 0.0 if moe is None else moe.aux_coef

    def forward(self, x: Tensor, document_ids: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        x = x + self.attention(self.attention_norm(x), document_ids)
        if not isinstance(self.feed_forward, MoEFeedForward):
            x = x + self.feed_forward(self.ffn_norm(x))
        else:
            out, balance = self.feed_forward(self.ffn_norm(x))
            x = x + out
            if self.aux_coef and self.training:
                x = attach_aux_loss(x, balance, name="router_balance", coef=self.aux_coef)
        return x if document_ids is None else (x, document_ids)


@dataclass(frozen=True)
class MoESettings:
    experts: int
    top_k: int
    shared_expert: bool
    aux_coef: float


class Embedding(nn.Module):
    """LongTensor[B, T] -> [B, T, C] (no position embedding: positions enter through RoPE)."""

    vocab_setting = "`vocab_size` (Llama(vocab_size=...); Hydra: model.vocab_size)"  # named by a TokenIdError

    def __init__(self, vocab_size: int, block_size: int, n_embd: int) -> None:
        super().__init__()
        self.block_size = block_size
        self.tok_embeddings = nn.Embedding(vocab_size, n_embd)

    def forward(self, idx: Tensor, document_ids: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        if idx.size(1) > self.block_size:
            raise ValueError(f"Sequence length {idx.size(1)} exceeds block_size {self.block_size}; crop the input.")
        h = self.tok_embeddings(idx)
        return h if document_ids is None else (h, document_ids)


class FinalNorm(nn.Module):
    def __init__(self, n_embd: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(n_embd, eps)

    def forward(self, x: Tensor, document_ids: Tensor | None = None) -> Tensor:
        return self.norm(x)  # the document ids end here


class Head(nn.Module):
    def __init__(self, n_embd: int, vocab_size: int) -> None:
        super().__init__()
        self.output = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.output(x)


_EXPERT_NAME = re.compile(r"experts\.experts\.(\d+)\.")


def _expert_generator(seed: int, index: int, name: str) -> torch.Generator | None:
    """A routed expert draws from its own generator: under expert parallelism a rank holds only some experts, and
    each must start as on one device whichever others are present."""
    match = _EXPERT_NAME.search(name)
    if match is None:
        return None
    return torch.Generator().manual_seed((seed * 100_003 + index) * 1_009 + int(match.group(1)) + 1)


def swiglu_hidden(n_embd: int, multiple_of: int) -> int:
    """Llama's MLP width: 2/3 of 4 x n_embd, rounded up to a multiple of ``multiple_of``."""
    hidden = int(2 * 4 * n_embd / 3)
    return multiple_of * math.ceil(hidden / multiple_of)


class Llama(PipelineModule):
    """A Llama-style language model; byte-level (``vocab_size=256``) by default.

    Args:
        vocab_size, block_size: vocabulary and maximum context length.
        n_layer, n_head, n_kv_head, n_embd: depth, query heads, key/value heads (grouped-query attention), width.
        multiple_of: the SwiGLU hidden width is rounded up to a multiple of this.
        rope_theta, norm_eps: rotary base and RMSNorm epsilon.
        tie_embeddings: the head reuses the token embedding's weight (one Parameter, kept in sync across stages).
        init_seed: seeds each layer's initialisation (``reset_layer``), so every layout starts from equal weights.
        lr, weight_decay, betas, warmup_steps, max_steps: AdamW with warm-up and cosine decay (as the GPT recipe).
        moe_experts: 0 (dense) or the number of routed SwiGLU experts per block (recipes/llama/moe.py);
            ``moe_top_k`` experts per token, plus one always-on expert with ``moe_shared_expert``; the
            load-balancing loss enters the training loss times ``moe_aux_coef`` (0: not at all). Each step logs
            the expert load (``moe_load_max``: the busiest expert's share over the mean share, 1.0 = balanced).
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_kv_head: int = 2,
        n_embd: int = 128,
        multiple_of: int = 32,
        rope_theta: float = 10000.0,
        norm_eps: float = 1e-5,
        tie_embeddings: bool = False,
        init_seed: int = 0,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        betas: Sequence[float] = (0.9, 0.95),
        warmup_steps: int = 100,
        max_steps: int = 5000,
        moe_experts: int = 0,
        moe_top_k: int = 2,
        moe_shared_expert: bool = False,
        moe_aux_coef: float = 0.01,
    ) -> None:
        super().__init__()
        betas = (float(betas[0]), float(betas[1]))  # plain floats: Hydra passes a ListConfig
        self.save_hyperparameters()
        self.layers: nn.Sequential | None = None

    def configure_model(self) -> None:
        """Build the layer list (on the meta device under PipelineStrategy; each rank then materialises its own)."""
        if self.layers is not None:
            return
        hp = self.hparams
        hidden = swiglu_hidden(hp.n_embd, hp.multiple_of)
        embedding = Embedding(hp.vocab_size, hp.block_size, hp.n_embd)
        head = Head(hp.n_embd, hp.vocab_size)
        if hp.tie_embeddings:
            head.output.weight = embedding.tok_embeddings.weight
        moe = (MoESettings(hp.moe_experts, hp.moe_top_k, bool(hp.moe_shared_expert), float(hp.moe_aux_coef))
               if hp.get("moe_experts", 0) else None)
        self.layers = nn.Sequential(
            embedding,
            *(Block(hp.n_embd, hp.n_head, hp.n_kv_head, hidden, hp.rope_theta, hp.norm_eps, moe)
              for _ in range(hp.n_layer)),
            FinalNorm(hp.n_embd, hp.norm_eps),
            head,
        )
        for index, layer in enumerate(self.layers):
            self.reset_layer(index, layer)

    def reset_layer(self, index: int, layer: nn.Module) -> None:
        """Deterministic per-layer init: N(0, 0.02) weights, output projections scaled by 1/sqrt(2 n_layer), norms 1.
        A no-op on meta tensors (the strategy calls it again for each rank's own layers once they are allocated)."""
        hp = self.hparams
        generator = torch.Generator().manual_seed(hp.init_seed * 100_003 + index)
        resid_std = 0.02 / math.sqrt(2 * hp.n_layer)
        with torch.no_grad():
            for buffer in layer.buffers():  # the expert load counters (allocated uninitialised from meta)
                if not buffer.is_meta:
                    buffer.zero_()
            for name, p in layer.named_parameters():
                if p.is_meta or (hp.tie_embeddings and isinstance(layer, Head)):
                    # A tied head weight is the embedding's: layer 0 initialises it (on its rank), and the pipeline
                    # copies it to the head's rank; re-drawing it here would differ from one device.
                    continue
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                    continue
                std = resid_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=_expert_generator(hp.init_seed, index, name) or generator)
                        * std)

    def parallelize_layer(self, index: int, layer: nn.Module, tp_mesh: DeviceMesh) -> None:
        """Split a block over ``tp_mesh`` (``strategy.tensor_parallel_size``): q / k / v and the SwiGLU gate / up
        column-wise (each rank its own query and key/value heads), the output and down projections row-wise. The
        embedding, norms and head stay whole on every tensor rank (a tied head stays tied)."""
        if not isinstance(layer, Block):
            return
        hp, size = self.hparams, tp_mesh.size()
        counts = {"n_head": hp.n_head, "n_kv_head": hp.n_kv_head,
                  "SwiGLU hidden": swiglu_hidden(hp.n_embd, hp.multiple_of)}
        uneven = {name: n for name, n in counts.items() if n % size}
        if uneven:
            raise ValueError(
                f"Tensor parallelism gives each tensor rank an equal share of the heads and of the SwiGLU width; "
                f"got {uneven} with tensor_parallel_size={size}. Change model.n_head / model.n_kv_head / "
                "model.multiple_of, or strategy.tensor_parallel_size.")
        column, row = ColwiseParallel(), RowwiseParallel()
        parallelize_module(layer, tp_mesh, {
            "attention.wq": column, "attention.wk": column, "attention.wv": column, "attention.wo": row,
            "feed_forward.w1": column, "feed_forward.w3": column, "feed_forward.w2": row})

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.hparams.get("moe_experts", 0):
            self.log_expert_load()
        return loss

    def log_expert_load(self) -> None:
        """Log the expert load of every MoE layer since the last call, after the step's schedule (one sum over all
        ranks: each holds its own layers' counts): ``moe/layer<i>_expert<e>`` (fraction of the layer's routed
        (token, choice) pairs), ``moe/layer<i>_max_over_mean`` and, in the progress bar, ``moe_load_max``."""
        assert self.layers is not None
        load = torch.zeros(len(self.layers), self.hparams.moe_experts, device=self.device)
        for i, layer in enumerate(self.layers):
            if isinstance(layer, Block) and isinstance(layer.feed_forward, MoEFeedForward):
                load[i] = layer.feed_forward.take_load().to(load.device)
        # every rank's layers: summed over the world (the strategy's default is the ranks that read different data)
        load = self.trainer.strategy.reduce(load, group=dist.group.WORLD, reduce_op="sum")  # identity on one device
        worst = 0.0
        for i in range(1, self.hparams.n_layer + 1):  # the blocks (other ranks' are placeholders here)
            total = float(load[i].sum())
            if total == 0:
                continue
            fraction = load[i] / total
            imbalance = float(fraction.max()) * self.hparams.moe_experts
            worst = max(worst, imbalance)
            self.log(f"moe/layer{i}_max_over_mean", imbalance)
            for e, f in enumerate(fraction.tolist()):
                self.log(f"moe/layer{i}_expert{e}", f)
        self.log("moe_load_max", worst, prog_bar=True)

    def split_batch(self, batch: Any) -> tuple[Any, Any]:
        """``(x, y)``, or ``{"input_ids", "document_ids"?, "labels"}`` (``data=dynamic_padding`` / ``packed``)."""
        return split_recipe_batch(batch)

    def loss_fn(self, output: Tensor, target: Any) -> Any:
        """Mean cross-entropy for ``(x, y)``; token-weighted ``(sum, count)`` for dict batches (see recipe_loss)."""
        return recipe_loss(output, target)

    def configure_optimizers(self) -> dict:
        hp = self.hparams
        return adamw_with_warmup_cosine(self, hp.lr, hp.weight_decay, hp.betas, hp.warmup_steps, hp.max_steps)
