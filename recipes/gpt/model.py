"""A nanoGPT-style GPT written as a layer list, so that ``PipelineStrategy`` can cut it into stages.

``self.layers = [Embedding, Block x n_layer, FinalNorm, Head]``; every layer maps one tensor to one tensor:

    LongTensor[B, T] -> Embedding -> [B, T, C] -> Block ... Block -> FinalNorm -> Head -> logits [B, T, V]

Packed rows (``data=packed``) add document ids ``[B, T]`` (1, 2, ... per row, 0 = padding): batches
``{"input_ids", "document_ids", "labels"}``, and the embedding and blocks pass ``(hidden, document_ids)`` on, so positions restart per
document and attention stays inside it ([Note: packed sequences] in ``lightning_pipe/layers/packing.py``).

The head's weight *is* the token embedding's weight (the same ``nn.Parameter``, GPT-2 style); the pipeline
strategy finds such shared parameters and keeps the copies on the first and last stage in sync.
The same module trains unchanged on one device (``strategy=single``), which is how it is debugged and tested.
Under ``strategy.tensor_parallel_size > 1`` :meth:`GPT.parallelize_layer` splits each block over the tensor ranks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_pipe import PipelineModule
from lightning_pipe.layers.packing import IGNORE_INDEX, block_diagonal_causal_mask, positions_from_documents
from lightning_pipe.lightning.module import default_split_batch
from lightning_pipe.parallel.tensor_parallel import FusedColwiseParallel


class Embedding(nn.Module):
    """Token + learned position embeddings: LongTensor[B, T] -> [B, T, C]."""

    vocab_setting = "`vocab_size` (GPT(vocab_size=...); Hydra: model.vocab_size)"  # named by a TokenIdError

    def __init__(self, vocab_size: int, block_size: int, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: Tensor, document_ids: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        t = idx.size(1)
        if t > self.block_size:
            raise ValueError(f"Sequence length {t} exceeds block_size {self.block_size}; crop the input.")
        if document_ids is None:
            return self.drop(self.wte(idx) + self.wpe(torch.arange(t, device=idx.device)))
        # packed rows: positions restart at 0 in every document
        return self.drop(self.wte(idx) + self.wpe(positions_from_documents(document_ids))), document_ids


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head}).")
        self.n_head = n_head
        self.dropout = dropout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: Tensor, document_ids: Tensor | None = None) -> Tensor:
        b, t, c = x.shape
        head_size = c // self.n_head
        # q | k | v side by side; under tensor parallelism (GPT.parallelize_layer) only this rank's heads of each,
        # so the head count is read from the width, not from n_head.
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        # [B, T, heads * hs] -> [B, heads, T, hs]
        q, k, v = (z.view(b, t, -1, head_size).transpose(1, 2) for z in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        if document_ids is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        else:  # packed rows: causal within each document only
            mask = block_diagonal_causal_mask(document_ids)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        y = y.transpose(1, 2).contiguous().view(b, t, -1)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x)); ``(x, document_ids)`` for packed rows."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x: Tensor, document_ids: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        x = x + self.attn(self.ln_1(x), document_ids)
        x = x + self.mlp(self.ln_2(x))
        return x if document_ids is None else (x, document_ids)


class FinalNorm(nn.Module):
    """The LayerNorm after the last block (a layer of its own, so it can sit on any stage)."""

    def __init__(self, n_embd: int, bias: bool) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)

    def forward(self, x: Tensor, document_ids: Tensor | None = None) -> Tensor:
        return self.ln_f(x)  # the document ids end here


class Head(nn.Module):
    """[B, T, C] -> logits [B, T, V]; the weight is tied to the token embedding by :class:`GPT`."""

    def __init__(self, n_embd: int, vocab_size: int) -> None:
        super().__init__()
        self.head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(x)


def split_recipe_batch(batch: Any) -> tuple[Any, Any]:
    """The recipes' batches: ``(x, y)`` pairs (a mean loss), or the variable-length data's dicts
    ``{"input_ids", "document_ids"?, "labels"}`` -> ``(x or (x, document_ids), {"labels": y})``: the first layer's
    positional arguments, and a dict target that makes :func:`recipe_loss` token-weighted."""
    if isinstance(batch, Mapping) and "input_ids" in batch:
        x, doc = batch["input_ids"], batch.get("document_ids")
        return (x if doc is None else (x, doc)), {"labels": batch["labels"]}
    return default_split_batch(batch)


def recipe_loss(logits: Tensor, target: Tensor | Mapping[str, Tensor]) -> Tensor | tuple[Tensor, Tensor]:
    """A tensor target (``(x, y)`` windows, every token counted): the mean cross-entropy. A ``{"labels"}`` target
    (dynamically padded or packed rows): token-weighted ``(sum, count)``, labels ``-100`` not counted, so the batch
    loss is the global sum over the global count however padding falls across micro-batches and replicas. The form
    follows the batch's structure, never its values: every micro-batch of a batch returns the same kind."""
    if not isinstance(target, Mapping):
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), target.reshape(-1))
    flat = target["labels"].reshape(-1)
    total = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), flat, ignore_index=IGNORE_INDEX,
                            reduction="sum")
    return total, (flat != IGNORE_INDEX).sum()


