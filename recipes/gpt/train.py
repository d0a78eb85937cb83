"""Train the GPT recipe: ``python recipes/gpt/train.py [overrides]`` (configs in ``configs/``, see train.yaml).

Examples::

    python recipes/gpt/train.py                                        # gpt_tiny, 2 CPU stages, 1F1B
    python recipes/gpt/train.py strategy=single trainer=cpu_1          # the same GPT without the pipeline
    python recipes/gpt/train.py schedule=gpipe schedule.microbatches=8 trainer.max_steps=20
    python recipes/gpt/train.py -m schedule=gpipe,1f1b                 # multirun
"""

from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path
from typing import Any

# Run as a script, sys.path[0] is recipes/gpt; the configs' `_target_`s name `recipes.gpt.*` and `lightning_pipe`.
REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import hydra  # noqa: E402
import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from hydra.errors import InstantiationException  # noqa: E402
from lightning.fabric.plugins.environments import SLURMEnvironment  # noqa: E402
from lightning.pytorch.callbacks import LearningRateMonitor  # noqa: E402
from lightning.pytorch.utilities.rank_zero import rank_zero_info  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

import lightning_pipe  # noqa: E402, F401  (registers Trainer(strategy="pipeline"))
from recipes.gpt.callbacks import TokensPerSecond  # noqa: E402


