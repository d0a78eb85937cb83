"""Two "nodes" on one machine: two ``torchrun --nnodes 2`` launches of 2 ranks each, pipeline 2 x replicas 2 with
Lightning's ``num_nodes=2``, equal to one device; and SLURM's environment giving the right topology (no processes).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment

from lightning_pipe import PipelineStrategy
from tests.distributed.launcher import REPO, _free_port, child_env
from tests.distributed.multinode_data import STEPS, make_model, reference_loader

TIMEOUT_S = 240


def _reference() -> dict[str, torch.Tensor]:
    model = make_model()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, reference_loader())
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.distributed
@pytest.mark.parity
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_two_torchrun_nodes_train_pipeline_times_replicas_like_one_device(tmp_path: Path) -> None:
    port = _free_port()
    env = child_env()
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        env.pop(key, None)
    procs, logs = [], []
    for node in range(2):
        log = open(tmp_path / f"node{node}.log", "w")
        logs.append(log)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
               "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
               str(REPO / "tests" / "distributed" / "multinode_script.py"), str(tmp_path)]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        hung = [p for p in procs if p.poll() is None]
        for p in hung:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for log in logs:
            log.close()
    tails = "\n".join(f"--- node {n} ---\n" + "\n".join((tmp_path / f"node{n}.log").read_text().splitlines()[-30:])
                      for n in range(2))
    assert not hung, f"torchrun nodes still running after {TIMEOUT_S}s (hang?)\n{tails}"
    assert [p.returncode for p in procs] == [0, 0], tails

    results = [torch.load(tmp_path / f"result{r}.pt", weights_only=False) for r in range(4)]
    # Global rank = node_rank x 2 + local rank; pipeline innermost: rank r is stage-rank r % 2 of replica r // 2.
    assert [(r["node_rank"], r["pp_rank"], r["dp_rank"]) for r in results] == [(0, 0, 0), (0, 1, 0), (1, 0, 1),
                                                                               (1, 1, 1)]
    assert {r["cluster"] for r in results} == {"TorchElasticEnvironment"}
    assert {r["world_size"] for r in results} == {4}
    reference = _reference()
    for replica in range(2):
        merged: dict[str, torch.Tensor] = {}
        for r in results[2 * replica: 2 * replica + 2]:
            assert not set(merged) & set(r["params"]), "a parameter held by two pipeline ranks"
            merged.update(r["params"])
        assert sorted(merged) == sorted(reference)
        for name, value in reference.items():
            torch.testing.assert_close(merged[name], value, atol=1e-5, rtol=0, msg=f"replica {replica}: {name}")


SLURM_ENV = {"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "2", "SLURM_JOB_NAME": "train",
             "SLURM_NODELIST": "node[7-8]", "SLURM_JOB_ID": "1234"}


@pytest.mark.parametrize(("procid", "localid", "nodeid", "pp_rank", "dp_rank"),
                         [(0, 0, 0, 0, 0), (1, 1, 0, 1, 0), (2, 0, 1, 0, 1), (3, 1, 1, 1, 1)])
def test_slurm_environment_gives_the_topology(monkeypatch: pytest.MonkeyPatch, procid: int, localid: int,
                                              nodeid: int, pp_rank: int, dp_rank: int) -> None:
    """srun starts every task itself: Lightning reads SLURM's variables; the strategy derives pipeline x replica
    ranks from them, before any process group exists."""
    for key, value in {**SLURM_ENV, "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(localid),
                       "SLURM_NODEID": str(nodeid)}.items():
        monkeypatch.setenv(key, value)
    strategy = PipelineStrategy(data_parallel_size=2)
    trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=strategy, logger=False,
                         enable_progress_bar=False)
    assert isinstance(strategy.cluster_environment, SLURMEnvironment)
    assert strategy.cluster_environment.creates_processes_externally
    assert (trainer.global_rank, trainer.local_rank, trainer.node_rank, trainer.world_size) == (procid, localid,
                                                                                              nodeid, 4)
    strategy.set_world_ranks()
    topo = strategy.topology
    assert topo is not None and (topo.pp_rank, topo.dp_rank, topo.pipeline_size) == (pp_rank, dp_rank, 2)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": dp_rank}
