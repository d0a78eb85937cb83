"""Every shipped Hydra config composes, resolves and instantiates (no process group, no training)."""

from __future__ import annotations

import itertools
import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from lightning.pytorch.callbacks import LearningRateMonitor
from omegaconf import DictConfig, OmegaConf

from lightning_pipe.config import SETTINGS, PipelineConfigError
from lightning_pipe.schedules import get_schedule_spec, plan_schedule
from recipes.gpt.train import build_all, build_strategy, without_logger_callbacks
from tests.torch_tiers import SPLIT_BACKWARD_SCHEDULES, refused, refused_here

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
        # null: the schedule's default (custom: read from the lists, which the shipped example gives as 4)
        m = cfg.schedule.microbatches or 4
        assert cfg.data.batch_size % m == 0, "micro-batches must divide the batch"
        devices = cfg.trainer.devices
        # A single group option next to the defaults (e.g. 16 GPUs with gpt_tiny) need not be a sensible setup;
        # the default config and the experiments must be.
        if whole_setup and isinstance(devices, int):
            ranks = devices * cfg.trainer.num_nodes
            dp = cfg.strategy.data_parallel_size * cfg.strategy.fsdp_size * cfg.strategy.tensor_parallel_size
            assert ranks % dp == 0
            v = cfg.schedule.stages_per_rank or get_schedule_spec(cfg.schedule.name).default_stages_per_rank
            stages = ranks // dp * v
            assert stages <= cfg.model.n_layer + 3, "more stages than layers"


def instantiate_parts(cfg: DictConfig, tmp_path: Path) -> None:
    # Models on the meta device: checks the arguments without allocating GPT-2's 124M parameters.
    with torch.device("meta"):
        model = instantiate(cfg.model)
        model.configure_model()  # the Llama recipe builds its layers here (a no-op for the GPT)
    embedding, head = model.layers[0], model.layers[-1]
    if hasattr(head, "head"):  # the GPT: head tied to the token embedding
        assert head.head.weight is embedding.wte.weight
    else:  # the Llama recipe: tied only on request
        assert (head.output.weight is embedding.tok_embeddings.weight) == cfg.model.tie_embeddings
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
        if refused("split_backward") and cfg.get("schedule", {}).get("name") in SPLIT_BACKWARD_SCHEDULES:
            with refused_here("split_backward"):  # restricted torch tier: refused in the constructor
                build_strategy(cfg.strategy)
            return
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


# ----------------------------------------------------------------------------------- the table of setting names
# One override per Hydra path of lightning_pipe.config.SETTINGS (plus what it needs), and the value it must set.
SAMPLES: dict[str, tuple[list[str], object]] = {
    "schedule=<name>": (["schedule=gpipe"], "gpipe"),
    "schedule.microbatches": (["schedule.microbatches=8"], 8),
    "schedule.stages_per_rank": (["schedule=interleaved_1f1b", "schedule.stages_per_rank=3"], 3),
    "schedule.options": (["schedule=custom", "schedule.options={csv: my.csv, actions: null}"], {"csv": "my.csv"}),
    "strategy.data_parallel_size": (["strategy.data_parallel_size=2"], 2),
    "strategy.fsdp_size": (["strategy.fsdp_size=2"], 2),
    "strategy.fsdp_reshard_after_forward": (["strategy.fsdp_reshard_after_forward=true"], True),
    "strategy.tensor_parallel_size": (["strategy.tensor_parallel_size=2"], 2),
    "strategy.expert_parallel_size": (["strategy.expert_parallel_size=2"], 2),
    "strategy.partition": (["strategy.partition=[3,4]"], (3, 4)),
    "strategy.layers_attr": (["strategy.layers_attr=blocks"], "blocks"),
    "strategy.recompute": (["strategy.recompute=all"], "all"),
    "strategy.offload": (["strategy.offload=[1,3]"], (1, 3)),
    "strategy.compile": (["strategy.compile={mode: max-autotune}"], {"mode": "max-autotune"}),
    "strategy.start_method": (["strategy.start_method=spawn"], "spawn"),
    "strategy.timeout": (["strategy.timeout=30"], 30),
    "strategy.heartbeat_timeout": (["strategy.heartbeat_timeout=45"], 45),
    "strategy.async_checkpoint": (["strategy.async_checkpoint=true"], True),
    "strategy.plan": (["strategy.plan=my_plan.json"], "my_plan.json"),
    "strategy.rebalance_every_n_steps": (["strategy.rebalance_every_n_steps=50"], 50),
    "strategy.rebalance_threshold": (["strategy.rebalance_threshold=0.1"], 0.1),
    # ++: the key exists under schedule=auto only; partition=time under 1F1B reads it too
    "++schedule.options.memory_budget": (["strategy.partition=time", "++schedule.options.memory_budget=20GiB"],
                                         "20GiB"),
    "trainer.devices": (["trainer.devices=4"], 4),
    "trainer.num_nodes": (["trainer.num_nodes=2"], 2),
    "trainer.precision": (["trainer.precision=bf16-mixed"], "bf16-mixed"),
    "data.batch_size": (["data.batch_size=32"], 32),
}
HYDRA_PATHS = sorted({path for setting in SETTINGS.values() for path in setting.hydra})