def set_threads(threads: int | None, trainer_cfg: DictConfig) -> None:
    """Split the CPU cores between this node's ranks (``threads=None``), or use ``threads``.

    Ranks on one machine share its cores; torch's default (all cores per process) oversubscribes them and
    slows every stage. An explicit ``OMP_NUM_THREADS`` wins over both.
    """
    if "OMP_NUM_THREADS" in os.environ:
        return
    if threads is None:
        devices = trainer_cfg.get("devices")
        if trainer_cfg.get("accelerator") != "cpu" or not isinstance(devices, int):
            return
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = max(1, cores // max(1, devices))
    torch.set_num_threads(int(threads))


def instantiate(node: DictConfig, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate``, but a bad value reaches the user as its own error (which names the setting to
    change), not wrapped in Hydra's ``InstantiationException`` as a ``repr``."""
    try:
        return hydra.utils.instantiate(node, **kwargs)
    except InstantiationException as err:
        if isinstance(err.__cause__, (ValueError, FileNotFoundError)):
            raise err.__cause__ from None
        raise


def build_strategy(cfg: DictConfig) -> Any:
    """A ``_target_`` config is instantiated (the pipeline); ``{name: auto|ddp|...}`` is passed to Lightning as is."""
    if "_target_" in cfg:
        return instantiate(cfg)
    return cfg.name


def build_all(group: DictConfig | None) -> list[Any]:
    """Instantiate every ``_target_`` entry of a callbacks/logger group; a logger whose package is missing
    (TensorBoard is an optional dependency) is skipped with a note instead of failing the run."""
    objects = []
    for key, node in (group or {}).items():
        if not isinstance(node, DictConfig) or "_target_" not in node:
            continue
        try:
            objects.append(hydra.utils.instantiate(node))
        except (ImportError, ModuleNotFoundError) as err:
            print(f"[train] skipping {key} ({node._target_}): {err}", file=sys.stderr)
        except InstantiationException as err:
            if isinstance(err.__cause__, ImportError):
                print(f"[train] skipping {key} ({node._target_}): {err.__cause__}", file=sys.stderr)
            else:
                raise
    return objects


def without_logger_callbacks(callbacks: list[Any], loggers: list[Any]) -> list[Any]:
    """Leave out the callbacks that refuse a Trainer without loggers (``logger=none``): LearningRateMonitor."""
    if loggers:
        return callbacks
    kept = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
    if len(kept) < len(callbacks):
        rank_zero_info("[train] no logger (logger=none): leaving out LearningRateMonitor, which logs through one")
    return kept


class FinalStateAfterRequeue(pl.Callback):
    """Under SLURM, after a requeue: the state training ended with, saved as the newest ``hpc_ckpt_<n>.ckpt``.

    Lightning's ``validate()`` (and ``fit()``) with ``ckpt_path=None`` load the newest ``hpc_ckpt_*.ckpt`` of the run
    directory when they run under SLURM: after a requeue, the weights of the requeue's step. Saved at the end of
    training (every rank, a collective save), the newest one is the trained state, so the final validation measures
    it, and a job requeued during that validation resumes from it and stops at once (``max_steps`` is reached).
    """

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        root = Path(trainer.default_root_dir)
        found = [int(m.group(1)) for path in root.glob("hpc_ckpt_*.ckpt")
                 if (m := re.fullmatch(r"hpc_ckpt_(\d+)\.ckpt", path.name))]
        newest = trainer.strategy.broadcast(max(found, default=0))  # one answer for every rank's collective save
        if newest:
            trainer.save_checkpoint(root / f"hpc_ckpt_{newest + 1}.ckpt")


def describe_processes(trainer: pl.Trainer) -> str:
    """Who started the processes and how many there are: Lightning's cluster environment (``SLURMEnvironment``
    under srun, ``TorchElasticEnvironment`` under torchrun, ``LightningEnvironment`` when Lightning launches)."""
    environment = getattr(trainer.strategy, "cluster_environment", None)
    if environment is None:
        return "[train] processes: 1 (no cluster environment)"
    extra = f" (auto_requeue={environment.auto_requeue})" if isinstance(environment, SLURMEnvironment) else ""
    return f"[train] processes: {trainer.world_size}, cluster environment {type(environment).__name__}{extra}"


def train(cfg: DictConfig) -> dict[str, float]:
    """Fit the GPT described by ``cfg``; return the final metrics (val loss, baseline, tokens/s)."""
    set_threads(cfg.get("torch_threads"), cfg.trainer)
    pl.seed_everything(cfg.seed, workers=True)

    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model)
    loggers = build_all(cfg.get("logger"))
    callbacks = without_logger_callbacks(build_all(cfg.get("callbacks")), loggers)
    if SLURMEnvironment.detect():
        callbacks.append(FinalStateAfterRequeue())
    trainer: pl.Trainer = instantiate(
        cfg.trainer, strategy=build_strategy(cfg.strategy), callbacks=callbacks, logger=loggers or False
    )
    if trainer.is_global_zero:
        print(OmegaConf.to_yaml(cfg, resolve=True))
        print(describe_processes(trainer))

    trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))

    results: dict[str, float] = {"unigram_baseline": datamodule.unigram_entropy()}
    # Read before validate(), which resets the callback metrics.
    if "train_loss" in trainer.callback_metrics:
        results["train_loss"] = float(trainer.callback_metrics["train_loss"])
    if cfg.get("validate_after_fit", True):
        trainer.validate(model, datamodule=datamodule, verbose=False)
    if "val_loss" in trainer.callback_metrics:
        results["val_loss"] = float(trainer.callback_metrics["val_loss"])
    speed = next((c for c in callbacks if isinstance(c, TokensPerSecond)), None)
    if speed is not None:
        results["tokens_per_s"] = speed.mean_tokens_per_s
    results["corpus_bytes"] = float(datamodule.corpus_bytes)

    if trainer.is_global_zero:
        report(results)
    return results


def report(results: dict[str, float]) -> None:
    baseline = results["unigram_baseline"]
    val = results.get("val_loss", math.nan)
    verdict = "beats" if val < baseline else "does NOT beat"
    print(
        f"[train] corpus {results['corpus_bytes']:.0f} bytes | val_loss {val:.4f} nats/token {verdict} the unigram "
        f"baseline {baseline:.4f} | train_loss {results.get('train_loss', math.nan):.4f} | "
        f"{results.get('tokens_per_s', math.nan):,.0f} tokens/s"
    )


@hydra.main(config_path="../../configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float:
    # The returned value is what Hydra sweepers optimise.
    return train(cfg).get("val_loss", math.nan)


if __name__ == "__main__":
    main()
