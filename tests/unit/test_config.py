"""Settings are checked on plain data, early, with messages naming the rule, the values and the key."""

import lightning.pytorch as L
import pytest

import lightning_pipe
from lightning_pipe import PipelineConfig, PipelineConfigError, PipelineStrategy
from lightning_pipe.config import Topology
from lightning_pipe.schedules import available_schedules, plan_schedule


def test_unknown_schedule_lists_the_known_ones():
    with pytest.raises(PipelineConfigError) as err:
        PipelineStrategy(schedule="zero_bubble_deluxe")
    msg = str(err.value)
    assert "'zero_bubble_deluxe'" in msg and "schedule=<name>" in msg
    for name in ("gpipe", "1f1b"):
        assert name in msg


def test_schedule_names_are_case_insensitive():
    assert PipelineConfig(schedule="GPipe").schedule == "gpipe"
    assert {"gpipe", "1f1b"} <= set(available_schedules())


def test_microbatches_fewer_than_stages_refused_for_1f1b():
    with pytest.raises(PipelineConfigError) as err:
        plan_schedule(PipelineConfig(schedule="1f1b", microbatches=2), pipeline_size=4)
    msg = str(err.value)
    assert "at least as many micro-batches as pipeline ranks" in msg
    assert "microbatches=2" in msg and "pipeline size=4" in msg and "schedule.microbatches" in msg


def test_gpipe_accepts_fewer_microbatches_than_stages():
    assert plan_schedule(PipelineConfig(schedule="gpipe", microbatches=1), 4).microbatches == 1


def test_default_microbatches_is_twice_the_stages():
    assert plan_schedule(PipelineConfig(schedule="1f1b"), 4).microbatches == 8


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_microbatches_must_be_positive_int(bad):
    with pytest.raises(PipelineConfigError, match="schedule.microbatches"):
        PipelineConfig(microbatches=bad)


def test_split_must_be_known_or_counts():
    with pytest.raises(PipelineConfigError, match=r"split=.*'balanced'.*strategy.split"):
        PipelineConfig(split="balanced")
    assert PipelineConfig(split=[1, 2]).split == (1, 2)


def test_world_not_divisible_by_data_parallel():
    with pytest.raises(PipelineConfigError) as err:
        Topology.create(world_size=3, data_parallel_size=2, global_rank=0)
    msg = str(err.value)
    assert "world_size=3" in msg and "data_parallel_size=2" in msg and "strategy.data_parallel_size" in msg


def test_trainer_refuses_bad_world_before_launch():
    # Raised while the Trainer is built, in the launching process: no rank ever starts.
    with pytest.raises(PipelineConfigError, match="data_parallel_size=2"):
        L.Trainer(strategy=PipelineStrategy(data_parallel_size=2), accelerator="cpu", devices=3, logger=False)
    with pytest.raises(PipelineConfigError, match="microbatches=1"):
        L.Trainer(strategy=PipelineStrategy(schedule="1f1b", microbatches=1), accelerator="cpu", devices=2,
                  logger=False)


def test_topology_puts_pipeline_innermost():
    t = Topology.create(4, 2, global_rank=3)
    assert (t.pipeline_size, t.dp_rank, t.pp_rank) == (2, 1, 1)
    assert t.pp_group_ranks(1) == [2, 3] and t.dp_group_ranks(1) == [1, 3]


def test_string_strategy_is_registered():
    trainer = L.Trainer(strategy="pipeline", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, PipelineStrategy)
    assert isinstance(trainer.strategy.precision_plugin, lightning_pipe.PipelinePrecision)
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}


def test_unsupported_precision_is_refused_with_the_key():
    with pytest.raises(PipelineConfigError, match=r"DoublePrecision.*'64-true'.*trainer.precision"):
        L.Trainer(strategy="pipeline", accelerator="cpu", devices=2, precision="64-true", logger=False)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true", "16-true"])
def test_lightning_precision_plugins_are_converted(precision):
    trainer = L.Trainer(strategy="pipeline", accelerator="cpu", devices=2, precision=precision, logger=False)
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, lightning_pipe.PipelinePrecision) and plugin.precision == precision
    assert trainer.precision_plugin is plugin


def test_recompute_setting():
    assert PipelineConfig(recompute="all").recompute_every == 1
    assert PipelineConfig(recompute=2).recompute_every == 2
    assert PipelineConfig().recompute_every is None
    with pytest.raises(PipelineConfigError, match=r"recompute='sometimes'.*strategy.recompute"):
        PipelineConfig(recompute="sometimes")
