"""Typed settings of the pipeline strategy, validated early with errors that name the setting to change.

Every check here runs on plain data, on every rank, before any process group traffic: a rank that raises
while its peers wait in a P2P receive would hang the job, so the rules live where all ranks see the same inputs.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

PartitionSpec = str | Sequence[int]
PARTITION_METHODS = ("uniform", "parameters", "time", "memory")
MEASURED_PARTITIONS = ("time", "memory")
"""Partitions the strategy measures at setup (the planner's profile), then replaces by per-stage layer counts."""


class PipelineConfigError(ValueError):
    """A setting (or a setting against the model / world) breaks a rule of the pipeline."""


@dataclass(frozen=True)
class Setting:
    """Where a user changes one setting: in Python, and at its path in the shipped Hydra configs (``configs/``)."""

    name: str
    python: str
    """How it is passed in Python, e.g. ``PipelineStrategy(microbatches=...)``."""
    hydra: tuple[str, ...]
    """Its Hydra override(s), e.g. ``("schedule.microbatches",)``; ``schedule=<name>`` for a config group."""
    doc: str = ""
    """What it means, for a setting that is not a :class:`PipelineConfig` field (whose docstring says it)."""

    def describe(self) -> str:
        return f"`{self.name}` ({self.python}; Hydra: {' / '.join(self.hydra)})"


def _strategy(name: str, hydra: str, doc: str = "") -> Setting:
    return Setting(name, f"PipelineStrategy({name}=...)", (hydra,), doc)


# The one table of setting names. Every error names its setting through it, and tests/unit/test_configs.py
# composes the shipped configs with an override of every Hydra path here, so no message can send a user to a key
# Hydra refuses.
SETTINGS: dict[str, Setting] = {s.name: s for s in (
    _strategy("schedule", "schedule=<name>"),
    _strategy("microbatches", "schedule.microbatches"),
    _strategy("stages_per_rank", "schedule.stages_per_rank"),
    _strategy("schedule_options", "schedule.options"),
    _strategy("data_parallel_size", "strategy.data_parallel_size"),
    _strategy("fsdp_size", "strategy.fsdp_size"),
    _strategy("fsdp_reshard_after_forward", "strategy.fsdp_reshard_after_forward"),
    _strategy("tensor_parallel_size", "strategy.tensor_parallel_size"),
    _strategy("expert_parallel_size", "strategy.expert_parallel_size"),
    _strategy("partition", "strategy.partition"),
    _strategy("layers_attr", "strategy.layers_attr"),
    _strategy("recompute", "strategy.recompute"),
    _strategy("offload", "strategy.offload"),
    _strategy("compile", "strategy.compile"),
    _strategy("start_method", "strategy.start_method",
              "``popen`` (default) re-runs the script per rank (like ``ddp``); ``spawn`` for notebooks "
              "(``strategy=\"pipeline_spawn\"``)."),
    _strategy("timeout", "strategy.timeout",
              "How long a rank waits on another in one transfer before failing (seconds or a ``timedelta``); "
              "default 10 minutes. A failed rank stops the others within seconds regardless: raise it for a long "
              "``prepare_data`` or compilation on some ranks only."),
    _strategy("heartbeat_timeout", "strategy.heartbeat_timeout",
              "Seconds after which a rank, or the rendezvous store, that has not been heard from is taken for lost: "
              "every other rank stops, naming it and its host (default 30; ``0`` or ``null``: off). A slow step "
              "never counts: each rank beats from a thread of its own (docs/multi-node.md)."),
    _strategy("async_checkpoint", "strategy.async_checkpoint",
              "Write checkpoints on a background thread after copying them to host memory: a save holds training "
              "only for the copy; the next save, a load and the end of the run wait for the write (default "
              "``False``; docs/checkpoints.md)."),
    _strategy("plan", "strategy.plan",
              "A plan file (or its dict) from ``python -m lightning_pipe.planner search``: replaces schedule, "
              "microbatches, stages_per_rank, data_parallel_size and partition (docs/planner.md); default ``None``."),
    _strategy("memory_budget", "++schedule.options.memory_budget",  # ++: adds the key under any schedule config
              "Per-device memory limit for the planner, ``schedule=\"auto\"`` or ``partition=\"time\"`` (bytes or "
              "e.g. ``\"20GiB\"``); default no limit. Refused with any other schedule and partition."),
    _strategy("rebalance_every_n_steps", "strategy.rebalance_every_n_steps"),
    _strategy("rebalance_threshold", "strategy.rebalance_threshold"),
    Setting("devices", "Trainer(devices=..., num_nodes=...)", ("trainer.devices", "trainer.num_nodes"),
            "The world: ``data_parallel_size x pipeline size x fsdp_size x tensor_parallel_size`` ranks."),
    Setting("precision", "Trainer(precision=...)", ("trainer.precision",),
            "``32-true``, ``bf16-mixed``, ``16-mixed``, ``bf16-true``, ``16-true`` (docs/parallelism.md)."),
    Setting("batch_size", "DataLoader(batch_size=...)", ("data.batch_size",),
            "Training batches split into equal micro-batches: a multiple of ``microbatches`` (``drop_last=True``)."),
)}


def describe_setting(key: str) -> str:
    """A setting of the table rendered with its Python and Hydra forms; any other key as given, in backticks."""
    setting = SETTINGS.get(key)
    return setting.describe() if setting is not None else f"`{key}`"


def config_error(rule: str, seen: str, key: str, hint: str = "", *, also: Sequence[str] = (),
                 fix: str = "") -> PipelineConfigError:
    """The one error format: the rule, the values seen, and the setting(s) to change.

    ``key`` and ``also`` are names in :data:`SETTINGS` (rendered with their Python and Hydra forms), e.g.
    "... Got microbatches=2. Change `microbatches` (PipelineStrategy(microbatches=...); Hydra: schedule.microbatches)."
    ``hint`` says how, after the settings; ``fix`` is a change that is not a setting (e.g. to the model), said first
    when it is the usual cure.
    """
    message = f"{rule} Got {seen}. " + (f"{fix}. Or change " if fix else "Change ")
    message += ", or ".join(describe_setting(k) for k in (key, *also))
    message += f"; {hint}." if hint else "."
    return PipelineConfigError(message)


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


def settings_markdown() -> str:
    """``docs/settings.md``: every setting of :data:`SETTINGS`, its Python and Hydra forms, its default and meaning
    (a :class:`PipelineConfig` field's docstring, or the setting's own ``doc``). ``python -m lightning_pipe.config
    --markdown`` prints it; ``tests/unit/test_docs.py`` fails when the page is stale."""
    import ast
    import dataclasses
    import inspect
    import re
    import sys

    source = ast.parse(inspect.getsource(sys.modules[__name__]))
    config = next(n for n in source.body if isinstance(n, ast.ClassDef) and n.name == "PipelineConfig")
    docs: dict[str, str] = {}
    for node, after in zip(config.body, config.body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    defaults = {f.name: f.default if f.default is not dataclasses.MISSING
                else f.default_factory() if callable(f.default_factory) else None
                for f in dataclasses.fields(PipelineConfig)}

    def cell(text: str) -> str:
        text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", " ".join(text.split()))
        return text.replace("``", "`").replace("|", "\\|")

    lines = [
        "# Settings",
        "",
        "<!-- Generated by `python -m lightning_pipe.config --markdown` from PipelineConfig's field docstrings and",
        "config.SETTINGS; tests/unit/test_docs.py fails when this page is stale. Edit those, not this page. -->",
        "",
        "Every setting, where you change it in Python and in the recipe's Hydra configs, its default and what it means.",
        "This is the table every error message uses: ``Change `microbatches` (PipelineStrategy(microbatches=...);",
        "Hydra: schedule.microbatches).`` A test composes the shipped configs with an override of every Hydra path here.",
        "",
        "| setting | Python | Hydra | default | meaning |",
        "|---|---|---|---|---|",
    ]
    for name, setting in SETTINGS.items():
        default = f"`{defaults[name]!r}`" if name in defaults else ""
        meaning = docs.get(name) or setting.doc
        hydra = " / ".join(f"`{h}`" for h in setting.hydra)
        lines.append(f"| `{name}` | `{setting.python}` | {hydra} | {default} | {cell(meaning)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m lightning_pipe.config", description=__doc__)
    parser.add_argument("--markdown", action="store_true", help="print docs/settings.md")
    if parser.parse_args().markdown:
        print(settings_markdown(), end="")
    else:
        parser.print_help()

