"""One micro-batch through one layer on one GPU: seconds by schedule action, activation bytes kept by recompute mode,
output bytes, parameters. The layer list is the recipes' one: embedding, ``layers`` blocks, final norm, head.

[Note: activations a layer keeps]
Bytes autograd keeps per micro-batch between a layer's forward and its backward, counted per tensor as Korthikanti
et al. (2022) count a Megatron block (their 34 sbh + 5 as^2 b for fp16 with dropout, no tensor parallelism):
the two norms' inputs, the QKV input, q / k / v, the attention output (the projection's input), the MLP's input and
its activation's inputs (GELU: its input and output; SwiGLU: gate, up, silu(gate) and their product), dropout masks
(1 byte) when dropout runs. Materialised attention adds the softmax output, and with dropout its mask and output,
over ``heads x seq`` scores per token; flash attention keeps its log-sum-exp instead (4 bytes per head and token).
Split over tensor ranks: everything inside the attention and the MLP; norms, residuals and their inputs stay whole
unless sequence-parallel. ``selective`` recompute drops what the attention core keeps beyond q / k / v (the
scores); ``full`` keeps only the layer's input. A recomputed layer rebuilds all of its activations during its own
backward: one layer's worth (``whole``) is then live on top of what the stage keeps.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lightning_pipe.planner.cluster.comm import Links
from lightning_pipe.planner.cluster.kernels import (
    Kernels,
    Phases,
    block_compute,
    embedding_compute,
    head_compute,
    norm_compute,
)
from lightning_pipe.planner.cluster.specs import ClusterSpec, ModelSpec, Stack

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class LayerCost:
    """One layer, one micro-batch, one GPU (seconds and bytes)."""

    run: Phases
    """Compute plus the tensor-parallel collectives, by the action they fall in."""
    again: Mapping[str, float]
    """Seconds a backward re-runs of the forward, per recompute mode."""
    saved: Mapping[str, float]
    """Activation bytes kept from forward to backward, per recompute mode."""
    whole: float
    """Bytes of all its activations (live during a recomputed layer's backward)."""
    output: float
    """Bytes of its output (what crosses a stage boundary)."""
    params: float
    """Parameters held by one GPU."""
    kind: str = "block"


@dataclass(frozen=True)
class LayerModel:
    """Prices the layers of ``model`` at tensor-parallel size ``tp`` for micro-batches of ``b`` sequences."""

    model: ModelSpec
    cluster: ClusterSpec
    stack: Stack
    kernels: Kernels
    links: Links
    tp: int
    b: float

    def layers(self) -> list[LayerCost]:
        """Embedding, the blocks, the final norm, the head."""
        block = self.block()
        return [self.embedding(), *([block] * self.model.layers), self.norm(), self.head()]

    def _tp_all_reduce(self) -> float:
        nbytes = self.b * self.model.seq * self.model.hidden * self.cluster.act_bytes
        return self.links.all_reduce(nbytes, (self.tp, 1)) if self.tp > 1 else 0.0

    def block(self) -> LayerCost:
        m, s = self.model, self.stack
        run, core = block_compute(self.kernels, m, s, self.b, self.tp)
        comm = 2 * self._tp_all_reduce()  # forward: after attention and after the MLP; backward: two at their inputs
        run = run + Phases(comm, comm, 0.0)
        saved, whole = self._block_saved()
        return LayerCost(run, {"none": 0.0, "selective": core.f, "full": run.f}, saved, whole,
                         self._hidden_bytes(), self.tp_params(m.block_params), "block")

    def _hidden_bytes(self) -> float:
        return self.b * self.model.seq * self.model.hidden * self.cluster.act_bytes

    def tp_params(self, count: float) -> float:
        return count / self.tp

    def _block_saved(self) -> tuple[dict[str, float], float]:
        """[Note: activations a layer keeps]."""
        m, s, t, a = self.model, self.stack, self.tp, self.cluster.act_bytes
        tokens, h = self.b * m.seq, m.hidden
        whole_rank = 1.0 / t if s.sequence_parallel else 1.0
        mask = 1.0 if s.dropout else 0.0
        replicated = (4 * h * a + 2 * h * mask) * whole_rank  # 2 norm inputs, QKV and MLP inputs; 2 dropout masks
        act = (2 if m.activation == "gelu" else 4) * m.ffn
        split = ((h + 2 * m.kv_dim) + h + act) * a / t  # q, k, v; attention output; activation inputs
        scores = m.heads / t * m.seq
        if s.attention == "materialized":
            core = scores * (a + (a + 1) * mask)  # softmax output; with dropout its mask and output
        else:
            core = m.heads / t * 4.0  # log-sum-exp
        none = tokens * (replicated + split + core)
        selective = tokens * (replicated + split)
        full = tokens * h * a * whole_rank
        return {"none": none, "selective": selective, "full": full}, none

    def embedding(self) -> LayerCost:
        m, s = self.model, self.stack
        run = embedding_compute(self.kernels, m, s, self.b, self.tp)
        if s.vocab_parallel and self.tp > 1:
            run = run + Phases(self._tp_all_reduce(), 0.0, 0.0)
        rows = m.vocab / self.tp if s.vocab_parallel else m.vocab
        # token ids and positions (int64) for the table's gradient; a dropout mask
        ids = (self.b + 1) * m.seq * 8.0 + (self._hidden_bytes() / self.cluster.act_bytes if s.dropout else 0.0)
        saved = dict.fromkeys(RECOMPUTE, ids)
        return LayerCost(run, dict.fromkeys(RECOMPUTE, 0.0), saved, ids, self._hidden_bytes(),
                         rows * m.hidden + m.seq * m.hidden, "embedding")

    def norm(self) -> LayerCost:
        run = norm_compute(self.kernels, self.model, self.b)
        kept = self._hidden_bytes()
        again = {"none": 0.0, "selective": 0.0, "full": run.f if self.stack.recompute_all_layers else 0.0}
        return LayerCost(run, again, dict.fromkeys(RECOMPUTE, kept), kept, kept, 2.0 * self.model.hidden, "norm")

    def head(self) -> LayerCost:
        """The output projection and the loss. Kept per micro-batch: its input and the fp32 log-probabilities the
        loss saves; its output, the logits, is the recipes' stage output, which torch's stage holds until its
        backward (Megatron's head ends in the loss: no output held)."""
        m, s = self.model, self.stack
        run = head_compute(self.kernels, m, s, self.b, self.tp)
        vocab = m.vocab / self.tp if s.vocab_parallel else m.vocab
        if s.vocab_parallel and self.tp > 1:
            run = run + Phases(0.0, self._tp_all_reduce(), 0.0)  # the input gradient, summed over vocabulary shards
        tokens = self.b * m.seq
        kept = self._hidden_bytes() + tokens * vocab * 4.0
        logits = 0.0 if s.vocab_parallel else tokens * vocab * self.cluster.act_bytes
        again = {"none": 0.0, "selective": 0.0, "full": run.f if s.recompute_all_layers else 0.0}
        return LayerCost(run, again, dict.fromkeys(RECOMPUTE, kept), kept + logits, logits, vocab * m.hidden, "head")
