"""Partitioning is plain data: layer counts / parameter counts in, contiguous ranges out."""

import pytest

from lightning_pipe import PipelineConfigError
from lightning_pipe.layers.partition import balanced_counts, partition_layers, uniform_counts


def test_uniform_gives_extra_layers_to_the_first_stages():
    assert uniform_counts(10, 4) == [3, 3, 2, 2]
    assert uniform_counts(8, 2) == [4, 4]
    assert [list(r) for r in partition_layers(5, 2, "uniform")] == [[0, 1, 2], [3, 4]]


def test_parameters_partition_balances_the_heaviest_stage():
    # a heavy embedding and head around light blocks: uniform would give 4 + 4 layers, balanced isolates them
    assert balanced_counts([100, 10, 10, 10, 10, 10, 10, 100], 2) == [4, 4]
    assert balanced_counts([100, 10, 10, 10, 10, 10, 10, 100], 3) == [1, 6, 1]
    assert balanced_counts([1] * 8, 4) == [2, 2, 2, 2]
    assert balanced_counts([5, 1, 1, 1, 1, 5], 3) == [1, 4, 1]


def test_parameters_partition_is_optimal_on_small_cases():
    import itertools

    costs = [3, 1, 4, 1, 5, 9, 2, 6]
    for k in (2, 3, 4):
        got = balanced_counts(costs, k)
        best = min(
            max(sum(costs[a:b]) for a, b in zip((0,) + cut, cut + (len(costs),)))
            for cut in itertools.combinations(range(1, len(costs)), k - 1)
        )
        bounds = [0]
        for c in got:
            bounds.append(bounds[-1] + c)
        assert max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])) == best
        assert min(got) >= 1


def test_explicit_partition():
    assert [len(r) for r in partition_layers(6, 2, [2, 4])] == [2, 4]


def test_explicit_partition_must_sum_to_layer_count():
    with pytest.raises(PipelineConfigError) as err:
        partition_layers(6, 2, [2, 3])
    msg = str(err.value)
    assert "sum to the number of layers" in msg and "[2, 3]" in msg and "6 layers" in msg and "Hydra: strategy.partition" in msg


def test_explicit_partition_needs_one_count_per_stage():
    with pytest.raises(PipelineConfigError, match=r"one layer count per stage.*3 counts.*2 stages.*Hydra: strategy.partition"):
        partition_layers(6, 2, [2, 2, 2])


def test_explicit_partition_is_checked_like_the_config():
    with pytest.raises(PipelineConfigError, match=r"partition=\[3, 'x'\].*Hydra: strategy.partition"):
        partition_layers(6, 2, [3, "x"])


def test_more_stages_than_layers_is_refused():
    with pytest.raises(PipelineConfigError) as err:
        partition_layers(3, 4, "uniform")
    msg = str(err.value)
    assert "4 stages for 3 layers" in msg and "cannot exceed the number of layers" in msg
    assert "Hydra: schedule.stages_per_rank" in msg and "Hydra: strategy.data_parallel_size" in msg
    assert "Hydra: trainer.devices / trainer.num_nodes" in msg


def test_parameter_partition_counts_a_tied_weight_once():
    from lightning_pipe.layers.partition import layer_param_counts as _param_counts
    from tests.models import ToyRegressor

    counts = _param_counts(ToyRegressor(n_layers=4, tied=True).layers)
    assert counts[0] == 4 * (4 * 8 + 8)  # the input projection owns the tied weight (trainable: 4 per element)
    assert counts[-1] == 4 * 4  # the tied head adds only its bias


def test_parameter_partition_counts_a_frozen_parameter_a_quarter() -> None:
    """A frozen element costs its weight only; a trainable one its weight, gradient and AdamW's two moments."""
    from torch import nn

    from lightning_pipe.layers.partition import layer_param_counts

    layers = [nn.Linear(10, 10, bias=False) for _ in range(8)]
    assert layer_param_counts(layers) == [400] * 8
    for layer in layers[:6]:
        layer.requires_grad_(False)
    counts = layer_param_counts(layers)
    assert counts == [100] * 6 + [400] * 2
    # two stages: six frozen | two trainable (600 | 800) is the best split; plain counts would split 4 | 4
    assert [len(r) for r in partition_layers(8, 2, "parameters", counts)] == [6, 2]
    assert [len(r) for r in partition_layers(8, 2, "parameters", [100] * 8)] == [4, 4]
