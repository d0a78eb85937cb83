"""How long a job takes to end when a host is lost, with the default heartbeat timeout, on test hosts (network
namespaces; needs root), and how far apart a rank's heartbeats come under load.

Three hosts, one rank each (pipeline 3, the toy regressor, ``torchrun`` per host). Each case starts the job, waits
until it trains, then loses a host: its link taken down (no FIN, no RST: a power loss, a failed switch port), the
link of the host holding the rendezvous store, or every process of a host killed. The figure is the time from the
fault to the end of the last process of the job (every torchrun agent included). A fourth run trains two hosts to
the end while two busy loops load both cores, and reports the longest gap between a rank's completed heartbeats.

    sudo python bench/lost_host.py [--heartbeat 30] [--steps-loaded 200]
"""

from __future__ import annotations

import argparse
import multiprocessing
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.multihost import jobs  # noqa: E402
from tests.multihost.hosts import TestHosts, unavailable_reason  # noqa: E402


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heartbeat", type=float, default=30.0, help="heartbeat_timeout, seconds (default 30)")
    parser.add_argument("--steps-loaded", type=int, default=200)
    args = parser.parse_args(argv)
    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"lost_host: {reason}")
    hosts = TestHosts(3)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            figures = {}
            for how in ("partition", "store", "kill"):
                out = Path(tmp) / how
                out.mkdir()
                figures[how] = lose(hosts, how, args.heartbeat, out)
            out = Path(tmp) / "loaded"
            out.mkdir()
            gap = loaded_gap(hosts, args.heartbeat, args.steps_loaded, out)
    finally:
        hosts.close()
    print(f"# 3 test hosts, 1 rank each, heartbeat_timeout={args.heartbeat:g} s")
    print(f"partitioned_host_job_ends_s={figures['partition']:.1f}")
    print(f"store_host_partitioned_job_ends_s={figures['store']:.1f}")
    print(f"killed_host_job_ends_s={figures['kill']:.1f}")
    print(f"longest_heartbeat_gap_loaded_s={gap:.2f}")


if __name__ == "__main__":
    main()
