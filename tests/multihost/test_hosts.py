"""Several hosts, for real: torchrun per test host (network namespaces), hosts partitioned or killed mid-training.

A partition takes a host's link down: no FIN, no RST reaches anyone, as when a machine loses power or a switch
port fails. Every surviving process must name the silent host and end, within a minute, instead of waiting for
the process-group timeout; a slow but live rank must not be taken for lost; under torchrun's elastic agent the
survivors go on from the newest checkpoint on a smaller world, and grow again when the host returns.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_pipe.checkpoint import consolidated
from tests.multihost import jobs
from tests.multihost.hosts import TestHosts
from tests.multihost.rank_script import make_model, train_loader

pytestmark = [pytest.mark.distributed, pytest.mark.multihost]

HEARTBEAT_S = 8.0
ENDS_WITHIN_S = 60.0
"""Every process of a job must have ended this long after a fault (the heartbeat timeout above, a poll, the 5 s a
reported failure gives the other ranks, torchrun's own exit)."""


def _one_device(steps: int) -> dict[str, torch.Tensor]:
    model = make_model()
    pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False).fit(model, train_loader())
    return {n: p.detach() for n, p in model.named_parameters()}


def _merged(out: Path, world: int) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for rank in range(world):
        merged.update(torch.load(out / f"result_w{world}_rank{rank}.pt", weights_only=True)["params"])
    return merged