def test_every_hydra_path_of_the_settings_table_has_a_sample() -> None:
    assert sorted(SAMPLES) == HYDRA_PATHS


@pytest.mark.parametrize("path", HYDRA_PATHS)
def test_every_hydra_path_of_the_settings_table_composes(path: str, tmp_path: Path) -> None:
    """Error messages send users to these paths: Hydra must accept each, and the value must reach the setting."""
    overrides, expected = SAMPLES[path]
    cfg = compose_train(overrides, tmp_path)  # raises ConfigCompositionException for a key Hydra refuses
    OmegaConf.resolve(cfg)
    path = path.lstrip("+")  # ++key: add-or-override
    value = OmegaConf.select(cfg, "schedule.name" if path == "schedule=<name>" else path)
    if isinstance(value, DictConfig):
        value = {k: v for k, v in OmegaConf.to_container(value).items() if v is not None}
    assert value == (list(expected) if isinstance(expected, tuple) else expected), (path, value)
    if path.startswith(("schedule", "strategy")) and path != "strategy.plan":  # (a plan needs a real file)
        # ... and the strategy built from that config carries it.
        strategy = build_strategy(cfg.strategy)
        name = {"schedule=<name>": "schedule", "schedule.options": "schedule_options"}.get(path) or path.split(".")[-1]
        got = (getattr(strategy, f"_{name}") if name in ("start_method", "memory_budget", "heartbeat_timeout")
               else strategy._timeout.total_seconds() if name == "timeout"
               else strategy._saver is not None if name == "async_checkpoint"
               else getattr(strategy.pipeline_config, name))
        assert got == expected, (path, got)


def _readme_examples() -> list[list[str]]:
    """The overrides of every `python recipes/gpt/train.py ...` example in the READMEs, docs/, configs/train.yaml and
    train.py's docstring, one list per combination (a multirun `a,b` gives one example per value)."""
    examples = []
    for doc in (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "recipes" / "gpt" / "README.md",
                CONFIGS / "train.yaml", REPO / "recipes" / "gpt" / "train.py"):
        for match in re.finditer(r"python recipes/gpt/train\.py([^`\n#]*)", doc.read_text()):
            args = [a for a in shlex.split(match.group(1)) if a != "-m" and not a.startswith("[")]  # [overrides]
            choices = [[f"{a.split('=', 1)[0]}={v}" for v in a.split("=", 1)[1].split(",")]
                       if "=" in a and "," in a and "[" not in a else [a] for a in args]
            examples += [list(combo) for combo in itertools.product(*choices)]
    return examples


def test_readme_override_examples_compose(tmp_path: Path, data_files: dict) -> None:
    examples = _readme_examples()
    assert len(examples) >= 15 and ["strategy.partition=[3,4]"] in examples, examples
    plan = tmp_path / "plan.json"  # an example replaying a plan file composes with a real one in its place
    plan.write_text(json.dumps({"format": "lightning_pipe.plan/1", "schedule": "1f1b", "microbatches": 4,
                                "stages_per_rank": 1, "pipeline_size": 2, "data_parallel_size": 1,
                                "partition": [3, 4]}))
    for overrides in examples:
        overrides = [f"strategy.plan={plan}" if o.startswith("strategy.plan=") else o for o in overrides]
        cfg = compose_train(overrides, tmp_path)
        fill_required(cfg, data_files)
        OmegaConf.resolve(cfg)
        if "_target_" in cfg.strategy:
            with refused_here("split_backward", cfg.get("schedule", {}).get("name") in SPLIT_BACKWARD_SCHEDULES):
                build_strategy(cfg.strategy)


