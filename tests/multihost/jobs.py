"""torchrun on test hosts: start a job (one agent per host), watch its progress, read what each host printed.

The rank program is ``tests/multihost/rank_script.py``; its case (a dict) travels in ``LP_CASE``. Every process a
job starts lives on a test host, so :meth:`~tests.multihost.hosts.TestHosts.heal` ends whatever a failed test left.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import Popen
from typing import Any

from tests.distributed.launcher import REPO, _free_port, child_env
from tests.multihost.hosts import Host

SCRIPT = REPO / "tests" / "multihost" / "rank_script.py"
ELASTIC_RDZV = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=120"
"""Fast rounds for tests: a lost agent is dropped after 3 s without a keep-alive, a round closes 1 s after its
minimum is reached."""


@dataclass
class Agent:
    host: Host
    proc: Popen
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass
class Job:
    out: Path
    agents: list[Agent] = field(default_factory=list)

    def progress(self, rank: int) -> int:
        """The last global step ``rank`` finished (-1 before the first)."""
        try:
            return int((self.out / f"progress_rank{rank}").read_text() or -1)
        except (FileNotFoundError, ValueError):
            return -1

    def wait_progress(self, rank: int, step: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.progress(rank) < step:
            if time.monotonic() > deadline or all(a.proc.poll() is not None for a in self.agents):
                raise AssertionError(f"rank {rank} did not reach step {step} within {timeout:.0f} s (at "
                                     f"{self.progress(rank)})\n{self.tails()}")
            time.sleep(0.1)

    def wait_exits(self, agents: Sequence[Agent], timeout: float) -> dict[int, float]:
        """Seconds until each agent's torchrun ended (index in ``agents``); fails the test past ``timeout``."""
        start, ended = time.monotonic(), {}
        while len(ended) < len(agents) and time.monotonic() - start < timeout:
            for i, agent in enumerate(agents):
                if i not in ended and agent.proc.poll() is not None:
                    ended[i] = time.monotonic() - start
            time.sleep(0.1)
        if len(ended) < len(agents):
            raise AssertionError(f"host(s) {[a.host.index for i, a in enumerate(agents) if i not in ended]} still "
                                 f"running {timeout:.0f} s later\n{self.tails()}")
        return ended

    def tails(self, lines: int = 25) -> str:
        return "\n".join(f"--- host {a.host.index} ({a.log.name}) ---\n" +
                         "\n".join(_readable(a.text()).splitlines()[-lines:]) for a in self.agents)


def _readable(text: str) -> str:
    """A log without torch's C++ stack frames."""
    return "\n".join(line for line in text.splitlines()
                     if not line.startswith("frame #") and "Exception raised from" not in line and line.strip())


def start(hosts: Sequence[Host], case: dict[str, Any], out: Path, *, elastic: bool = False,
          port: int | None = None, tag: str = "", job: Job | None = None) -> Job:
    """One torchrun agent per host (1 process each). Static: ``--nnodes=len(hosts)``, node ranks in order, the
    first host holds the store. Elastic: ``--nnodes=1:<max>`` with c10d rendezvous on the first host."""
    job = job if job is not None else Job(out)
    port = port if port is not None else _free_port()
    store_host = hosts[0].address if not elastic else case["rdzv_host"]
    for i, host in enumerate(hosts):
        env = child_env(LP_CASE=json.dumps({**case, "out": str(out)}), GLOO_SOCKET_IFNAME=host.link,
                        # torchrun's shared rendezvous store misses a host that joins a later round (its
                        # MASTER_ADDR is written only in the first): the workers' own store avoids it
                        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
            env.pop(key, None)
        if elastic:
            where = [f"--nnodes=1:{case['max_nodes']}", "--max-restarts=3", "--rdzv-backend=c10d",
                     f"--rdzv-endpoint={store_host}:{port}", "--rdzv-id=lp-test", "--monitor-interval=1",
                     f"--rdzv-conf=is_host={int(host.address == store_host)},{ELASTIC_RDZV}"]
        else:
            where = [f"--nnodes={len(hosts)}", f"--node-rank={i}", f"--master-addr={store_host}",
                     f"--master-port={port}"]
        log = out / f"host{host.index}{tag}.log"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1",
               *where, f"--local-addr={host.address}", str(SCRIPT)]
        with open(log, "w") as handle:
            job.agents.append(Agent(host, host.popen(cmd, env=env, log=handle, cwd=REPO), log))
    return job
