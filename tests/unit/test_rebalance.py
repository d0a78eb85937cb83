"""The rebalance decision as plain data ([Note: layer cost versus rank speed], [Note: the predicted step time]),
the settings' checks, and the optimizer surgery of a move, without any process group."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipe.config import PipelineConfig, PipelineConfigError
from lightning_pipe.rebalance import check_rebalance
from lightning_pipe.rebalance.decide import LayerTime, Move, best_counts, decide, describe, moves_between, rank_slowness
from lightning_pipe.rebalance.move import _update_optimizers
from lightning_pipe.schedules import plan_schedule


def times(seconds: list[float], counts: list[int], kinds: list[str] | None = None) -> list[LayerTime]:
    ranks = [r for r, c in enumerate(counts) for _ in range(c)]
    kinds = kinds or ["block"] * len(seconds)
    return [LayerTime(i, r, k, s) for i, (s, r, k) in enumerate(zip(seconds, ranks, kinds))]


def test_a_slow_layer_moves_and_nothing_else() -> None:
    d = decide(times([1, 1, 1, 1, 1, 4, 1, 1], [6, 2]), (6, 2), [0, 1], 2, threshold=0.05)
    assert d.speeds == (1.0, 1.0)  # one slow layer among equals is the layer's cost, not its rank's
    assert d.proposed == (5, 3) and d.moves == (Move(5, 0, 1),)
    assert d.current_time == 9 and d.proposed_time == 6 and d.gain == pytest.approx(1 / 3)
    lines = describe(d, step=40)
    assert lines[0].startswith("PipelineStrategy rebalance at step 40: split [6, 2] -> [5, 3]")
    assert lines[1:] == ["  layer 5: pipeline rank 0 -> 1"]


def test_a_slowed_rank_keeps_fewer_layers() -> None:
    d = decide(times([1, 1, 1, 1, 4, 4, 4, 4], [4, 4]), (4, 4), [0, 1], 2, threshold=0.05)
    assert d.speeds == (1.0, 4.0)
    assert d.costs == (1.0,) * 8
    assert d.proposed == (7, 1) and d.proposed_time == 7 and d.current_time == 16


def test_a_slow_layer_next_to_one_other_is_still_the_layers() -> None:
    # after the move: rank 1 holds the slow block and one normal block (and the head)
    d = decide(times([0.1, 1, 1, 1, 1, 4, 1, 0.1], [5, 3], ["embed", *["block"] * 6, "head"]), (5, 3), [0, 1], 2,
               threshold=0.05)
    assert d.speeds == (1.0, 1.0) and not d.rebalance


def test_unique_kinds_say_nothing_about_speed() -> None:
    # an embedding and a head (one of a kind) are their own cost; the blocks on both ranks set the speeds
    seconds = [9, 1, 1, 1, 1, 1, 1, 0.1]
    kinds = ["embed", *["block"] * 6, "head"]
    assert rank_slowness(times(seconds, [4, 4], kinds), 2) == [1.0, 1.0]


def test_no_move_below_the_threshold() -> None:
    d = decide(times([1, 1, 1, 1.1, 1, 1, 1, 1], [4, 4]), (4, 4), [0, 1], 2, threshold=0.05)
    assert not d.rebalance and d.moves == () and d.proposed == (4, 4)


def test_best_counts_is_exact_and_keeps_a_layer_per_stage() -> None:
    assert best_counts([1] * 8, [1, 1, 1, 1]) == (2, 2, 2, 2)
    assert best_counts([10, 1, 1, 1], [1, 1]) == (1, 3)
    assert best_counts([1, 1, 1], [1, 1, 100]) == (1, 1, 1)


def test_moves_between_stages_of_one_rank_are_no_moves() -> None:
    # V placement on 2 ranks: stages 1 and 2 both live on rank 1
    assert moves_between((2, 2, 2, 2), (2, 1, 3, 2), [0, 1, 1, 0]) == ()
    assert moves_between((2, 2, 2, 2), (3, 1, 2, 2), [0, 1, 1, 0]) == (Move(2, 1, 0),)


@pytest.mark.parametrize(("kwargs", "key"), [({"rebalance_every_n_steps": 0}, "rebalance_every_n_steps"),
                                             ({"rebalance_every_n_steps": 2.5}, "rebalance_every_n_steps"),
                                             ({"rebalance_threshold": 1.0}, "rebalance_threshold"),
                                             ({"rebalance_threshold": -0.1}, "rebalance_threshold")])
def test_bad_settings_are_refused_naming_the_key(kwargs: dict, key: str) -> None:
    with pytest.raises(PipelineConfigError, match=f"strategy.{key}"):
        PipelineConfig(**kwargs)


def test_weight_versioned_schedules_refuse_rebalancing() -> None:
    config = PipelineConfig(schedule="1f1b", rebalance_every_n_steps=10)
    check_rebalance(config, plan_schedule(config, 2))  # fine
    versioned = plan_schedule(PipelineConfig(schedule="1f1b"), 2)
    versioned = type(versioned)(**{**versioned.__dict__, "spec": type(versioned.spec)(
        **{**versioned.spec.__dict__, "stage_class": object})})
    with pytest.raises(PipelineConfigError, match="weight versions"):
        check_rebalance(config, versioned)


def test_optimizer_surgery_keeps_groups_and_state() -> None:
    """Leaving parameters lose their group entry and state; arrivals join their old group with their state; a tied
    arrival that this rank already holds is not added twice."""
    kept, gone = nn.Linear(2, 2), nn.Linear(2, 2)
    module = nn.Sequential(kept)
    opt = torch.optim.Adam([{"params": list(kept.parameters())}, {"params": list(gone.parameters()), "lr": 0.5}])
    for p in [*kept.parameters(), *gone.parameters()]:
        p.grad = torch.ones_like(p)
    opt.step()
    arriving = nn.Linear(2, 2)
    arriving.weight = kept.weight  # tied with a parameter this rank holds
    module.append(arriving)
    state = {"step": (torch.tensor(3.0), True), "exp_avg": (torch.full((2,), 7.0), True)}
    entries = {"weight": ((0, 1), state), "bias": ((0, 1), state)}
    _update_optimizers(module, [opt], [(1, arriving, entries)])
    assert [len(g["params"]) for g in opt.param_groups] == [2, 1]
    assert opt.param_groups[1]["params"][0] is arriving.bias and opt.param_groups[1]["lr"] == 0.5
    assert torch.equal(opt.state[arriving.bias]["exp_avg"], torch.full((2,), 7.0))
    assert all(p not in opt.state for p in gone.parameters())
    assert len(opt.state) == 3


def test_layer_timer_detach_keeps_wrappers_installed_before_it() -> None:
    """rebalance/measure.LayerTimer hooks the stage methods (runtime.stage.CallHooks); detaching puts back what was
    there (e.g. an earlier instance wrapper), not the class method."""
    from types import SimpleNamespace

    from lightning_pipe.rebalance.measure import LayerTimer
    from lightning_pipe.runtime.stage import CallHooks

    class Stage(CallHooks):
        stage_index = 0

        def forward_one_chunk(self) -> str:
            return "class"

        backward_one_chunk = backward_weight_one_chunk = forward_one_chunk

    stage = Stage()
    stage.forward_one_chunk = lambda: "earlier wrapper"  # type: ignore[method-assign]
    engine = SimpleNamespace(device="cpu", stage_modules=[], stages=[stage], step_contexts=[], inferring=False)
    timer = LayerTimer(engine).attach()
    assert stage.forward_one_chunk() == "earlier wrapper" and "backward_one_chunk" in vars(stage)
    timer.detach()
    assert stage.forward_one_chunk() == "earlier wrapper"
    assert "backward_one_chunk" not in vars(stage) and engine.step_contexts == []


class Act(nn.Module):
    """A module-level layer class holding a local function (an activation made by a factory)."""

    def __init__(self) -> None:
        super().__init__()

        def relu(x):
            return torch.relu(x)

        self.fn = relu

    def forward(self, x):
        return self.fn(x)


def test_a_layer_that_cannot_move_is_refused_at_setup_naming_it() -> None:
    """Rebalancing sends layers with torch.save: a layer holding a local function (or a hook that is one) would
    fail at the first move, possibly hours in. The setup check pickles what torch.save pickles, without the bytes."""
    import io

    from lightning_pipe.config import PipelineConfigError
    from lightning_pipe.rebalance.move import check_movable

    holder = nn.Module()
    holder.layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), Act())
    with pytest.raises(Exception, match="local object"):
        torch.save(holder.layers[2], io.BytesIO())  # what the first move would meet
    with pytest.raises(PipelineConfigError) as err:
        check_movable(holder, "layers", 4)
    message = str(err.value)
    assert "layer 2 (Act)" in message and "local object" in message and "rebalance_every_n_steps=4" in message
    assert "change `rebalance_every_n_steps`" in message and "strategy.rebalance_every_n_steps" in message, message
    holder.layers[2] = nn.ReLU()
    holder.layers[0].register_forward_hook(lambda m, i, o: None)  # a hook is pickled with its layer too
    with pytest.raises(PipelineConfigError, match="layer 0 \\(Linear\\)"):
        check_movable(holder, "layers", 4)
    holder.layers[0] = nn.Linear(4, 4)
    with torch.device("meta"):
        holder.layers[1] = nn.Linear(4, 4)  # built on meta (configure_model): nothing to read, still checked
    check_movable(holder, "layers", 4)


def test_the_strategy_checks_layers_before_the_split_only_when_a_fit_rebalances() -> None:
    from types import SimpleNamespace

    from lightning.pytorch.trainer.states import TrainerFn

    from lightning_pipe import PipelineStrategy
    from lightning_pipe.config import PipelineConfigError
    from lightning_pipe.lightning.rebalancing import check_before_split

    module = nn.Module()
    module.layers = nn.Sequential(nn.Linear(4, 4), Act())
    fit, validate = (SimpleNamespace(state=SimpleNamespace(fn=fn)) for fn in (TrainerFn.FITTING, TrainerFn.VALIDATING))
    rebalancing = SimpleNamespace(pipeline_config=PipelineStrategy(rebalance_every_n_steps=2).pipeline_config,
                                  lightning_module=module)
    with pytest.raises(PipelineConfigError, match=r"layer 1 \(Act\).*rebalance_every_n_steps=2"):
        check_before_split(rebalancing, fit)
    check_before_split(rebalancing, validate)  # nothing moves outside fit
    check_before_split(SimpleNamespace(pipeline_config=PipelineStrategy().pipeline_config, lightning_module=module), fit)
