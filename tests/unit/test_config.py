"""Settings are checked on plain data, early, with messages naming the rule, the values and the key."""

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

import lightning_pipe
from lightning_pipe import PipelineConfig, PipelineConfigError, PipelineStrategy
from lightning_pipe.config import SETTINGS, config_error, describe_setting
from lightning_pipe.parallel.topology import Topology
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


def test_partition_must_be_known_or_counts():
    with pytest.raises(PipelineConfigError, match=r"partition='balanced'.*Hydra: strategy.partition"):
        PipelineConfig(partition="balanced")
    assert PipelineConfig(partition=[1, 2]).partition == (1, 2)
    assert PipelineConfig(partition="Parameters").partition == "parameters"


@pytest.mark.parametrize(("bad", "seen"), [
    (3, "partition=3."),                                        # strategy.partition=3 from the shell
    ([3, "x"], "partition=[3, 'x'] (not a positive integer: ['x'])"),  # strategy.partition=[3,x]
    ([3, 0], "(not a positive integer: [0])"),
    ([3, 2.5], "(not a positive integer: [2.5])"),
    ([True, 3], "(not a positive integer: [True])"),
    ([], "partition=[]"),
    ({"a": 1}, "partition={'a': 1}"),
])
def test_malformed_partition_names_the_rule_and_setting(bad, seen):
    with pytest.raises(PipelineConfigError) as err:
        PipelineConfig(partition=bad)
    msg = str(err.value)
    assert "a list of positive per-stage layer counts" in msg and seen in msg, msg
    assert msg.endswith("Change `partition` (PipelineStrategy(partition=...); Hydra: strategy.partition).")
    with pytest.raises(PipelineConfigError):
        PipelineStrategy(partition=bad)


def test_every_setting_renders_its_python_and_hydra_forms():
    for name in SETTINGS:
        text = describe_setting(name)
        assert text.startswith(f"`{name}` (") and "; Hydra: " in text and text.endswith(")"), text
        # One level of parentheses: the hint never nests inside the key (design review, 4.1).
        assert "`" not in text[len(name) + 2:], text
    assert SETTINGS["schedule_options"].hydra == ("schedule.options",)
    assert SETTINGS["recompute"].hydra == ("strategy.recompute",)
    assert describe_setting("trainer.something") == "`trainer.something`"
    msg = str(config_error("Rule.", "x=1", "microbatches", "e.g. 4", also=("batch_size",)))
    assert msg == ("Rule. Got x=1. Change `microbatches` (PipelineStrategy(microbatches=...); Hydra: "
                   "schedule.microbatches), or `batch_size` (DataLoader(batch_size=...); Hydra: data.batch_size); "
                   "e.g. 4.")


def test_options_a_schedule_does_not_take_are_refused_at_construction():
    with pytest.raises(PipelineConfigError) as err:
        PipelineStrategy(schedule="1f1b", schedule_options={"actions": [["0F0", "0B0"], ["1F0", "1B0"]]})
    msg = str(err.value)
    assert "Schedule '1f1b' takes no options" in msg and "['actions']" in msg
    assert "Hydra: schedule.options" in msg and "Hydra: schedule=<name>" in msg
    with pytest.raises(PipelineConfigError, match=r"'custom' takes only the options \['actions', 'csv', 'placement'\]"
                                                  r".*\['action'\]"):
        PipelineStrategy(schedule="custom", schedule_options={"action": [["0F0", "0B0"]]})
    with pytest.raises(PipelineConfigError, match="takes no options"):
        plan_schedule(PipelineConfig(schedule="gpipe", schedule_options={"csv": "x.csv"}), 2)
    # A null entry is absent (Hydra configs ship `csv: null`): not an option given to the schedule.
    assert PipelineConfig(schedule="1f1b", schedule_options={"csv": None}).schedule_options == {}
    PipelineStrategy(schedule="1f1b", schedule_options={"actions": None})
    with pytest.raises(PipelineConfigError, match=r"mapping.*Hydra: schedule.options"):
        PipelineConfig(schedule_options=["actions"])


