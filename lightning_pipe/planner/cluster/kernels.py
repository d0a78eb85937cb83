"""Seconds of the kernels of one layer on one GPU: GEMMs from their FLOPs and shape, the rest from the bytes it moves.

[Note: the analytic cost of a kernel]
A GEMM ``[M, K] x [K, N]`` does ``2 M N K`` FLOPs at ``peak x gemm x s(M) s(N) s(K)``, ``s(d) = d / (d + gemm_half)``:
a dimension much larger than the GPU's tiles runs at the large-GEMM efficiency, a small one (a head dimension of 64,
a micro-batch of a few tokens) wastes part of every tile and of the pipeline that feeds it. It can never beat
streaming its operands once (``bytes / (hbm x memory)``): the slower of the two bounds is its time (a roofline).
Everything else a layer runs (norms, activations, residual adds, dropout, softmax over materialised scores, casts
for the loss) is bandwidth-bound: its bytes read and written / (``hbm x memory``). Every kernel costs at least
``kernel_us`` (launch and tail). The element counts per token below follow the operations the recipes' blocks and
Megatron's run, written out in :func:`elementwise_elements`; none is fitted.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_pipe.planner.cluster.specs import ClusterSpec, ModelSpec, Stack


@dataclass(frozen=True)
class Efficiency:
    """The calibrated constants, the same for every model, cluster and layout (docs/planner.md, "Planning a cluster").

    Fitted once on Megatron-LM's SC'21 Table 1 (A100); each is a property of a kind of kernel or link, not of a run."""

    gemm: float = 0.70
    """Fraction of the dense peak a large GEMM reaches in a training job (cuBLAS on an A100 at its sustained,
    power-capped clock)."""
    gemm_half: float = 40.0
    """The GEMM dimension at which that fraction halves (tile and pipeline fill)."""
    memory: float = 0.80
    """Fraction of device memory bandwidth a bandwidth-bound kernel streams."""
    link: float = 0.80
    """Fraction of a link's bandwidth a collective or a send achieves (NCCL's bus bandwidth over the link rate:
    about 240 of NVSwitch's 300 GB/s, 20 of HDR's 25)."""


GPU_EFFICIENCY = Efficiency()


@dataclass(frozen=True)
class Kernels:
    """Prices kernels on one GPU of ``cluster`` with ``eff``."""

    cluster: ClusterSpec
    eff: Efficiency = GPU_EFFICIENCY

    @property
    def kernel_s(self) -> float:
        return self.cluster.kernel_us * 1e-6

    def gemm(self, m: float, n: float, k: float, batch: float = 1.0) -> float:
        """Seconds of ``batch`` GEMMs ``[m, k] x [k, n]``."""
        half = self.eff.gemm_half
        shape = (m / (m + half)) * (n / (n + half)) * (k / (k + half))
        compute = 2.0 * m * n * k * batch / (self.cluster.peak_tflops * 1e12 * self.eff.gemm * shape)
        stream = (m * k + k * n + m * n) * batch * self.cluster.act_bytes / (self.cluster.hbm * self.eff.memory)
        return max(compute, stream) + self.kernel_s

    def gemm_fwd_bwd(self, m: float, n: float, k: float, batch: float = 1.0) -> tuple[float, float, float]:
        """(forward, input gradient, weight gradient) of a linear layer ``[m, k] x [k, n]``."""
        return self.gemm(m, n, k, batch), self.gemm(m, k, n, batch), self.gemm(k, n, m, batch)

    def stream(self, nbytes: float, kernels: int = 1) -> float:
        """Seconds of bandwidth-bound kernels moving ``nbytes`` in all."""
        return nbytes / (self.cluster.hbm * self.eff.memory) + kernels * self.kernel_s


@dataclass(frozen=True)
class Phases:
    """Seconds of a piece of work by the schedule action it falls in: forward, input gradient, weight gradient."""

    f: float = 0.0
    i: float = 0.0
    w: float = 0.0

    def __add__(self, other: Phases) -> Phases:
        return Phases(self.f + other.f, self.i + other.i, self.w + other.w)


def elementwise_elements(model: ModelSpec, stack: Stack, tp: int) -> tuple[float, float, int, int]:
    """Elements read + written per token by a block's bandwidth-bound kernels: (forward, backward, forward kernels,
    backward kernels). Forward: two norms (read h, write h), two residual adds with their bias / dropout (read 2h,
    write h), the activation (GELU: read and write ffn; SwiGLU: read 2 ffn, write ffn), the attention output's
    layout copy (read and write h). Backward: norms read x and dy and write dx (3h each), residual branches read dy
    and write dx then accumulate (5h each), the activation (GELU 3 ffn, SwiGLU 5 ffn), the layout copy (2h).
    Norms, adds and dropout are whole on every tensor rank unless sequence-parallel; the rest is split."""
    h, ffn = model.hidden, model.ffn
    whole = 1.0 if not stack.sequence_parallel else 1.0 / tp
    act_f, act_b = (2, 3) if model.activation == "gelu" else (3, 5)
    forward = whole * 10 * h + (2 * h + act_f * ffn) / tp
    backward = whole * 16 * h + (2 * h + act_b * ffn) / tp
    return forward, backward, 7, 9


def block_gemms(k: Kernels, model: ModelSpec, tokens: float, tp: int) -> Phases:
    """The block's four (SwiGLU: five) weight GEMMs, split over ``tp`` ranks Megatron-style."""
    h, kv, ffn = model.hidden, model.kv_dim, model.ffn
    up = 2 * ffn if model.activation == "swiglu" else ffn
    shapes = [(tokens, (h + 2 * kv) / tp, h), (tokens, h, h / tp), (tokens, up / tp, h), (tokens, h, ffn / tp)]
    total = Phases()
    for m, n, kk in shapes:
        f, i, w = k.gemm_fwd_bwd(m, n, kk)
        total = total + Phases(f, i, w)
    return total


