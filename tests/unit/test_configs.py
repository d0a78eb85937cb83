"""Every shipped Hydra config composes, resolves and instantiates (no process group, no training)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from recipes.gpt.train import build_all, build_strategy

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"

GROUPS = sorted(p.name for p in CONFIGS.iterdir() if p.is_dir())
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONFIGS / g).glob("*.yaml"))]
# trainer/default.yaml is the base the others extend, not an option of its own.
OPTIONS = [o for o in OPTIONS if o != ("trainer", "default")]


def test_every_yaml_is_covered() -> None:
    on_disk = {p.relative_to(CONFIGS).with_suffix("").as_posix() for p in CONFIGS.rglob("*.yaml")}
    covered = {f"{g}/{o}" for g, o in OPTIONS} | {"train", "trainer/default"}
    assert on_disk == covered
    for group in ("strategy", "schedule", "model", "data", "trainer", "experiment", "callbacks", "logger"):
        assert group in GROUPS


@pytest.fixture
def data_files(tmp_path: Path) -> dict[str, str]:
    text = tmp_path / "corpus.txt"
    text.write_bytes(b"hello pipeline\n" * 2000)
    tokens = tmp_path / "train.bin"
    np.arange(4096, dtype=np.uint16).tofile(tokens)
    return {"text": str(text), "bin": str(tokens)}


def compose_train(overrides: list[str], tmp_path: Path) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name="train", overrides=[f"paths.output_dir={tmp_path}", *overrides])


def fill_required(cfg: DictConfig, files: dict[str, str]) -> None:
    """Give the values the user must give (``???``) for the data source the config selects."""
    keys = cfg.data.keys()  # (`key in cfg.data` is False for a `???` value)
    for key, kind in (("text_path", "text"), ("bin_path", "bin")):
        if key in keys and OmegaConf.is_missing(cfg.data, key):
            cfg.data[key] = files[kind]


def check_consistency(cfg: DictConfig, whole_setup: bool = True) -> None:
    """Cross-group rules a user would otherwise learn from a failed launch."""
    assert cfg.data.block_size == cfg.model.block_size
    assert cfg.model.max_steps == cfg.trainer.max_steps
    if "_target_" in cfg.strategy and cfg.strategy._target_ == "lightning_pipe.PipelineStrategy":
        assert cfg.strategy.schedule == cfg.schedule.name
        assert cfg.strategy.microbatches == cfg.schedule.microbatches
        assert cfg.strategy.stages_per_rank == cfg.schedule.stages_per_rank
        assert cfg.data.batch_size % cfg.schedule.microbatches == 0, "micro-batches must divide the batch"
        devices = cfg.trainer.devices
        # A single group option next to the defaults (e.g. 16 GPUs with gpt_tiny) need not be a sensible setup;
        # the default config and the experiments must be.
        if whole_setup and isinstance(devices, int):
            ranks = devices * cfg.trainer.num_nodes
            assert ranks % cfg.strategy.data_parallel_size == 0
            stages = ranks // cfg.strategy.data_parallel_size * (cfg.schedule.stages_per_rank or 1)
            assert stages <= cfg.model.n_layer + 3, "more stages than layers"


def instantiate_parts(cfg: DictConfig, tmp_path: Path) -> None:
    # Models on the meta device: checks the arguments without allocating GPT-2's 124M parameters.
    with torch.device("meta"):
        model = instantiate(cfg.model)
    assert model.layers[-1].head.weight is model.layers[0].wte.weight
    datamodule = instantiate(cfg.data)
    assert datamodule.block_size == cfg.model.block_size
    build_all(cfg.get("callbacks"))
    build_all(cfg.get("logger"))


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}/{o}" for g, o in OPTIONS])
def test_option_composes_and_instantiates(group: str, option: str, tmp_path: Path, data_files: dict) -> None:
    cfg = compose_train([f"{group}={option}"], tmp_path)
    fill_required(cfg, data_files)
    OmegaConf.resolve(cfg)  # every interpolation resolves
    check_consistency(cfg, whole_setup=group == "experiment")
    instantiate_parts(cfg, tmp_path)

    if "_target_" in cfg.strategy:
        strategy = build_strategy(cfg.strategy)
        assert type(strategy).__name__ == "PipelineStrategy"
    else:
        assert build_strategy(cfg.strategy) in ("auto", "ddp")

    # The Trainer itself only where it can exist here (CPU); it launches nothing until fit().
    if cfg.trainer.accelerator == "cpu":
        trainer = instantiate(
            cfg.trainer,
            strategy=build_strategy(cfg.strategy),
            callbacks=build_all(cfg.callbacks),
            logger=build_all(cfg.logger) or False,
        )
        assert trainer.max_steps == cfg.trainer.max_steps


def test_default_config(tmp_path: Path) -> None:
    cfg = compose_train([], tmp_path)
    assert cfg.strategy._target_ == "lightning_pipe.PipelineStrategy"
    assert (cfg.schedule.name, cfg.trainer.devices, cfg.model.n_layer) == ("1f1b", 2, 4)
    assert cfg.data._target_ == "recipes.gpt.data.ByteCorpusDataModule" and "text_path" not in cfg.data
    check_consistency(cfg)


def test_shell_overrides_reach_every_part(tmp_path: Path) -> None:
    cfg = compose_train(
        ["schedule=gpipe", "schedule.microbatches=8", "strategy.data_parallel_size=1", "trainer=cpu_2",
         "model=gpt_tiny", "trainer.max_steps=20"],
        tmp_path,
    )
    OmegaConf.resolve(cfg)
    assert (cfg.strategy.schedule, cfg.strategy.microbatches) == ("gpipe", 8)
    assert cfg.model.max_steps == 20 and cfg.trainer.max_steps == 20


@pytest.mark.parametrize("name", ["interleaved_1f1b", "looped_bfs", "zbv", "dualpipev"])
def test_virtual_stage_schedules_pass_two_stages_per_rank(name: str, tmp_path: Path) -> None:
    cfg = compose_train([f"schedule={name}"], tmp_path)
    assert cfg.strategy.stages_per_rank == 2


def test_experiment_overrides_defaults(tmp_path: Path) -> None:
    cfg = compose_train(["experiment=gpt2_gpu_zbv", "data.bin_path=/x/train.bin"], tmp_path)
    assert (cfg.model.n_layer, cfg.model.vocab_size, cfg.model.block_size) == (12, 50304, 1024)
    assert (cfg.strategy.schedule, cfg.strategy.stages_per_rank, cfg.trainer.accelerator) == ("zbv", 2, "gpu")
    cfg = compose_train(["experiment=tiny_cpu_single"], tmp_path)
    assert "_target_" not in cfg.strategy and cfg.trainer.devices == 1


def test_gpt2_size(tmp_path: Path) -> None:
    cfg = compose_train(["model=gpt2_124m"], tmp_path)
    with torch.device("meta"):
        model = instantiate(cfg.model)
    n = sum(p.numel() for p in model.parameters())
    assert 123e6 < n < 125e6, n  # nanoGPT's "124M" (with the 50304 padded vocabulary)