def test_world_not_divisible_by_data_parallel():
    with pytest.raises(PipelineConfigError) as err:
        Topology.create(world_size=3, data_parallel_size=2, global_rank=0)
    msg = str(err.value)
    assert "world_size=3" in msg and "data_parallel_size=2" in msg and "strategy.data_parallel_size" in msg


def test_torchrun_with_other_devices_is_lightnings_clear_error(monkeypatch):
    """torchrun started 4 processes, the Trainer says devices=2: Lightning's own rule, at Trainer construction (it
    was an IndexError at setup, indexing the 2 devices by local rank 2)."""
    for key, value in dict(TORCHELASTIC_RUN_ID="t", WORLD_SIZE="4", RANK="2", LOCAL_RANK="2", GROUP_RANK="0",
                           LOCAL_WORLD_SIZE="4").items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=r"devices=2.*does not match the world size \(4\)"):
        L.Trainer(strategy=PipelineStrategy(data_parallel_size=2), accelerator="cpu", devices=2, logger=False)


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
    with pytest.raises(PipelineConfigError, match=r"DoublePrecision.*'64-true'.*Hydra: trainer.precision"):
        L.Trainer(strategy="pipeline", accelerator="cpu", devices=2, precision="64-true", logger=False)
    with pytest.raises(PipelineConfigError, match=r"precision='64-true'.*Hydra: trainer.precision"):
        lightning_pipe.PipelinePrecision("64-true")  # type: ignore[arg-type]


def test_refused_precision_plugin_keeps_its_reason():
    # "16-mixed" is supported; what is refused is the custom scaler, and the message must say so (review D6).
    class MyScaler(torch.amp.GradScaler):
        pass

    strategy = PipelineStrategy()
    with pytest.raises(PipelineConfigError) as err:
        strategy.precision_plugin = MixedPrecision("16-mixed", "cpu", scaler=MyScaler("cpu"))
    msg = str(err.value)
    assert "precision='16-mixed'" in msg and "custom GradScaler (MyScaler) cannot be carried over" in msg, msg
    assert "Hydra: trainer.precision" in msg and "PipelinePrecision(...)" in msg


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


def test_stray_parameter_error_says_to_move_it_into_a_layer():
    from torch import nn

    from lightning_pipe.layers.stages import check_no_stray_parameters

    model = nn.Module()
    model.layers = nn.Sequential(nn.Linear(2, 2))
    model.scale = nn.Parameter(torch.ones(1))
    with pytest.raises(PipelineConfigError) as err:
        check_no_stray_parameters(model, "layers")
    msg = str(err.value)
    # The cure (move it into a layer) comes first; layers_attr is the secondary hint.
    assert "Got parameters outside `layers`: ['scale']" in msg
    assert msg.index("Move each of them into a layer") < msg.index("Or change `layers_attr`"), msg
    assert "Hydra: strategy.layers_attr" in msg


def test_a_memory_budget_is_read_by_the_planner_only() -> None:
    """memory_budget applies to schedule="auto" and partition="time" / "memory"; with a fixed schedule and split
    nothing would read it, so it is refused (it was silently ignored), however it is passed."""
    for kwargs in ({"memory_budget": "1GiB"}, {"schedule_options": {"memory_budget": "1GiB"}}):
        with pytest.raises(PipelineConfigError, match=r"memory_budget limits what the planner picks.*Got "
                                                      r"memory_budget='1GiB' with schedule='1f1b', partition='uniform'"):
            PipelineStrategy(schedule="1f1b", microbatches=4, **kwargs)
    PipelineStrategy(schedule="auto", memory_budget="1GiB")
    PipelineStrategy(schedule="1f1b", microbatches=4, partition="time", memory_budget="1GiB")
    with pytest.raises(PipelineConfigError, match=r"known schedules are \[.*\], and 'auto' \(the planner picks one\)"):
        PipelineStrategy(schedule="zbvv")