def attention_core(k: Kernels, model: ModelSpec, stack: Stack, b: float, tp: int) -> Phases:
    """Scores, softmax and the weighted sum for ``b`` sequences of this rank's ``heads / tp`` heads.

    Materialised (Megatron 2021): two batched GEMMs forward over the full s x s scores (the causal half is masked,
    not skipped), four backward; softmax and dropout stream the scores (forward: softmax reads and writes them,
    dropout reads them and writes them and a 1-byte mask; backward the same in reverse, softmax reading its output
    too). Flash (SDPA, FlashAttention): scores stay on chip, the causal half is skipped; the backward recomputes
    the scores, five GEMM-sized products against the forward's two."""
    s, d = model.seq, model.head_dim
    batch = b * model.heads / tp
    if stack.attention == "flash":
        half = 0.5 * batch  # causal: half of the score blocks
        fwd = 2 * (k.gemm(s, s, d, half) - k.kernel_s) + k.kernel_s
        return Phases(fwd, 2.5 * (fwd - k.kernel_s) + k.kernel_s, 0.0)
    a = k.cluster.act_bytes
    scores = batch * s * s
    mask = 1.0 if stack.dropout else 0.0
    fwd = k.gemm(s, s, d, batch) + k.gemm(s, d, s, batch)
    fwd += k.stream(scores * 2 * a, 1) + (k.stream(scores * (2 * a + mask), 1) if stack.dropout else 0.0)
    bwd = k.gemm(s, s, d, batch) + 3 * k.gemm(s, d, s, batch)
    bwd += k.stream(scores * 3 * a, 1) + (k.stream(scores * (2 * a + mask), 1) if stack.dropout else 0.0)
    return Phases(fwd, bwd, 0.0)


def block_compute(k: Kernels, model: ModelSpec, stack: Stack, b: float, tp: int) -> tuple[Phases, Phases]:
    """(the whole block, its attention core alone) for a micro-batch of ``b`` sequences, tensor comm excluded."""
    tokens = b * model.seq
    core = attention_core(k, model, stack, b, tp)
    fwd_el, bwd_el, n_f, n_b = elementwise_elements(model, stack, tp)
    a = k.cluster.act_bytes
    masks = (2 * model.hidden * tokens * (1 if not stack.sequence_parallel else 1 / tp)) if stack.dropout else 0.0
    elementwise = Phases(k.stream(fwd_el * tokens * a + masks, n_f), k.stream(bwd_el * tokens * a + masks, n_b), 0.0)
    return block_gemms(k, model, tokens, tp) + core + elementwise, core


def embedding_compute(k: Kernels, model: ModelSpec, stack: Stack, b: float, tp: int) -> Phases:
    """Token (and position) lookup forward; backward a dense gradient of the table (written, then accumulated)."""
    tokens, a = b * model.seq, k.cluster.act_bytes
    rows = model.vocab / tp if stack.vocab_parallel else model.vocab
    fwd = k.stream(3 * tokens * model.hidden * a, 2)
    grad = k.stream(2 * tokens * model.hidden * a + rows * model.hidden * (a + 8), 3)
    return Phases(fwd, 0.0, grad)


def head_compute(k: Kernels, model: ModelSpec, stack: Stack, b: float, tp: int) -> Phases:
    """The output projection to the vocabulary and the cross-entropy over its logits (kept in fp32 for the loss:
    forward casts up, finds the maximum and the sum and writes log-probabilities, about act + 16 bytes per logit;
    backward act + 12)."""
    tokens = b * model.seq
    vocab = model.vocab / tp if stack.vocab_parallel else model.vocab
    f, i, w = k.gemm_fwd_bwd(tokens, vocab, model.hidden)
    logits, a = tokens * vocab, k.cluster.act_bytes
    return Phases(f + k.stream(logits * (a + 16), 4), i + k.stream(logits * (a + 12), 3), w)


def norm_compute(k: Kernels, model: ModelSpec, b: float) -> Phases:
    """The final norm, whole on every tensor rank."""
    elements = b * model.seq * model.hidden * k.cluster.act_bytes
    return Phases(k.stream(2 * elements, 1), k.stream(3 * elements, 1), 0.0)
