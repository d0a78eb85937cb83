"""Elastic worlds on plain data ([Note: elastic worlds]): the layout the strategy takes when torchrun's elastic
agent gives another number of nodes than ``Trainer(num_nodes=...)``."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from lightning.fabric.plugins.environments import TorchElasticEnvironment

from lightning_pipe import PipelineStrategy
from lightning_pipe.config import PipelineConfig, PipelineConfigError
from lightning_pipe.lightning.elastic import elastic_world


def _torchrun(monkeypatch: pytest.MonkeyPatch, world: int, per_node: int, rank: int = 0) -> None:
    for key, value in {"WORLD_SIZE": world, "LOCAL_WORLD_SIZE": per_node, "RANK": rank, "LOCAL_RANK": rank % per_node,
                       "GROUP_RANK": rank // per_node, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": 29500,
                       "TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": 1}.items():
        monkeypatch.setenv(key, str(value))


@pytest.mark.parametrize(("planned_nodes", "per_node", "given_nodes", "config", "depth", "replicas"), [
    (2, 1, 1, PipelineConfig(), 1, 1),                                # two 1-rank hosts, one lost: no pipeline left
    (2, 2, 1, PipelineConfig(), 2, 1),                                # pipeline 4 over 2 hosts -> pipeline 2
    (2, 2, 1, PipelineConfig(data_parallel_size=2), 2, 1),             # a replica per host: one replica lost
    (4, 2, 3, PipelineConfig(data_parallel_size=2), 6, 1),             # 6 ranks hold no whole pipeline of 4
    (2, 4, 1, PipelineConfig(fsdp_size=2), 2, 1),                      # FSDP kept inside each host
    (2, 2, 4, PipelineConfig(), 4, 2),                                 # more hosts than planned: more replicas
])
def test_the_layout_follows_the_world(monkeypatch: pytest.MonkeyPatch, planned_nodes: int, per_node: int,
                                      given_nodes: int, config: PipelineConfig, depth: int, replicas: int) -> None:
    _torchrun(monkeypatch, given_nodes * per_node, per_node)
    world = elastic_world(TorchElasticEnvironment(), planned_nodes, per_node, config)
    assert world is not None and world.nodes == given_nodes
    assert (world.depth, world.config.data_parallel_size) == (depth, replicas)
    assert (world.config.fsdp_size, world.config.schedule) == (config.fsdp_size, config.schedule)


def test_the_planned_world_and_other_mismatches_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    _torchrun(monkeypatch, 4, 2)
    assert elastic_world(TorchElasticEnvironment(), 2, 2, PipelineConfig()) is None  # as planned
    assert elastic_world(TorchElasticEnvironment(), 2, 4, PipelineConfig()) is None  # devices != nproc-per-node
    assert elastic_world(None, 3, 2, PipelineConfig()) is None  # not a torchrun launch


def test_the_strategy_takes_torchruns_world_and_says_so(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Trainer(num_nodes=2, devices=2) restarted by torchrun on one node: Lightning's own check would refuse."""
    _torchrun(monkeypatch, 2, 2, rank=1)
    strategy = PipelineStrategy(schedule="1f1b", microbatches=4)
    trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=strategy, logger=False,
                         enable_progress_bar=False)
    strategy.set_world_ranks()
    assert (trainer.num_nodes, trainer.world_size, strategy.topology.pipeline_size) == (1, 2, 2)  # type: ignore[union-attr]


def test_a_world_no_layout_fits_is_refused_with_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensor parallelism 2 on hosts of 3 ranks: one host's 3 ranks hold no whole tensor-parallel group."""
    _torchrun(monkeypatch, 3, 3)
    strategy = PipelineStrategy(schedule="1f1b", microbatches=4, tensor_parallel_size=2)
    with pytest.raises(PipelineConfigError, match=r"torchrun gave 1 node\(s\) x 3 process\(es\) = 3 ranks, where "
                       r"Trainer\(num_nodes=2\) planned 6 .* no layout of this run fits it: .*tensor_parallel_size"):
        pl.Trainer(accelerator="cpu", devices=3, num_nodes=2, strategy=strategy, logger=False,
                   enable_progress_bar=False)
