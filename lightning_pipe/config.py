"""Typed settings of the pipeline strategy, validated early with errors that name the key to change.

Every check here runs on plain data, on every rank, before any process group traffic: a rank that raises
while its peers wait in a P2P receive would hang the job, so the rules live where all ranks see the same inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence, Union

SplitSpec = Union[str, Sequence[int]]
SPLIT_METHODS = ("uniform", "parameters")


class PipelineConfigError(ValueError):
    """A setting (or a setting against the model / world) breaks a rule of the pipeline."""


def config_error(rule: str, seen: str, key: str, hint: str = "") -> PipelineConfigError:
    """Build the one error format we use: the rule, the values seen, and the setting to change."""
    message = f"{rule} Got {seen}. Change `{key}`"
    message += f" ({hint})." if hint else "."
    return PipelineConfigError(message)


def _key(name: str) -> str:
    return PipelineConfig.KEYS[name]


@dataclass(frozen=True)
class PipelineConfig:
    """What a user chooses. Field docstrings are the contract; ``KEYS`` maps each field to its config key."""

    schedule: str = "1f1b"
    """Schedule name (see :func:`lightning_pipe.schedules.available_schedules`)."""
    microbatches: int | None = None
    """Micro-batches per batch. ``None``: twice the number of stages."""
    data_parallel_size: int = 1
    """Replicas of the whole pipeline; pipeline size = world size / data_parallel_size."""
    split: SplitSpec = "uniform"
    """How layers go to stages: ``"uniform"`` (equal counts), ``"parameters"`` (balanced parameter counts), or
    explicit per-stage layer counts such as ``[3, 5]``."""
    stages_per_rank: int | None = None
    """Stages each rank holds. ``None``: what the schedule needs (1, or 2 for V-shaped schedules)."""
    layers_attr: str = "layers"
    """Attribute of the LightningModule that holds the ordered layer list."""
    recompute: Union[str, int] = "none"
    """Activation recomputation per stage: ``"none"``, ``"all"`` (every layer) or ``k`` (every k-th layer)."""
    schedule_options: dict[str, Any] = field(default_factory=dict)
    """Extra schedule-specific options (e.g. the action lists of the ``custom`` schedule)."""

    # Where each field lives in the shipped Hydra configs, so messages name what a user actually edits.
    KEYS = {
        "schedule": "schedule (Hydra: schedule=<name>; PipelineStrategy(schedule=...))",
        "microbatches": "schedule.microbatches (PipelineStrategy(microbatches=...))",
        "data_parallel_size": "strategy.data_parallel_size (PipelineStrategy(data_parallel_size=...))",
        "split": "strategy.split (PipelineStrategy(split=...))",
        "stages_per_rank": "schedule.stages_per_rank (PipelineStrategy(stages_per_rank=...))",
        "layers_attr": "strategy.layers_attr (PipelineStrategy(layers_attr=...))",
        "recompute": "strategy.recompute (PipelineStrategy(recompute=...))",
        "devices": "trainer.devices / trainer.num_nodes",
        "batch_size": "data.batch_size (the DataLoader batch size)",
    }

    def __post_init__(self) -> None:
        # Normalise before validating: Hydra hands lists as ListConfig and names in any case.
        object.__setattr__(self, "schedule", str(self.schedule).lower())
        if not isinstance(self.split, str):
            object.__setattr__(self, "split", tuple(int(n) for n in self.split))
        object.__setattr__(self, "schedule_options", dict(self.schedule_options or {}))
        self._validate_plain()

    def _validate_plain(self) -> None:
        if self.microbatches is not None and (not isinstance(self.microbatches, int) or self.microbatches < 1):
            raise config_error("The number of micro-batches must be a positive integer.",
                               f"microbatches={self.microbatches!r}", _key("microbatches"))
        if not isinstance(self.data_parallel_size, int) or self.data_parallel_size < 1:
            raise config_error("The data-parallel size must be a positive integer.",
                               f"data_parallel_size={self.data_parallel_size!r}", _key("data_parallel_size"))
        if self.stages_per_rank is not None and (not isinstance(self.stages_per_rank, int)
                                                 or self.stages_per_rank < 1):
            raise config_error("stages_per_rank must be a positive integer or None.",
                               f"stages_per_rank={self.stages_per_rank!r}", _key("stages_per_rank"))
        if self.recompute_every is None and str(self.recompute).lower() != "none":
            raise config_error("recompute is 'none', 'all', or a positive k (every k-th layer of each stage).",
                               f"recompute={self.recompute!r}", _key("recompute"))
        if isinstance(self.split, str):
            if self.split not in SPLIT_METHODS:
                raise config_error(f"split must be one of {list(SPLIT_METHODS)} or a list of per-stage layer counts.",
                                   f"split={self.split!r}", _key("split"))
        elif not self.split or any(n < 1 for n in self.split):
            raise config_error("An explicit split lists a positive layer count for every stage.",
                               f"split={list(self.split)}", _key("split"))

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
class Topology:
    """How the world is cut: ``world = data_parallel_size x pipeline_size``, pipeline innermost.

    Rank ``r`` is stage-rank ``r % pipeline_size`` of replica ``r // pipeline_size``, so global rank 0 (loggers,
    progress bar) holds the first stage of replica 0.
    """

    world_size: int
    data_parallel_size: int
    global_rank: int

    @property
    def pipeline_size(self) -> int:
        return self.world_size // self.data_parallel_size

    @property
    def pp_rank(self) -> int:
        return self.global_rank % self.pipeline_size

    @property
    def dp_rank(self) -> int:
        return self.global_rank // self.pipeline_size

    def pp_group_ranks(self, dp_rank: int) -> list[int]:
        return [dp_rank * self.pipeline_size + i for i in range(self.pipeline_size)]

    def dp_group_ranks(self, pp_rank: int) -> list[int]:
        return [d * self.pipeline_size + pp_rank for d in range(self.data_parallel_size)]

    @classmethod
    def create(cls, world_size: int, data_parallel_size: int, global_rank: int) -> Topology:
        if world_size % data_parallel_size != 0:
            raise config_error(
                "The world size must be divisible by the data-parallel size (pipeline size = world / dp).",
                f"world_size={world_size}, data_parallel_size={data_parallel_size}",
                _key("data_parallel_size"), f"or {_key('devices')}")
        return cls(world_size, data_parallel_size, global_rank)
