"""The GPT recipe inside launched ranks: ``recipes/gpt/train.py``'s config composed from ``configs/`` with a few
overrides (Hydra's compose API, as the shell would with the same overrides) and its own ``train``; many runs share
one launch (tests/recipes/test_every_schedule.py)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import lightning.pytorch as pl

REPO = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class RecipeCase:
    overrides: tuple[str, ...]
    """Hydra overrides, as on the shell (``schedule=pipedream``, ``trainer.max_steps=2``)."""
    expect_error: bool = False


class RecipeResult(TypedDict):
    schedule: str
    microbatches: int
    stages: int  # pipeline stages of the run
    global_step: int
    train_loss: float
    seconds: float  # wall time of the run (composition, data, model, fit)
    gradient_clip_val: float | None


class Probe(pl.Callback):
    """Added to the recipe's callbacks by an override: what the run was (the last one's, per process)."""

    last: dict[str, Any] = {}

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        plan = trainer.strategy.plan
        Probe.last = {"schedule": plan.spec.name, "microbatches": plan.microbatches, "stages": plan.num_stages,
                      "global_step": trainer.global_step, "gradient_clip_val": trainer.gradient_clip_val}


def run_recipe(case: RecipeCase) -> RecipeResult:
    from hydra import compose, initialize_config_dir

    from recipes.gpt.train import train

    probe = [f"+callbacks.probe._target_={Probe.__module__}.Probe"]
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=[*case.overrides, *probe])
    Probe.last = {}
    start = time.perf_counter()
    metrics = train(cfg)
    return RecipeResult(**Probe.last, train_loss=metrics.get("train_loss", math.nan),  # type: ignore[typeddict-item]
                        seconds=time.perf_counter() - start)