def _assert_same(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(params) == sorted(reference), what
    for name, value in reference.items():
        torch.testing.assert_close(params[name], value, atol=1e-5, rtol=0, msg=f"{what}: {name}")


@pytest.mark.timeout(240)
def test_two_hosts_train_like_one_device_and_a_slow_rank_is_not_lost(fresh: TestHosts, tmp_path: Path) -> None:
    """Pipeline 2 over two hosts equals one device; rank 1 pausing for twice the heartbeat timeout (a long step, a
    compilation) is waited for, not stopped."""
    case = {"steps": 6, "heartbeat_timeout": HEARTBEAT_S, "stall": {"rank": 1, "step": 2, "seconds": 2 * HEARTBEAT_S}}
    job = jobs.start(fresh.hosts[:2], case, tmp_path)
    job.wait_exits(job.agents, timeout=180)
    assert [a.proc.returncode for a in job.agents] == [0, 0], job.tails()
    assert "stops" not in job.agents[0].text() + job.agents[1].text(), job.tails()
    _assert_same(_merged(tmp_path, 2), _one_device(6), "two hosts against one device")


@pytest.mark.timeout(240)
def test_a_partitioned_host_is_named_and_every_process_ends(fresh: TestHosts, tmp_path: Path) -> None:
    """Host 1 of three loses its link: hosts 0 and 2 name it (its ranks, address, what it was doing), host 1 names
    the store's host it cannot reach; SIGTERM to a survivor waiting on the silent host ends it at once."""
    heartbeat = 2.5 * HEARTBEAT_S  # room for host 2's SIGTERM between "silent for a while" and the timeout
    job = jobs.start(fresh.hosts, {"steps": 10_000, "heartbeat_timeout": heartbeat, "step_sleep": 0.1,
                                   "nodes": 3}, tmp_path)
    job.wait_progress(2, 15, timeout=150)
    fresh[1].link_down()
    time.sleep(heartbeat / 2)  # host 2 has missed beats for a while (5 s make "a while"), not for the timeout yet
    worker = _worker_pid(fresh.hosts[2].pids())
    assert worker is not None, job.tails()
    os.kill(worker, signal.SIGTERM)  # while its main thread waits on the silent host: no step boundary can come
    ends = job.wait_exits(job.agents, timeout=ENDS_WITHIN_S)
    assert all(a.proc.returncode != 0 for a in job.agents), job.tails()
    assert max(ends.values()) < ENDS_WITHIN_S, (ends, job.tails())
    host0, host1, host2 = (a.text() for a in job.agents)
    lost = "rank(s) 1 on node 1 (10.77.1.2"
    assert f"rank 0 stops: {lost}" in host0 and "not heard from for" in host0, job.tails()
    assert "last seen: rank 1: " in host0 and "training batch" in host0, job.tails()
    assert "rank 2 received SIGTERM while a peer or the rendezvous store is silent" in host2, job.tails()
    assert "exiting now, without a checkpoint, with code 143" in host2, job.tails()
    assert "rank 1 stops: the rendezvous store at 10.77.1.1" in host1 and "node 0 (10.77.1.1" in host1, job.tails()


@pytest.mark.timeout(240)
def test_losing_the_stores_host_stops_the_others_naming_it(fresh: TestHosts, tmp_path: Path) -> None:
    """Host 0 holds the rendezvous store and is partitioned: hosts 1 and 2, which still see each other, name it."""
    job = jobs.start(fresh.hosts, {"steps": 10_000, "heartbeat_timeout": HEARTBEAT_S, "step_sleep": 0.1,
                                   "nodes": 3}, tmp_path)
    job.wait_progress(2, 15, timeout=150)
    fresh[0].link_down()
    ends = job.wait_exits(job.agents, timeout=ENDS_WITHIN_S)
    assert all(a.proc.returncode != 0 for a in job.agents), job.tails()
    assert max(ends.values()) < ENDS_WITHIN_S, (ends, job.tails())
    for rank, agent in ((1, job.agents[1]), (2, job.agents[2])):
        assert (f"rank {rank} stops: the rendezvous store at 10.77.1.1" in agent.text()
                and "node 0 (10.77.1.1" in agent.text()), job.tails()
    assert "rank 0 stops: rank(s) 1 on node 1 (10.77.1.2" in job.agents[0].text(), job.tails()


@pytest.mark.timeout(180)
def test_a_killed_host_stops_the_others_at_once(fresh: TestHosts, tmp_path: Path) -> None:
    """Every process of host 1 is killed (its kernel closes their sockets): host 0 ends through the closed
    connection, naming the transfer that failed."""
    job = jobs.start(fresh.hosts[:2], {"steps": 10_000, "heartbeat_timeout": HEARTBEAT_S, "step_sleep": 0.1},
                     tmp_path)
    job.wait_progress(1, 15, timeout=150)
    fresh[1].kill()
    ends = job.wait_exits(job.agents[:1], timeout=ENDS_WITHIN_S)
    assert job.agents[0].proc.returncode != 0 and ends[0] < ENDS_WITHIN_S, job.tails()
    assert "Pipeline P2P failed on global rank 0" in job.agents[0].text() or "rank 0 stops" in job.agents[0].text()


def _worker_pid(pids: list[int]) -> int | None:
    """The rank process among a host's processes (not torchrun's agent)."""
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"rank_script.py" in cmdline and b"torch.distributed.run" not in cmdline:
            return pid
    return None


@pytest.mark.timeout(480)
def test_an_elastic_job_goes_on_without_a_lost_host_and_grows_back(fresh: TestHosts, tmp_path: Path) -> None:
    """torchrun --nnodes=1:2: host 1 is partitioned after a checkpoint; host 0's worker names it, torchrun restarts
    it alone (pipeline 2 -> 1) from the newest checkpoint; host 1 comes back and the job grows again (1 -> 2) from
    the checkpoint the smaller world wrote. Each phase's parameters equal a resume of the same checkpoint on the
    same layout by hand."""
    port, steps = jobs._free_port(), 24
    case = {"steps": steps, "heartbeat_timeout": HEARTBEAT_S, "step_sleep": 0.1, "checkpoint_every": 4,
            "resume": "last", "max_nodes": 2, "rdzv_host": fresh[0].address, "hold": {"world": 1, "step": 13}}
    out = tmp_path / "elastic"
    out.mkdir()
    job = jobs.start(fresh.hosts[:2], case, out, elastic=True, port=port)
    job.wait_progress(0, 6, timeout=150)  # past the checkpoint at step 4
    fresh[1].link_down()
    job.wait_progress(0, 13, timeout=150)  # host 0 alone went on, from step 4, past its checkpoint at step 12
    fresh[1].kill()
    fresh[1].link_up()
    jobs.start([fresh[1]], case, out, elastic=True, port=port, tag="_back", job=job)
    job.wait_exits([job.agents[0], job.agents[2]], timeout=240)
    assert [job.agents[0].proc.returncode, job.agents[2].proc.returncode] == [0, 0], job.tails()
    host0 = job.agents[0].text()
    assert "rank 0 stops: rank(s) 1 on node 1 (10.77.1.2" in host0, job.tails()
    assert "a restart with ckpt_path=\"last\" repeats" in host0, job.tails()
    assert "torchrun gave 1 node(s) x 1 process(es) = 1 ranks, where Trainer(num_nodes=2) planned 2" in host0
    assert "pipeline 2 -> 1 stage ranks" in host0, job.tails()
    shrunk = sorted(out.glob("resumed_w1_step*.ckpt"))
    grown = sorted(out.glob("resumed_w2_step*.ckpt"))
    assert len(shrunk) == 1 and len(grown) == 1, (shrunk, grown, job.tails())
    step_shrunk, step_grown = (int(p.name.split("step")[1].split(".")[0]) for p in (shrunk[0], grown[0]))
    assert 4 <= step_shrunk <= 8 and step_grown == 12, (step_shrunk, step_grown)

    # the smaller world's run, by hand: one host, from the checkpoint it resumed, to the checkpoint it handed on
    hand1 = tmp_path / "hand1"
    hand1.mkdir()
    one = jobs.start(fresh.hosts[:1], {"steps": step_grown, "heartbeat_timeout": HEARTBEAT_S, "nodes": 1,
                                       "resume": str(shrunk[0])}, hand1)
    one.wait_exits(one.agents, timeout=150)
    assert one.agents[0].proc.returncode == 0, one.tails()
    handed_on = {k.removeprefix("model."): v for k, v in consolidated(grown[0])["state_dict"].items()}
    _assert_same(_merged(hand1, 1), handed_on, "the smaller world against a resume on one host by hand")

    # the grown world's run, by hand: two hosts, from the checkpoint it resumed, to the end
    fresh.heal()
    hand2 = tmp_path / "hand2"
    hand2.mkdir()
    two = jobs.start(fresh.hosts[:2], {"steps": steps, "heartbeat_timeout": HEARTBEAT_S, "nodes": 2,
                                       "resume": str(grown[0])}, hand2)
    two.wait_exits(two.agents, timeout=150)
    assert [a.proc.returncode for a in two.agents] == [0, 0], two.tails()
    _assert_same(_merged(out, 2), _merged(hand2, 2), "the grown world against a resume on two hosts by hand")
