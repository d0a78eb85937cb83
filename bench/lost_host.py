"""How long a job takes to end when a host is lost, with the default heartbeat timeout, on test hosts (network
namespaces; needs root), and how far apart a rank's heartbeats come under load.

Three hosts, one rank each (pipeline 3, the toy regressor, ``torchrun`` per host). Each case starts the job, waits
until it trains, then loses a host: its link taken down (no FIN, no RST: a power loss, a failed switch port), the
link of the host holding the rendezvous store, or every process of a host killed. The figure is the time from the
fault to the end of the last process of the job (every torchrun agent included). A fourth run trains two hosts to
the end while two busy loops load both cores, and reports the longest gap between a rank's completed heartbeats.

Figures: ``partitioned_host_job_ends_s``, ``store_host_partitioned_job_ends_s``, ``killed_host_job_ends_s``,
``longest_heartbeat_gap_loaded_s``.

    python -m bench lost_host [--heartbeat 30] [--steps-loaded 200]      (as root)
"""

from __future__ import annotations

import argparse
import multiprocessing
import re
import tempfile
from pathlib import Path

from bench.common import Benchmark, Outcome
from tests.multihost import jobs
from tests.multihost.hosts import TestHosts, unavailable_reason


def _busy() -> None:
    while True:
        pass


def lose(hosts: TestHosts, how: str, heartbeat: float, out: Path) -> float:
    """Seconds from losing a host (``partition``, ``store``, ``kill``) to the end of the job's last process."""
    hosts.heal()
    job = jobs.start(hosts.hosts, {"steps": 100_000, "heartbeat_timeout": heartbeat, "step_sleep": 0.05,
                                   "nodes": 3}, out)
    job.wait_progress(2, 20, timeout=300)
    if how == "partition":
        hosts[1].link_down()
    elif how == "store":
        hosts[0].link_down()
    else:
        hosts[1].kill()
    agents = job.agents if how != "kill" else [a for a in job.agents if a.host.index != 1]
    ended = job.wait_exits(agents, timeout=10 * heartbeat)  # seconds from now, right after the fault
    return max(ended.values())


def loaded_gap(hosts: TestHosts, heartbeat: float, steps: int, out: Path) -> float:
    """The longest gap between a rank's completed heartbeats over a run with both cores busy."""
    hosts.heal()
    hogs = [multiprocessing.Process(target=_busy, daemon=True) for _ in range(2)]
    for hog in hogs:
        hog.start()
    try:
        job = jobs.start(hosts.hosts[:2], {"steps": steps, "heartbeat_timeout": heartbeat}, out)
        job.wait_exits(job.agents, timeout=1800)
    finally:
        for hog in hogs:
            hog.terminate()
    gaps = [float(g) for a in job.agents for g in re.findall(r"longest_heartbeat_gap_s=([\d.]+)", a.text())]
    if not gaps:
        raise SystemExit(f"no heartbeat gap reported:\n{job.tails()}")
    return max(gaps)


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--heartbeat", type=float, default=30.0, help="heartbeat_timeout, seconds (default 30)")
    p.add_argument("--steps-loaded", type=int, default=200)


def run(args: argparse.Namespace) -> Outcome:
    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"lost_host: {reason}")
    hosts = TestHosts(3)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            ends = {}
            for how in ("partition", "store", "kill"):
                out = Path(tmp) / how
                out.mkdir()
                ends[how] = lose(hosts, how, args.heartbeat, out)
            out = Path(tmp) / "loaded"
            out.mkdir()
            gap = loaded_gap(hosts, args.heartbeat, args.steps_loaded, out)
    finally:
        hosts.close()
    figures = {"partitioned_host_job_ends_s": ends["partition"], "store_host_partitioned_job_ends_s": ends["store"],
               "killed_host_job_ends_s": ends["kill"], "longest_heartbeat_gap_loaded_s": gap}
    report = (f"3 test hosts, 1 rank each, heartbeat_timeout={args.heartbeat:g} s: the job ended "
              f"{ends['partition']:.1f} s after a host's link went down, {ends['store']:.1f} s after the store's "
              f"host's did, {ends['kill']:.1f} s after a host's processes were killed; the longest gap between a "
              f"rank's heartbeats with both cores busy: {gap:.2f} s")
    return Outcome(report, figures)


BENCHMARK = Benchmark(
    "lost_host", "a host lost mid-training (link down, the store's host, killed): how long until the whole job has "
    "ended; heartbeat gaps under load (root: network namespaces)", run, arguments, slow="needs root and ~5 minutes")
