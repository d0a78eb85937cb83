"""FSDP collective counts (tests/distributed/test_fsdp.py): how often a stage gathers and reduces per batch.

FSDP2's parameter groups call the module functions ``foreach_all_gather`` and ``foreach_reduce`` (one call per FSDP
unit: all its parameters at once). The scenario counts those calls around a real fit (the functions still run).
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypedDict

import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp_param_group

from tests.distributed.scenarios.training import TrainingCase, run_training


@dataclass(frozen=True)
class FsdpCountCase:
    schedule: str = "1f1b"
    reshard_after_forward: bool = False
    steps: int = 2
    acc: int = 1
    tp: int = 1  # > 1: the tensor-parallel model, each layer split before it is sharded
    stages_per_rank: int | None = None
    expect_error: bool = False


class FsdpCounts(TypedDict):
    all_gather: int
    reduce: int
    units: int  # FSDP units holding parameters on this rank
    batches: int


@contextlib.contextmanager
def counting(counts: Counter, names: tuple[str, ...]) -> Iterator[None]:
    originals = {name: getattr(fsdp_param_group, name) for name in names}

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return fn(*args, **kwargs)
        return counted

    for name, fn in originals.items():
        setattr(fsdp_param_group, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(fsdp_param_group, name, fn)


def run_counts(case: FsdpCountCase) -> FsdpCounts:
    counts: Counter = Counter()
    training = TrainingCase(model="tp" if case.tp > 1 else "toy", schedule=case.schedule, fsdp=2, tp=case.tp,
                            stages_per_rank=case.stages_per_rank, fsdp_reshard=case.reshard_after_forward,
                            steps=case.steps, acc=case.acc, validate=False)
    with counting(counts, ("foreach_all_gather", "foreach_reduce")):
        run_training(training, pipeline=True)
    # Every layer of the toy models has parameters and is one FSDP unit; the stage roots hold none (no collectives).
    pipeline_size = int(os.environ["TEST_WORLD_SIZE"]) // (training.fsdp * training.tp)
    units = training.n_layers // pipeline_size
    return FsdpCounts(all_gather=counts["foreach_all_gather"], reduce=counts["foreach_reduce"], units=units,
                      batches=case.steps * case.acc)