def warmup_cosine(step: int, warmup_steps: int, max_steps: int, min_ratio: float = 0.1) -> float:
    """LR multiplier: linear warm-up to 1, cosine decay to ``min_ratio`` at ``max_steps``, flat after."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if step >= max_steps:
        return min_ratio
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_ratio + 0.5 * (1.0 - min_ratio) * (1.0 + math.cos(math.pi * progress))


def adamw_with_warmup_cosine(module: nn.Module, lr: float, weight_decay: float, betas: Sequence[float],
                             warmup_steps: int, max_steps: int) -> dict:
    """AdamW with weight decay on matrices only, and a per-step warm-up + cosine schedule (Lightning's dict form).

    Built from ``module.named_parameters()`` *now*: under the pipeline each rank holds only its own layers
    (the others are parameter-less placeholders), so any group may be empty and is then left out.
    The rule is nanoGPT's (decay iff ``p.dim() >= 2``: Linear and Embedding weights; not biases or norms).
    It depends on the shape, not on the name, on purpose: a tied weight is ``layers.0.wte.weight`` on the
    first stage and ``layers.N.head.weight`` on the last, and both copies must get the same update.
    """
    decay, no_decay = [], []
    for _, p in module.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": ps, "weight_decay": wd} for ps, wd in ((decay, weight_decay), (no_decay, 0.0)) if ps]
    if not groups:
        raise ValueError(f"{type(module).__name__}.configure_optimizers found no trainable parameters on this rank.")
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=(float(betas[0]), float(betas[1])))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_cosine(step, warmup_steps, max_steps))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class GPT(PipelineModule):
    """A GPT language model; byte-level (``vocab_size=256``) by default.

    Args:
        vocab_size: size of the token vocabulary (256 for bytes; 50304 for GPT-2 BPE padded to 64).
        block_size: maximum context length.
        n_layer, n_head, n_embd: depth, attention heads, width.
        dropout: dropout probability (embeddings, attention, residual branches).
        bias: biases in Linear and LayerNorm layers.
        lr, weight_decay, betas: AdamW settings.
        warmup_steps, max_steps: linear warm-up then cosine decay to 10 % of ``lr`` at ``max_steps``.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        bias: bool = True,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        betas: Sequence[float] = (0.9, 0.95),
        warmup_steps: int = 100,
        max_steps: int = 5000,
    ) -> None:
        super().__init__()
        # Plain floats, so the checkpoint's hyper-parameters load without OmegaConf (Hydra passes a ListConfig).
        betas = (float(betas[0]), float(betas[1]))
        self.save_hyperparameters()
        embedding = Embedding(vocab_size, block_size, n_embd, dropout)
        head = Head(n_embd, vocab_size)
        head.head.weight = embedding.wte.weight  # weight tying: one Parameter, two layers
        self.layers = nn.Sequential(
            embedding,
            *(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer)),
            FinalNorm(n_embd, bias),
            head,
        )
        self._init_weights()

    # ---------------------------------------------------------------- init
    def _init_weights(self) -> None:
        """GPT-2 init: N(0, 0.02) for weights, zero biases, residual projections scaled by 1/sqrt(2 * n_layer)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        resid_std = 0.02 / math.sqrt(2 * self.hparams.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=resid_std)

    # ---------------------------------------------------------------- contract
    def split_batch(self, batch: Any) -> tuple[Any, Any]:
        """``(x, y)``, or ``{"input_ids", "document_ids"?, "labels"}`` (``data=dynamic_padding`` / ``packed``)."""
        return split_recipe_batch(batch)

    def loss_fn(self, output: Tensor, target: Any) -> Any:
        """Mean cross-entropy for ``(x, y)``; token-weighted ``(sum, count)`` for dict batches (see recipe_loss)."""
        return recipe_loss(output, target)

    def configure_optimizers(self) -> dict:
        hp = self.hparams
        return adamw_with_warmup_cosine(self, hp.lr, hp.weight_decay, hp.betas, hp.warmup_steps, hp.max_steps)

    # ---------------------------------------------------------------- tensor parallelism
    def parallelize_layer(self, index: int, layer: nn.Module, tp_mesh: DeviceMesh) -> None:
        """Split a block over ``tp_mesh`` (``strategy.tensor_parallel_size``), Megatron-style: attention by heads
        (q|k|v column-wise, each rank its own heads of each; the output projection row-wise) and the MLP
        column-wise then row-wise, so each block needs one all-reduce forward and one backward per half. The
        embedding, the norms and the head (tied to the embedding) stay whole on every tensor rank. (Dropout there
        drops the same elements on every tensor rank: the strategy starts them from one random state.)
        """
        if not isinstance(layer, Block):
            return
        size = tp_mesh.size()
        if self.hparams.n_head % size:
            raise ValueError(
                f"Tensor parallelism splits attention by heads: n_head must be divisible by the tensor-parallel "
                f"size; got n_head={self.hparams.n_head}, tensor_parallel_size={size}. Change model.n_head or "
                "strategy.tensor_parallel_size.")
        parallelize_module(layer, tp_mesh, {
            "attn.c_attn": FusedColwiseParallel(3),
            "attn.c_proj": RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(),
            "mlp.c_proj": RowwiseParallel(),
        })

    # ---------------------------------------------------------------- sampling (one device)
    @torch.no_grad()
    def generate(
        self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None
    ) -> Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` (LongTensor[B, T]); runs the whole model locally."""
        block_size = self.hparams.block_size
        for _ in range(max_new_tokens):
            context = idx[:, -block_size:]
            logits = self(context)[:, -1, :] / max(temperature, 1e-8)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_token = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, next_token), dim=1)
        return idx
