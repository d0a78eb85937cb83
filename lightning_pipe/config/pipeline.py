"""Typed settings of the pipeline strategy, validated early with errors that name the setting to change.

Every check here runs on plain data, on every rank, before any process group traffic: a rank that raises
while its peers wait in a P2P receive would hang the job, so the rules live where all ranks see the same inputs.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_pipe.config.settings import config_error

PartitionSpec = str | Sequence[int]
PARTITION_METHODS = ("uniform", "parameters", "time", "memory")
MEASURED_PARTITIONS = ("time", "memory")
"""Partitions the strategy measures at setup (the planner's profile), then replaces by per-stage layer counts."""


@dataclass(frozen=True)
class PipelineConfig:
    """What a user chooses. Field docstrings are the contract; :data:`SETTINGS` says where each one is changed."""

    schedule: str = "1f1b"
    """Schedule name (see :func:`lightning_pipe.schedules.available_schedules`)."""
    microbatches: int | None = None
    """Micro-batches per batch. ``None``: twice the number of stages (``custom``: read from the action lists)."""
    data_parallel_size: int = 1
    """Replicas of the whole pipeline; pipeline size = world size / (data_parallel_size x fsdp_size x
    tensor_parallel_size)."""
    fsdp_size: int = 1
    """Ranks each stage is sharded over with FSDP2 (``fully_shard``); 1: no FSDP. They read different data, like
    replicas (docs/parallelism.md)."""
    fsdp_reshard_after_forward: bool = False
    """FSDP: free the gathered parameters after each micro-batch's forward (gather again for its backward): less
    memory, one more all-gather per micro-batch. Default: keep them gathered until the batch's gradients are reduced."""
    tensor_parallel_size: int = 1
    """Ranks each layer is split over with tensor parallelism (the module's ``parallelize_layer`` hook, DTensor
    ``parallelize_module``); 1: none. They read the same data (docs/parallelism.md)."""
    expert_parallel_size: int = 1
    """Ranks of a stage's data-parallel replicas each MoE layer's experts (``RoutedExperts``) are sharded over,
    tokens exchanged with ``all_to_all``; must divide the data-parallel size and every expert count. 1: every rank
    holds every expert (docs/moe.md)."""
    partition: PartitionSpec = "uniform"
    """How layers go to stages: ``"uniform"`` (equal counts), ``"parameters"`` (balanced parameter counts: a
    trainable parameter counts 4, a frozen one 1, as their weight, gradient and AdamW state weigh), ``"time"`` /
    ``"memory"`` (measured at setup: the split of the chosen schedule with the fastest predicted step /
    the smallest predicted peak memory, docs/planner.md), or explicit per-stage layer counts such as ``[3, 5]``."""
    stages_per_rank: int | None = None
    """Stages each rank holds. ``None``: the schedule's default (1 for ``gpipe`` / ``1f1b``; 2 for
    ``interleaved_1f1b``, ``looped_bfs``, ``zb_h1``, ``zbv``, ``dualpipev``, ``v_half``, ``v_min``; ``custom``: read from
    the lists)."""
    layers_attr: str = "layers"
    """Attribute of the LightningModule that holds the ordered layer list."""
    recompute: str | int = "none"
    """Activation recomputation per stage: ``"none"``, ``"all"`` (every layer) or ``k`` (every k-th layer)."""
    offload: str | int | bool | Sequence[int] = "none"
    """Keep chosen layers' saved activations in (pinned) host memory between forward and backward, copied back for
    the backward: ``"none"``, ``"all"`` / ``true``, ``k`` (every k-th layer of each stage, as ``recompute``) or a
    list of layer indices such as ``[1, 3]``. With ``recompute`` on the same layer, its kept inputs go to the host.
    On a CPU device nothing moves (docs/parallelism.md: "Recompute or offload")."""
    compile: bool | dict[str, Any] = False
    """``torch.compile`` each layer of this rank's stages (regional compilation, parameter names unchanged):
    ``false``, ``true``, or a dict of ``torch.compile`` options such as ``{"mode": "max-autotune"}``. Layers the user
    compiled are kept as they are. With gpipe, 1f1b, interleaved_1f1b, looped_bfs and custom F/B lists; not with
    split-backward schedules, FSDP, tensor parallelism or rebalancing (docs/parallelism.md: "Compiled layers")."""
    schedule_options: dict[str, Any] = field(default_factory=dict)
    """Options of the chosen schedule (e.g. the ``custom`` schedule's ``actions`` or ``csv``); an entry set to
    ``None`` counts as absent. A schedule refuses any option it does not take."""
    rebalance_every_n_steps: int | None = None
    """Every N optimizer steps, move layers between ranks when measured times predict a faster split
    (``lightning_pipe.rebalance``); ``None``: never. The configured partition is the starting split."""
    rebalance_threshold: float = 0.05
    """Rebalance only when the predicted busiest-stage time drops by more than this fraction."""

    def __post_init__(self) -> None:
        # Normalise before validating: Hydra hands lists as ListConfig and names in any case.
        object.__setattr__(self, "schedule", str(self.schedule).lower())
        object.__setattr__(self, "partition", check_partition(self.partition))
        object.__setattr__(self, "schedule_options", _options(self.schedule_options))
        object.__setattr__(self, "offload", _offload(self.offload))
        object.__setattr__(self, "compile", _compile(self.compile))
        self._validate_plain()

    def _validate_plain(self) -> None:
        if self.microbatches is not None and (not _is_int(self.microbatches) or self.microbatches < 1):
            raise config_error("The number of micro-batches must be a positive integer.",
                               f"microbatches={self.microbatches!r}", "microbatches")
        if not _is_int(self.data_parallel_size) or self.data_parallel_size < 1:
            raise config_error("The data-parallel size must be a positive integer.",
                               f"data_parallel_size={self.data_parallel_size!r}", "data_parallel_size")
        if not _is_int(self.fsdp_size) or self.fsdp_size < 1:
            raise config_error("The FSDP size (ranks each stage is sharded over) must be a positive integer.",
                               f"fsdp_size={self.fsdp_size!r}", "fsdp_size")
        if not _is_int(self.tensor_parallel_size) or self.tensor_parallel_size < 1:
            raise config_error("The tensor-parallel size (ranks each layer is split over) must be a positive integer.",
                               f"tensor_parallel_size={self.tensor_parallel_size!r}", "tensor_parallel_size")
        if not _is_int(self.expert_parallel_size) or self.expert_parallel_size < 1:
            raise config_error("The expert-parallel size (ranks each MoE layer's experts are sharded over) must be a "
                               "positive integer.", f"expert_parallel_size={self.expert_parallel_size!r}",
                               "expert_parallel_size")
        if self.expert_parallel_size > 1 and self.rebalance_every_n_steps is not None:
            raise config_error("Rebalancing moves layers between ranks; layers with sharded experts cannot move yet.",
                               f"expert_parallel_size={self.expert_parallel_size}, rebalance_every_n_steps="
                               f"{self.rebalance_every_n_steps}", "expert_parallel_size",
                               also=("rebalance_every_n_steps",))
        if not isinstance(self.fsdp_reshard_after_forward, bool):
            raise config_error("fsdp_reshard_after_forward is true or false.",
                               f"fsdp_reshard_after_forward={self.fsdp_reshard_after_forward!r}",
                               "fsdp_reshard_after_forward")
        if self.stages_per_rank is not None and (not _is_int(self.stages_per_rank) or self.stages_per_rank < 1):
            raise config_error("stages_per_rank must be a positive integer or None.",
                               f"stages_per_rank={self.stages_per_rank!r}", "stages_per_rank")
        if self.rebalance_every_n_steps is not None and (
                not _is_int(self.rebalance_every_n_steps) or self.rebalance_every_n_steps < 1):
            raise config_error("rebalance_every_n_steps is a positive number of optimizer steps, or None (never).",
                               f"rebalance_every_n_steps={self.rebalance_every_n_steps!r}", "rebalance_every_n_steps")
        if (not isinstance(self.rebalance_threshold, numbers.Real) or isinstance(self.rebalance_threshold, bool)
                or not 0 <= self.rebalance_threshold < 1):
            raise config_error("rebalance_threshold is the predicted relative gain a rebalance needs, in [0, 1).",
                               f"rebalance_threshold={self.rebalance_threshold!r}", "rebalance_threshold")
        if self.compile is not False:
            others = {"fsdp_size": self.fsdp_size, "tensor_parallel_size": self.tensor_parallel_size,
                      "expert_parallel_size": self.expert_parallel_size,
                      "rebalance_every_n_steps": self.rebalance_every_n_steps}
            # sizes are off at 1; rebalancing is off only at None (every step is a real setting)
            clash = [k for k, v in others.items() if v is not None and (k == "rebalance_every_n_steps" or v != 1)]
            if clash:
                raise config_error(
                    "Compiled layers run with data and pipeline parallelism only for now: FSDP's and tensor "
                    "parallelism's hooks and DTensor parameters, expert parallelism's all_to_all dispatch, and "
                    "rebalancing's per-layer timing hooks are untested inside compiled regions.",
                    f"compile={self.compile!r} with " + ", ".join(f"{k}={others[k]!r}" for k in clash), "compile",
                    also=tuple(clash))
        if self.recompute_every is None and str(self.recompute).lower() != "none":
            raise config_error("recompute is 'none', 'all', or a positive k (every k-th layer of each stage).",
                               f"recompute={self.recompute!r}", "recompute")

    @property
    def offload_layers(self) -> LayerChoice:
        """The layers whose saved activations go to host memory."""
        value = self.offload  # normalised by _offload: "none", "all", a positive int or a tuple of indices
        if isinstance(value, tuple):
            return LayerChoice(indices=frozenset(value))
        if isinstance(value, int) and not isinstance(value, bool):
            return LayerChoice(every=value)
        return LayerChoice(every=1) if value == "all" else LayerChoice()

    @property
    def compile_options(self) -> dict[str, Any] | None:
        """The ``torch.compile`` keyword arguments for each layer, or ``None`` when nothing is compiled."""
        return None if self.compile is False else dict(self.compile) if isinstance(self.compile, Mapping) else {}

    @property
    def recompute_layers(self) -> LayerChoice:
        """The layers recomputed in backward (:attr:`recompute_every` as a :class:`LayerChoice`)."""
        return LayerChoice(every=self.recompute_every)

    @property
    def recompute_every(self) -> int | None:
        """Recompute every k-th layer of a stage (1 = all); None = keep all activations."""
        value = str(self.recompute).lower()
        if value == "all":
            return 1
        if value.isdigit() and int(value) >= 1:
            return int(value)
        return None


@dataclass(frozen=True)
class LayerChoice:
    """The layers a per-layer setting (``recompute``, ``offload``) picks: every k-th of each stage, counted from the
    stage's first layer (``every=1``: all), and/or these indices of the full layer list, wherever they land."""

    every: int | None = None
    indices: frozenset[int] = frozenset()

    def picks(self, position: int, index: int) -> bool:
        """Whether the layer at ``position`` in its stage, ``index`` in the full list, is chosen."""
        return (self.every is not None and position % self.every == 0) or index in self.indices

    def __bool__(self) -> bool:
        return self.every is not None or bool(self.indices)


def _offload(value: Any) -> str | int | tuple[int, ...]:
    """``"none"`` / ``"all"`` / a positive k / a tuple of layer indices; anything else is refused."""
    rule = ("offload is 'none', 'all' (or true), a positive k (every k-th layer of each stage) or a list of layer "
            "indices, e.g. [1, 3].")
    if value is None or value is False:
        return "none"
    if value is True:
        return "all"
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("none", "false"):
            return "none"
        if text in ("all", "true"):
            return "all"
        if text.isdigit() and int(text) >= 1:
            return int(text)
        raise config_error(rule, f"offload={value!r}", "offload")
    if _is_int(value):
        if value < 1:
            raise config_error(rule, f"offload={value!r}", "offload")
        return int(value)
    if not isinstance(value, Sequence):
        raise config_error(rule, f"offload={value!r}", "offload")
    bad = [i for i in value if not _is_int(i) or i < 0]
    if bad:
        raise config_error(rule, f"offload={list(value)!r} (not a layer index: {bad!r})", "offload")
    return tuple(sorted({int(i) for i in value})) or "none"


COMPILE_KEYS = ("fullgraph", "dynamic", "backend", "mode", "options", "disable")
"""The ``torch.compile`` keyword arguments ``compile={...}`` may set."""


def _compile(value: Any) -> bool | dict[str, Any]:
    """``False`` / ``True`` / a plain dict of ``torch.compile`` keyword arguments; anything else is refused."""
    rule = f"compile is false, true, or a dict of torch.compile options with keys from {list(COMPILE_KEYS)}."
    if value is None or value is False or (isinstance(value, str) and value.strip().lower() in ("false", "none")):
        return False
    if value is True or (isinstance(value, str) and value.strip().lower() == "true"):
        return True
    if not isinstance(value, Mapping):
        raise config_error(rule, f"compile={value!r}", "compile")
    options = {str(k): dict(v) if isinstance(v, Mapping) else v for k, v in value.items()}  # Hydra: DictConfig
    unknown = sorted(set(options) - set(COMPILE_KEYS))
    if unknown:
        raise config_error(rule, f"compile={options!r} (unknown: {unknown})", "compile")
    kinds = {"fullgraph": (bool,), "disable": (bool,), "dynamic": (bool, type(None)), "mode": (str, type(None)),
             "options": (dict, type(None))}
    wrong = [f"{k}={v!r}" for k, v in options.items() if k in kinds and not isinstance(v, kinds[k])]
    if "backend" in options and not (isinstance(options["backend"], str) or callable(options["backend"])):
        wrong.append(f"backend={options['backend']!r}")
    if wrong:
        raise config_error("compile's options have torch.compile's types: fullgraph and disable true/false, dynamic "
                           "true/false/null, mode a name, options a dict, backend a name or a callable.",
                           f"compile={options!r} ({', '.join(wrong)})", "compile")
    if options.get("mode") is not None and options.get("options"):
        raise config_error("torch.compile takes `mode` or `options`, not both.", f"compile={options!r}", "compile")
    return options


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_partition(value: Any) -> PartitionSpec:
    """``"uniform"`` / ``"parameters"`` / ``"time"`` / ``"memory"``, or a tuple of positive per-stage layer counts;
    anything else is refused."""
    rule = (f"partition is one of {list(PARTITION_METHODS)} or a list of positive per-stage layer counts, "
            "e.g. [3, 4].")
    if isinstance(value, str):
        if value.lower() not in PARTITION_METHODS:
            raise config_error(rule, f"partition={value!r}", "partition")
        return value.lower()
    # A bare number (`strategy.partition=3`) is not a list of counts: say so rather than fail iterating it.
    if not isinstance(value, Sequence) or not value:
        raise config_error(rule, f"partition={value!r}", "partition")
    bad = [n for n in value if not _is_int(n) or n < 1]
    if bad:
        raise config_error(rule, f"partition={list(value)!r} (not a positive integer: {bad!r})", "partition")
    return tuple(int(n) for n in value)


def _options(value: Any) -> dict[str, Any]:
    """A plain dict without ``None`` entries (Hydra configs ship ``csv: null`` next to ``actions``)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise config_error("schedule_options is a mapping of option name to value, e.g. {'csv': 'my.csv'}.",
                           f"schedule_options={value!r}", "schedule_options")
    return {str(k): v for k, v in value.items() if v is not None}