# ----------------------------------------------------------------------------------- errors from the shell
@pytest.mark.parametrize(("override", "seen"), [("strategy.partition=3", "partition=3."),
                                                ("strategy.partition=[3,x]", "partition=[3, 'x']")])
def test_malformed_partition_from_the_shell_names_the_setting(override: str, seen: str, tmp_path: Path) -> None:
    cfg = compose_train([override], tmp_path)
    with pytest.raises(PipelineConfigError) as err:  # the library's own error, not Hydra's wrapper
        build_strategy(cfg.strategy)
    assert seen in str(err.value) and "Hydra: strategy.partition" in str(err.value)


def test_options_of_another_schedule_are_refused_from_the_shell(tmp_path: Path) -> None:
    cfg = compose_train(["schedule=1f1b", "+schedule.options.actions=[[0F0,0B0],[1F0,1B0]]"], tmp_path)
    with pytest.raises(PipelineConfigError, match=r"Schedule '1f1b' takes no options.*Hydra: schedule.options"):
        build_strategy(cfg.strategy)


def test_custom_schedule_from_a_csv_file_on_the_shell(tmp_path: Path) -> None:
    csv_path = tmp_path / "my.csv"
    csv_path.write_text("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n")
    cfg = compose_train(["schedule=custom", f"schedule.options.csv={csv_path}", "schedule.options.actions=null"],
                        tmp_path)
    strategy = build_strategy(cfg.strategy)
    assert strategy.pipeline_config.schedule_options == {"csv": str(csv_path)}
    plan = plan_schedule(strategy.pipeline_config, 2)
    assert (plan.microbatches, plan.stage_ranks) == (2, (0, 1))
    # The shipped inline example resolves too; its micro-batch count comes from the lists.
    plan = plan_schedule(build_strategy(compose_train(["schedule=custom"], tmp_path).strategy).pipeline_config, 2)
    assert plan.microbatches == 4


def test_text_file_errors_name_the_data_path(tmp_path: Path) -> None:
    from recipes.gpt.train import instantiate as recipe_instantiate

    cfg = compose_train(["data=text_file", f"data.text_path={tmp_path / 'missing.txt'}"], tmp_path)
    with pytest.raises(FileNotFoundError, match=r"missing.txt.*Change `data.text_path`"):
        recipe_instantiate(cfg.data)
    tiny = tmp_path / "tiny.txt"
    tiny.write_bytes(b"x" * 500)
    cfg = compose_train(["data=text_file", f"data.text_path={tiny}"], tmp_path)
    datamodule = recipe_instantiate(cfg.data)
    with pytest.raises(ValueError, match=r"at least one full batch.*tiny.txt.*Change `data.text_path`"):
        datamodule.setup("fit")


# ----------------------------------------------------------------------------------- callbacks and loggers
def test_no_logger_drops_the_learning_rate_monitor(tmp_path: Path) -> None:
    cfg = compose_train(["logger=none"], tmp_path)
    callbacks = build_all(cfg.callbacks)
    assert any(isinstance(c, LearningRateMonitor) for c in callbacks)  # the default callbacks have one
    loggers = build_all(cfg.logger)
    assert loggers == []
    kept = without_logger_callbacks(callbacks, loggers)
    assert not any(isinstance(c, LearningRateMonitor) for c in kept) and len(kept) == len(callbacks) - 1
    assert without_logger_callbacks(callbacks, [object()]) == callbacks


def test_logger_none_trains(tmp_path: Path) -> None:
    """`logger=none` with the default callbacks (issue 14, item 9): one device, two steps, no error."""
    from recipes.gpt.train import train

    cfg = compose_train(["strategy=single", "trainer=cpu_1", "logger=none", "trainer.max_steps=2",
                         "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "data.max_bytes=60000",
                         "data.batch_size=2", "model.block_size=16", "model.n_layer=1", "model.n_embd=16",
                         "model.n_head=2", "validate_after_fit=false", "trainer.enable_progress_bar=false",
                         "torch_threads=1"], tmp_path)
    results = train(cfg)
    assert "train_loss" in results


def test_callbacks_none_advice_names_a_real_key(tmp_path: Path) -> None:
    assert "trainer.enable_checkpointing=false" in (CONFIGS / "callbacks" / "none.yaml").read_text()
    cfg = compose_train(["callbacks=none", "trainer.enable_checkpointing=false"], tmp_path)
    assert cfg.trainer.enable_checkpointing is False
