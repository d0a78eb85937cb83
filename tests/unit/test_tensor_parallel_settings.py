"""Tensor-parallel settings and the mesh's rank order with a ``tensor`` dimension, on plain data: no launch."""

import lightning.pytorch as L
import pytest

from lightning_pipe import PipelineConfig, PipelineConfigError, PipelineStrategy
from lightning_pipe.parallel.tensor_parallel import check_module
from lightning_pipe.parallel.topology import Topology
from lightning_pipe.runtime.spec import ScheduleSpec
from lightning_pipe.schedules import available_schedules, get_schedule_spec, registry
from tests.models import TensorParallelRegressor, ToyRegressor
from tests.torch_tiers import SPLIT_BACKWARD_SCHEDULES, needs, refused_here


def test_rank_order_puts_tensor_innermost():
    """[Note: rank order]: rank = ((replica * p + pp) * fsdp + shard) * tp + t; tensor ranks are not data-parallel."""
    world = 8
    seen = set()
    for rank in range(world):
        t = Topology.create(world, data_parallel_size=2, global_rank=rank, tensor_parallel_size=2)
        assert t.pipeline_size == 2 and t.dp_degree == 2
        assert rank == (t.replica_rank * 2 + t.pp_rank) * 2 + t.tp_rank
        assert t.dp_rank == t.replica_rank
        assert t.rank_of(t.dp_rank, t.pp_rank, t.tp_rank) == rank
        assert rank in t.pp_group_ranks(t.dp_rank, t.tp_rank) and rank in t.dp_group_ranks(t.pp_rank, t.tp_rank)
        seen.add((t.dp_rank, t.pp_rank, t.tp_rank))
    assert len(seen) == world
    t = Topology.create(world, 2, global_rank=0, tensor_parallel_size=2)
    # a pipeline: equal (replica, tensor rank); replicas: equal (stage, tensor rank)
    assert t.pp_group_ranks(0, 0) == [0, 2] and t.pp_group_ranks(0, 1) == [1, 3] and t.pp_group_ranks(1, 1) == [5, 7]
    assert t.dp_group_ranks(0, 0) == [0, 4] and t.dp_group_ranks(1, 1) == [3, 7]
    # tensor_parallel_size=1: the pipeline x replicas order
    for rank in range(6):
        t = Topology.create(6, 3, global_rank=rank)
        assert (t.dp_rank, t.pp_rank, t.tp_rank) == (rank // 2, rank % 2, 0)


def test_tensor_parallel_settings_are_checked_early(monkeypatch):
    with pytest.raises(PipelineConfigError, match=r"tensor_parallel_size=0.*Hydra: strategy.tensor_parallel_size"):
        PipelineConfig(tensor_parallel_size=0)
    # every built-in schedule runs tensor-parallel stages (tests/distributed/test_tensor_parallel.py) but PipeMare,
    # whose backward rebuilds saved weights from plain parameters' storage (schedules/pipemare/stages.py) ...
    tensor_parallel = [schedule for schedule in available_schedules() if schedule != "pipemare"]
    assert all(get_schedule_spec(schedule).tensor_parallel for schedule in tensor_parallel)
    with pytest.raises(PipelineConfigError, match="Tensor parallelism runs with the schedules.*'pipemare' is not"):
        PipelineStrategy(tensor_parallel_size=2, schedule="pipemare")
    for schedule in tensor_parallel:
        with refused_here("split_backward", schedule in SPLIT_BACKWARD_SCHEDULES):  # restricted torch tier
            PipelineStrategy(tensor_parallel_size=2, schedule=schedule)
    # ... one registered by an extension is refused until verified (in the strategy's constructor: before any rank)
    spec = get_schedule_spec("1f1b")
    monkeypatch.setitem(registry._SCHEDULES, "my_schedule",
                        ScheduleSpec("my_schedule", spec.torch_class, "an extension's schedule"))
    with pytest.raises(PipelineConfigError, match="Tensor parallelism runs with the schedules.*'my_schedule' is not"):
        PipelineStrategy(tensor_parallel_size=2, schedule="my_schedule")
    with pytest.raises(PipelineConfigError, match="planner does not model tensor parallelism"):
        PipelineStrategy(schedule="auto", tensor_parallel_size=2)
    with pytest.raises(PipelineConfigError, match="planner does not model tensor parallelism"):
        PipelineStrategy(tensor_parallel_size=2, rebalance_every_n_steps=5)
    with pytest.raises(PipelineConfigError, match="data_parallel_size x fsdp_size x tensor_parallel_size"):
        L.Trainer(strategy=PipelineStrategy(tensor_parallel_size=4), accelerator="cpu", devices=6, logger=False)


def test_sampler_counts_replicas_not_tensor_ranks():
    strategy = PipelineStrategy(data_parallel_size=2, tensor_parallel_size=2)
    L.Trainer(strategy=strategy, accelerator="cpu", devices=8, logger=False)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}


def test_module_without_hook_is_refused():
    with pytest.raises(PipelineConfigError, match="parallelize_layer"):
        check_module(ToyRegressor(), 2)
    check_module(TensorParallelRegressor(), 2)


def test_fsdp_and_tensor_parallel_together():
    """2-D sharding per stage: accepted for the tensor-parallel schedules; the data is sharded over replicas x FSDP
    shards, never over tensor ranks."""
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
        PipelineConfig(tensor_parallel_size=2, fsdp_size=2, schedule=schedule)
    strategy = PipelineStrategy(data_parallel_size=2, fsdp_size=2, tensor_parallel_size=2)
    L.Trainer(strategy=strategy, accelerator="cpu", devices=16, logger=False)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 4, "rank": 0}
    with pytest.raises(PipelineConfigError, match="data_parallel_size x fsdp_size x tensor_parallel_size"):
        L.Trainer(strategy=PipelineStrategy(fsdp_size=2, tensor_parallel_size=2), accelerator="cpu", devices=6,
                  logger=False)


@needs("strided_shard")
def test_fused_split_keeps_blocks_and_fsdp_refuses_it(tmp_path):
    """FusedColwiseParallel puts a strided placement on the fused weight and bias (on one rank: everything, still
    strided), and the FSDP path refuses such a parameter with the rule. (A one-rank gloo group: DTensors need one.)"""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_pipe import FusedColwiseParallel
    from lightning_pipe.parallel.tensor_parallel import check_fsdp_can_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        layer = nn.Sequential(nn.Linear(4, 12))
        whole = layer[0].weight.detach().clone()
        x = torch.randn(2, 4)
        expected = layer(x)
        parallelize_module(layer, init_device_mesh("cpu", (1,)), {"0": FusedColwiseParallel(3)})
        torch.testing.assert_close(layer(x), expected)
        torch.testing.assert_close(layer[0].weight.full_tensor(), whole)
        with pytest.raises(PipelineConfigError, match=r"strided placement.*layer 5 \(Sequential\): 0\.weight"):
            check_fsdp_can_shard(5, layer)
        with pytest.raises(ValueError, match="out_features must be divisible by 3"):
            parallelize_module(nn.Linear(4, 10), init_device_mesh("cpu", (1,)), FusedColwiseParallel(3))
    finally:
        dist.destroy_process_group()
