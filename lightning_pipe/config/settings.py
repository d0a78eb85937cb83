"""The one table of setting names (where a user changes each, in Python and in the shipped Hydra configs) and the one
error format, which names the rule, the values seen and the setting to change."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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
            "At least ``microbatches`` rows; a multiple of it, else cut unevenly where shapes are planned."),
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
