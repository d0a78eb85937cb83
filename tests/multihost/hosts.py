"""Test hosts on one machine: network namespaces joined by a bridge, one address each.

Each host is a network namespace with one veth link to a bridge that lives in a namespace of its own (the
"switch"), so the machine's own network is never touched. A host can be partitioned the way a power loss, a kernel
panic or a failed switch port partitions it (its link goes down: no FIN, no RST reaches its peers), or killed (every
process in it gets SIGKILL: the kernel closes their sockets). Needs root and iproute2; this kernel has no ``netem``
qdisc, so slow or lossy links cannot be simulated.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO


def unavailable_reason() -> str | None:
    """Why test hosts cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "test hosts need root (network namespaces)"
    if shutil.which("ip") is None:
        return "test hosts need iproute2's `ip` (apt-get install iproute2)"
    probe = f"lpprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


@dataclass
class Host:
    """One test host: its namespace, its link (the host's end of the veth pair) and its address."""

    index: int
    netns: str
    link: str
    address: str
    procs: list[subprocess.Popen] = field(default_factory=list)

    def popen(self, cmd: Sequence[str], *, env: dict[str, str], log: IO[str], cwd: Path) -> subprocess.Popen:
        """Start ``cmd`` on this host (its own session, so the whole process tree can be signalled)."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.netns, *cmd], env=env, cwd=cwd, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def link_down(self) -> None:
        """Partition the host: nothing reaches it or leaves it, and no connection is closed."""
        _ip("-n", self.netns, "link", "set", self.link, "down")

    def link_up(self) -> None:
        _ip("-n", self.netns, "link", "set", self.link, "up")

    def pids(self) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def kill(self) -> None:
        """Kill every process on the host (SIGKILL): the kernel closes their sockets, as when a machine's processes
        all die at once."""
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class TestHosts:
    """``n`` test hosts on subnet 10.77.<subnet>.0/24 (addresses .1, .2, ...), torn down by :meth:`close`."""

    __test__ = False  # not a pytest test class

    def __init__(self, n: int, *, subnet: int = 77) -> None:
        tag = f"lp{os.getpid() % 100000}"
        self.switch = f"{tag}sw"
        self.hosts: list[Host] = []
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i in range(n):
                self.hosts.append(self._add_host(tag, i, subnet))
        except Exception:
            self.close()
            raise

    def _add_host(self, tag: str, i: int, subnet: int) -> Host:
        netns, link, port = f"{tag}h{i}", f"{tag}v{i}", f"{tag}p{i}"
        host = Host(i, netns, link, f"10.{subnet}.1.{i + 1}")
        _ip("netns", "add", netns)
        _ip("link", "add", link, "type", "veth", "peer", "name", port)
        _ip("link", "set", link, "netns", netns)
        _ip("link", "set", port, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", port, "master", "br0")
        _ip("-n", self.switch, "link", "set", port, "up")
        _ip("-n", netns, "addr", "add", f"{host.address}/24", "dev", link)
        _ip("-n", netns, "link", "set", link, "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        return host

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def heal(self) -> None:
        """Between cases: every process gone, every link up."""
        for host in self.hosts:
            host.kill()
            for proc in host.procs:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            host.procs.clear()
            host.link_up()

    def close(self) -> None:
        for host in self.hosts:
            host.kill()
        time.sleep(0.2)
        for host in self.hosts:
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.switch], capture_output=True)
        self.hosts.clear()
