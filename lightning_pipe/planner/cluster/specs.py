"""What the cluster planner reads: the model (its shape), the cluster (its GPUs and links) and the software stack that
runs the model on it (how attention, the head, gradients and the optimizer are implemented).

Model files: a JSON of ``layers``, ``hidden``, ``heads``, ``seq``, ``vocab`` (optional ``kv_heads``, ``ffn``,
``activation``, ``tied_embeddings``), a transformers ``config.json``, or a bundled model config
(``configs/model/*.yaml``): :func:`~lightning_pipe.planner.cluster.sources.load_model`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lightning_pipe.config import PipelineConfigError


class SpecError(PipelineConfigError):
    """A model, cluster, stack or layout description breaks a rule (the message names the key and the value)."""


def spec_error(rule: str, seen: str, change: str) -> SpecError:
    return SpecError(f"{rule} Got {seen}. Change {change}.")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer: ``layers`` blocks of width ``hidden`` over ``seq`` tokens, a ``vocab``-row
    embedding and head. Its layer list is the recipes' one: embedding, the blocks, the final norm, the head."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0: ``heads``."""
    ffn: int = 0
    """MLP width; 0: 4 x ``hidden``."""
    activation: str = "gelu"
    """``gelu`` (two matrices) or ``swiglu`` (three: gate, up, down)."""
    tied_embeddings: bool = True
    bias: bool | None = None
    """Biases in the blocks' linear layers; ``None``: with GELU (GPT), not with SwiGLU (Llama)."""
    name: str = "model"
    source: str = ""
    """Where it was read from (a bundled config's name lets ``--emit-config`` reuse it)."""

    def __post_init__(self) -> None:
        for key in ("layers", "hidden", "heads", "seq", "vocab"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise spec_error("A model's layers, hidden, heads, seq and vocab are positive integers.",
                                 f"{key}={value!r}", f"`{key}` in the model file")
        object.__setattr__(self, "kv_heads", self.kv_heads or self.heads)
        object.__setattr__(self, "ffn", self.ffn or 4 * self.hidden)
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise spec_error("hidden must divide by heads, and heads by kv_heads.",
                             f"hidden={self.hidden}, heads={self.heads}, kv_heads={self.kv_heads}",
                             "`hidden`, `heads` or `kv_heads` in the model file")
        if self.activation not in ("gelu", "swiglu"):
            raise spec_error("activation is 'gelu' or 'swiglu'.", f"activation={self.activation!r}",
                             "`activation` in the model file")
        if self.bias is None:
            object.__setattr__(self, "bias", self.activation == "gelu")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        """Width of the keys (and of the values): kv_heads x head_dim."""
        return self.kv_heads * self.head_dim

    @property
    def block_params(self) -> int:
        """Weights of one block: its matrices, two norms (weight and bias) and, with ``bias``, the linear layers'
        biases."""
        h = self.hidden
        attention = h * (h + 2 * self.kv_dim) + h * h
        up = (2 if self.activation == "swiglu" else 1) * self.ffn
        mlp = (up + self.ffn) * h
        biases = (h + 2 * self.kv_dim) + h + up + h if self.bias else 0
        return attention + mlp + 4 * h + biases

    @property
    def params(self) -> int:
        """Every parameter, a tied embedding counted once."""
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * self.block_params + embeddings + 2 * self.hidden


@dataclass(frozen=True)
class ClusterSpec:
    """GPUs and links. Bandwidths are GB/s per GPU in one direction: ``nvlink_gbps`` between two GPUs of one node,
    ``network_gbps`` across nodes (a node with one NIC per GPU gives each GPU its NIC's rate)."""

    gpus: int
    gpus_per_node: int
    peak_tflops: float
    """Dense TFLOP/s of one GPU at the training precision."""
    memory_gib: float
    nvlink_gbps: float
    network_gbps: float
    hbm_gbps: float = 0.0
    """Device memory bandwidth, GB/s; 0: ``peak_tflops`` x 6.5 (an A100's ratio of bandwidth to fp16 peak)."""
    network_latency_us: float = 5.0
    """One message across nodes (InfiniBand: 1-5 us; Ethernet with RoCE about 5-10 us)."""
    nvlink_latency_us: float = 2.0
    kernel_us: float = 4.0
    """Fixed cost of one kernel (launch and tail), the floor of every small operation."""
    precision: str = "bf16"
    """Training precision: ``bf16`` / ``fp16`` (mixed, 2-byte activations) or ``fp32``."""
    accelerator: str = "gpu"
    """``gpu``, or ``cpu`` for a machine of CPU ranks (each "GPU" is a process; ``--emit-config`` trains on CPU)."""
    name: str = "cluster"
    notes: str = ""

    def __post_init__(self) -> None:
        for key in ("gpus", "gpus_per_node"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise spec_error("gpus and gpus_per_node are positive integers.", f"{key}={value!r}",
                                 f"`{key}` in the cluster file")
        for key in ("peak_tflops", "memory_gib", "nvlink_gbps", "network_gbps"):
            if not isinstance(getattr(self, key), (int, float)) or getattr(self, key) <= 0:
                raise spec_error("A cluster's peak, memory and link rates are positive numbers.",
                                 f"{key}={getattr(self, key)!r}", f"`{key}` in the cluster file")
        if self.gpus % self.gpus_per_node and self.gpus > self.gpus_per_node:
            raise spec_error("A cluster is whole nodes: gpus is a multiple of gpus_per_node.",
                             f"gpus={self.gpus}, gpus_per_node={self.gpus_per_node}", "`gpus` in the cluster file")
        if self.accelerator not in ("gpu", "cpu"):
            raise spec_error("accelerator is 'gpu' or 'cpu'.", f"accelerator={self.accelerator!r}",
                             "`accelerator` in the cluster file")
        if self.precision not in ("bf16", "fp16", "fp32"):
            raise spec_error("precision is 'bf16', 'fp16' or 'fp32'.", f"precision={self.precision!r}",
                             "`precision` in the cluster file")

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    @property
    def hbm(self) -> float:
        """Device memory bandwidth in bytes/s."""
        return (self.hbm_gbps or self.peak_tflops * 6.5) * 1e9

    @property
    def act_bytes(self) -> int:
        """Bytes of one activation element."""
        return 4 if self.precision == "fp32" else 2

    def with_gpus(self, gpus: int) -> ClusterSpec:
        return dataclasses.replace(self, gpus=gpus)


@dataclass(frozen=True)
class Stack:
    """How the software runs the model: what the costs and the memory follow besides the shapes.

    ``lightning_pipe`` (the default) is this library's GPT / Llama recipes under ``PipelineStrategy`` with
    Lightning's mixed precision; ``megatron_sc21`` is Megatron-LM as it ran the SC'21 paper's Table 1
    (:data:`~lightning_pipe.planner.cluster.presets.STACKS`)."""

    name: str = "lightning_pipe"
    attention: str = "flash"
    """``flash``: scores never stored (SDPA / FlashAttention, causal blocks skipped); ``materialized``: scores written
    to memory, softmax and dropout over them (Megatron 2021)."""
    vocab_parallel: bool = False
    """The embedding and head split over the tensor ranks (Megatron); the recipes keep them whole on every rank."""
    dropout: bool = False
    """Dropout layers run (their masks kept for backward)."""
    sequence_parallel: bool = False
    """Norms and dropout split over the tensor ranks, all-gather / reduce-scatter instead of all-reduce."""
    state_bytes: float = 16
    """Bytes per parameter of weights, gradients and optimizer state without ZeRO: fp32 weights and gradients and
    Adam's two fp32 moments under Lightning's mixed precision (4 + 4 + 8); Megatron's fp16 optimizer 20 (fp16
    weights and gradients, fp32 master weights, moments and gradient copy)."""
    zero_full_bytes: float = 6
    """With ZeRO-1 (``zero=1``), the bytes per parameter every replica still holds in full: the 2-byte compute copy
    of the weights and the accumulated gradients (FSDP without resharding: bf16 weights, fp32 gradients)."""
    zero_sharded_bytes: float = 16
    """With ZeRO-1, the bytes per parameter split over the replicas: fp32 weights, gradient shard and moments."""
    gather_bytes: int = 2
    """Bytes per weight the ZeRO-1 all-gather sends (the 2-byte compute copy)."""
    optimizer_pass_bytes: int = 32
    """Bytes the optimizer step reads and writes per parameter it updates (fused Adam: weights, gradient, moments)."""
    reduce_bytes: int = 4
    """Bytes per gradient element the data-parallel reduction sends (fp32 under Lightning's mixed precision)."""
    dp_overlap: bool = True
    """The data-parallel gradient reduction runs during each stage's last backward; otherwise after the schedule."""
    dp_overlap_with_tp: bool = False
    """... also under tensor parallelism (the strategy reduces after the schedule there; Megatron-Core overlaps)."""
    rank_order: str = "tp,pp,dp"
    """Mesh dimensions from innermost (consecutive ranks, one node) out, without ZeRO."""
    zero_rank_order: str = "tp,dp,pp"
    """The same with ``zero=1`` (the strategy's FSDP shards sit inside the pipeline dimension)."""
    recv_buffers: str = "per_microbatch"
    """``per_microbatch``: a stage allocates a receive buffer for every micro-batch's input and gradient at setup
    (torch 2.11-2.14's ``PipelineStage``); ``in_flight``: one per transfer as it happens (torch 2.15, Megatron)."""
    blocking_p2p: bool = False
    """A rank waits for its own sends to complete before computing on (Megatron 2021: every transfer is waited on,
    then the device synchronised); torch's schedules post sends and go on."""
    pp_scatter_gather: bool = False
    """Across nodes each tensor rank sends 1/tp of a stage's output and the receivers all-gather it (Megatron)."""
    recompute_modes: tuple[str, ...] = ("none", "full")
    recompute_all_layers: bool = True
    """A full recompute re-runs every layer of a stage, embedding and head too (``PipelineStrategy(recompute="all")``);
    otherwise only the blocks (Megatron)."""
    """What the stack can recompute: ``full`` (whole layers), ``selective`` (the attention core)."""
    zero_modes: tuple[int, ...] = (0, 1)
    zero_tied_on_one_rank: bool = False
    """ZeRO-1 with tied embeddings whose two ends sit on one rank (V schedules); the strategy's FSDP refuses it."""
    schedules: tuple[str, ...] = ("1f1b", "gpipe", "interleaved_1f1b", "looped_bfs", "zb_h1", "zbv", "dualpipev")
    """The schedules a search tries (``v_half`` / ``v_min`` build their orders by simulating candidates, seconds at
    this scale: give them in ``--layout`` to predict them)."""
    splits: tuple[str, ...] = ("balanced",)
    """How a search cuts the layers: ``balanced`` by predicted time, ``uniform`` blocks (Megatron's only way)."""

    def param_state_bytes(self, zero: int, dp: int) -> float:
        """Bytes per parameter for weights, gradients and optimizer state on one GPU of ``dp`` replicas."""
        if zero >= 1:
            return self.zero_full_bytes + self.zero_sharded_bytes / dp
        return self.state_bytes


def from_mapping(cls: Any, data: dict[str, Any], what: str) -> Any:
    """``cls(**data)`` with unknown keys refused by name (a typo must not pass silently)."""
    names = {f.name for f in dataclasses.fields(cls)}
    # notes for people ("sources", "_comment") are allowed beside the keys
    data = {k: v for k, v in data.items() if k != "sources" and not k.startswith("_")}
    unknown = sorted(set(data) - names)
    if unknown:
        raise spec_error(f"A {what} file takes the keys {sorted(names)}.", f"unknown keys {unknown}",
                         f"those keys in the {what} file")
    missing = [f.name for f in dataclasses.fields(cls)
               if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in data]
    if missing:
        raise spec_error(f"A {what} file needs the keys {missing}.", f"the keys {sorted(data)}", f"the {what} file")
    return cls(**data)
