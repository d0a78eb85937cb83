"""FSDP settings and the mesh's rank order, on plain data: no process group, no launch."""

import lightning.pytorch as L
import pytest

from lightning_pipe import PipelineConfig, PipelineConfigError, PipelineStrategy
from lightning_pipe.layers.stages import TiedParameter
from lightning_pipe.parallel.fsdp import check_schedule, check_ties
from lightning_pipe.parallel.topology import Topology
from lightning_pipe.schedules import get_schedule_spec


def test_rank_order_is_replicate_pipeline_shard():
    """[Note: rank order]: rank = (replica * pipeline_size + pp_rank) * fsdp_size + shard."""
    world = 8
    seen = set()
    for rank in range(world):
        t = Topology.create(world, data_parallel_size=2, global_rank=rank, fsdp_size=2)
        assert t.pipeline_size == 2 and t.dp_degree == 4
        assert rank == (t.replica_rank * 2 + t.pp_rank) * 2 + t.shard_rank
        assert t.dp_rank == t.replica_rank * 2 + t.shard_rank
        assert t.rank_of(t.dp_rank, t.pp_rank) == rank
        assert rank in t.pp_group_ranks(t.dp_rank) and rank in t.dp_group_ranks(t.pp_rank)
        seen.add((t.dp_rank, t.pp_rank))
    assert len(seen) == world
    t = Topology.create(world, 2, global_rank=0, fsdp_size=2)
    assert t.pp_group_ranks(0) == [0, 2] and t.pp_group_ranks(1) == [1, 3] and t.pp_group_ranks(3) == [5, 7]
    assert t.dp_group_ranks(0) == [0, 1, 4, 5] and t.dp_group_ranks(1) == [2, 3, 6, 7]


def test_rank_order_with_fsdp_and_tensor_parallel():
    """[Note: rank order] with all four dimensions: rank = ((replica * p + pp) * fsdp + shard) * tp + t. A pipeline
    is the ranks with equal (replica, shard, tensor rank); a data-parallel group has equal (stage, tensor rank)."""
    world = 16
    seen = set()
    for rank in range(world):
        t = Topology.create(world, data_parallel_size=2, global_rank=rank, fsdp_size=2, tensor_parallel_size=2)
        assert t.pipeline_size == 2 and t.dp_degree == 4
        assert rank == ((t.replica_rank * 2 + t.pp_rank) * 2 + t.shard_rank) * 2 + t.tp_rank
        assert t.dp_rank == t.replica_rank * 2 + t.shard_rank
        assert t.rank_of(t.dp_rank, t.pp_rank, t.tp_rank) == rank
        seen.add((t.dp_rank, t.pp_rank, t.tp_rank))
    assert len(seen) == world
    t = Topology.create(world, 2, global_rank=0, fsdp_size=2, tensor_parallel_size=2)
    assert t.pp_group_ranks(0, 0) == [0, 4] and t.pp_group_ranks(1, 1) == [3, 7]
    assert t.dp_group_ranks(0, 0) == [0, 2, 8, 10] and t.dp_group_ranks(1, 1) == [5, 7, 13, 15]


def test_without_fsdp_the_pipeline_x_replicas_order_is_unchanged():
    for rank in range(6):
        t = Topology.create(6, 3, global_rank=rank)
        assert (t.dp_rank, t.pp_rank, t.dp_degree) == (rank // 2, rank % 2, 3)
        assert t.rank_of(t.dp_rank, t.pp_rank) == rank and t.shard_rank == 0


def test_fsdp_settings_are_checked_early():
    with pytest.raises(PipelineConfigError, match=r"fsdp_size=0.*Hydra: strategy.fsdp_size"):
        PipelineConfig(fsdp_size=0)
    with pytest.raises(PipelineConfigError, match=r"fsdp_reshard_after_forward='yes'"):
        PipelineConfig(fsdp_reshard_after_forward="yes")  # type: ignore[arg-type]
    with pytest.raises(PipelineConfigError) as err:
        Topology.create(world_size=6, data_parallel_size=1, global_rank=0, fsdp_size=4)
    assert "fsdp_size=4" in str(err.value) and "strategy.fsdp_size" in str(err.value)
    with pytest.raises(PipelineConfigError, match="planner does not model FSDP"):
        PipelineStrategy(schedule="auto", fsdp_size=2)
    # refused while the Trainer is built, before any rank starts
    with pytest.raises(PipelineConfigError, match="data_parallel_size x fsdp_size"):
        L.Trainer(strategy=PipelineStrategy(data_parallel_size=2, fsdp_size=2), accelerator="cpu", devices=6,
                  logger=False)


def test_sampler_shards_over_replicas_and_fsdp_ranks():
    strategy = PipelineStrategy(data_parallel_size=2, fsdp_size=2)
    L.Trainer(strategy=strategy, accelerator="cpu", devices=8, logger=False)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 4, "rank": 0}


def test_ties_on_one_rank_are_refused_with_fsdp():
    tie = TiedParameter(("layers.0.weight", "layers.7.weight"), (0, 7))
    check_ties([tie], {i: 0 if i < 4 else 1 for i in range(8)})  # across ranks: supported
    with pytest.raises(PipelineConfigError) as err:
        check_ties([tie], {i: 0 if i in (0, 1, 6, 7) else 1 for i in range(8)})  # V placement: both on rank 0
    msg = str(err.value)
    assert "layers.0.weight" in msg and "rank(s) [0]" in msg and "strategy.fsdp_size" in msg


def test_weight_version_schedules_are_refused_with_fsdp():
    check_schedule("zbv", get_schedule_spec("zbv").stage_class)
    spec = get_schedule_spec("pipedream_2bw")
    with pytest.raises(PipelineConfigError, match=r"weight versions.*Hydra: strategy.fsdp_size"):
        check_schedule(spec.name, spec.stage_class)
