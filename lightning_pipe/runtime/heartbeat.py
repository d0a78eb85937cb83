"""Liveness off the data path: every rank beats in the rendezvous store; a rank or store gone silent is named.

[Note: heartbeats]
A host lost the way hosts are lost at scale (power, kernel panic, a switch port) closes no connection: its peers'
transfers wait without an error until the process-group timeout, and so would a client of the rendezvous store.
So each rank's watch thread (:class:`~lightning_pipe.runtime.watchdog.FailureWatch`) also:

* writes ``"<beat count>|<what this rank is doing>"`` under its own key every ``interval`` and reads the keys of
  the peers it watches (all of them up to :data:`WATCH_ALL_UP_TO` ranks, else that many ring successors, so that
  every rank is watched by someone), through a store client of its own whose connection is replaced after an error;
* a second thread, which never touches the store, compares times: a peer whose value has not changed for
  ``timeout`` seconds is lost (its host, and what it was last seen doing, are named), and so is the store when no
  beat has completed for ``timeout`` seconds (from the other side of the partition, the store's host is the one
  lost; a store client's own timeout does not bound a call on a cut link, hence the separate thread).

The beat comes from a thread, not from progress: a long step, a compilation or ``prepare_data`` keeps beating, so
only a process that is gone, frozen or cut off falls silent. Values are compared, never clock readings, so hosts
need no synchronised clocks. A rank that ends normally writes :data:`DONE` so that its peers stop watching it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

WATCH_ALL_UP_TO = 64
"""Each rank watches every other rank up to this many peers, else this many ring successors."""
DONE = "done"
"""A rank's last value: it ended normally and is no longer watched."""
HEARTBEAT_KEY = "heartbeat/{rank}"
TOGETHER_S = 2.0
"""Peers silent this much less than the longest silence past the timeout are named with it (the same cut)."""


@dataclass(frozen=True)
class HostIdentity:
    """Where a rank runs, as its peers name it: the node rank, the address it reaches the store from, the
    hostname (network namespaces and containers may share one, hence the address)."""

    node: int
    address: str
    hostname: str

    def describe(self) -> str:
        return f"node {self.node} ({self.address}, hostname {self.hostname!r})"


def local_identity(node: int, store_host: str | None) -> HostIdentity:
    """This process's :class:`HostIdentity`: the address is the one its traffic to ``store_host`` leaves from
    (a UDP ``connect`` sends nothing; it only picks the route)."""
    address = "?"
    if store_host:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((store_host, 9))
                address = probe.getsockname()[0]
        except OSError:
            pass
    return HostIdentity(node, address, socket.gethostname())


def ranks_text(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    parts: list[str] = []
    for r in sorted(ranks):
        if parts and parts[-1].split("-")[-1] == str(r - 1):
            parts[-1] = f"{parts[-1].split('-')[0]}-{r}"
        else:
            parts.append(str(r))
    return ", ".join(parts)


def watched_peers(rank: int, world_size: int) -> list[int]:
    """The peers ``rank`` watches: all others up to :data:`WATCH_ALL_UP_TO`, else as many ring successors."""
    count = min(world_size - 1, WATCH_ALL_UP_TO)
    return [(rank + i) % world_size for i in range(1, count + 1)]


@dataclass
class _Peer:
    value: str | None = None
    changed_at: float = 0.0


@dataclass(frozen=True)
class Silence:
    """Peers not heard from for ``seconds`` (the longest silence among them), with what each was last doing."""

    ranks: tuple[int, ...]
    seconds: float
    last_seen: dict[int, str]


class Heartbeat:
    """One rank's beats and its view of its peers' ([Note: heartbeats]); the store calls are :meth:`beat`'s.

    Args:
        rank, world_size: this rank and the world it watches.
        timeout: seconds of silence after which a peer, or the store, is taken for lost.
        identities: every rank's :class:`HostIdentity` (index = rank), for messages.
        store_address: ``"host:port"`` of the store, for messages.
        clock: monotonic seconds (replaced in unit tests).
    """

    def __init__(self, rank: int, world_size: int, timeout: float, identities: Sequence[HostIdentity],
                 store_address: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.rank = rank
        self.timeout = timeout
        self.identities = list(identities)
        self.store_address = store_address
        self.clock = clock
        self.status = "starting"
        """What this rank is doing, in a few words (set by the main thread; read by the beat)."""
        self._count = 0
        self._lock = threading.Lock()
        start = clock()
        self._peers = {peer: _Peer(changed_at=start) for peer in watched_peers(rank, world_size)}
        self._unseen = set(self._peers)  # no key yet: read with check(), which never waits
        self.store_ok_at = start
        """When the last beat completed (sent this rank's value and read the peers')."""
        self.longest_gap = 0.0
        """The longest time between two completed beats so far (what a ``timeout`` must stay well above)."""

    # ------------------------------------------------------------------ the beat (store I/O, watch thread)
    def beat(self, store: Any) -> None:
        """Write this rank's value and read the watched peers' (raises what the store raises)."""
        self._count += 1
        store.set(HEARTBEAT_KEY.format(rank=self.rank), f"{self._count}|{self.status}")
        present = [p for p in sorted(self._unseen) if store.check([HEARTBEAT_KEY.format(rank=p)])]
        known = [p for p in self._peers if p not in self._unseen or p in present]
        values = store.multi_get([HEARTBEAT_KEY.format(rank=p) for p in known]) if known else []
        now = self.clock()
        with self._lock:
            self._unseen.difference_update(present)
            for peer, raw in zip(known, values, strict=True):
                value = raw.decode(errors="replace")
                state = self._peers.get(peer)
                if state is None:
                    continue
                if value.endswith("|" + DONE):
                    del self._peers[peer]
                elif value != state.value:
                    state.value, state.changed_at = value, now
            self.longest_gap = max(self.longest_gap, now - self.store_ok_at)
            self.store_ok_at = now

    def finish(self, store: Any) -> None:
        """This rank ends normally: peers stop watching it."""
        store.set(HEARTBEAT_KEY.format(rank=self.rank), f"{self._count + 1}|{DONE}")

    # ------------------------------------------------------------------ the verdicts (no I/O, guard thread)
    def silence(self, *, threshold: float | None = None) -> Silence | None:
        """Watched peers silent for at least ``threshold`` (default ``timeout``) seconds, or None. A peer's silence
        is counted up to this rank's last completed beat: while the store does not answer here, nothing more is
        learnt of the peers, and it is the store that falls silent."""
        limit = self.timeout if threshold is None else threshold
        with self._lock:
            heard = self.store_ok_at
            quiet = {p: heard - s.changed_at for p, s in self._peers.items()}
            if not quiet or max(quiet.values()) < limit:
                return None
            # one cut silences several hosts at once, their last beats apart by a beat and a poll: name them together
            along = limit - min(TOGETHER_S, limit / 2)
            silent = {p: q for p, q in quiet.items() if q >= along}
            last = {p: _doing(self._peers[p].value) for p in silent}
        return Silence(tuple(sorted(silent)), max(silent.values()), last)

    def store_silence(self, *, threshold: float | None = None) -> float | None:
        """Seconds since the last completed beat, when at least ``threshold`` (default ``timeout``), else None."""
        limit = self.timeout if threshold is None else threshold
        quiet = self.clock() - self.store_ok_at
        return quiet if quiet >= limit else None

    def contact_lost(self) -> bool:
        """Whether a peer or the store has been silent for a few beats already (SIGTERM then stops at once)."""
        brief = min(self.timeout, 5.0)
        return self.silence(threshold=brief) is not None or self.store_silence(threshold=brief) is not None

    # ------------------------------------------------------------------ messages
    def hosts_of(self, ranks: Sequence[int]) -> str:
        """``"rank(s) 2-3 on node 1 (10.0.0.2, hostname 'b')"``, grouped by host."""
        by_host: dict[HostIdentity, list[int]] = {}
        for r in ranks:
            ident = self.identities[r] if r < len(self.identities) else HostIdentity(-1, "?", "?")
            by_host.setdefault(ident, []).append(r)
        return "; ".join(f"rank(s) {ranks_text(rs)} on {ident.describe()}" for ident, rs in by_host.items())

    def store_host_ranks(self) -> list[int]:
        """The ranks on the store's host (by address), for naming it."""
        host = self.store_address.rsplit(":", 1)[0]
        return [r for r, ident in enumerate(self.identities) if ident.address == host]

    def describe_silence(self, silence: Silence) -> str:
        doing = "; ".join(f"rank {r}: {silence.last_seen[r]}" for r in silence.ranks)
        return (f"{self.hosts_of(silence.ranks)} not heard from for {silence.seconds:.0f} s "
                f"(heartbeat_timeout={self.timeout:g}); last seen: {doing}")

    def describe_store_silence(self, seconds: float) -> str:
        on_host = self.store_host_ranks()
        where = f", the host of {self.hosts_of(on_host)}" if on_host else ""
        return (f"the rendezvous store at {self.store_address}{where} has not answered for {seconds:.0f} s "
                f"(heartbeat_timeout={self.timeout:g})")


def _doing(value: str | None) -> str:
    if value is None:
        return "never heard from since the watch started"
    return value.split("|", 1)[1] if "|" in value else value




def tcp_address(store: Any) -> tuple[str, int] | None:
    """``(host, port)`` of the TCP store under ``store`` (through prefix stores), or None for another kind."""
    seen = 0
    while isinstance(store, dist.PrefixStore) and seen < 16:
        store, seen = store.underlying_store, seen + 1
    if isinstance(store, dist.TCPStore):
        return str(store.host), int(store.port)
    return None


def store_connector(host: str, port: int, prefix: str, timeout: float) -> Callable[[], Any]:
    """A function that opens a connection of its own to the TCP store at ``host:port`` (keys under ``prefix``),
    whose calls give up after ``timeout`` seconds where the link allows it ([Note: heartbeats]). A plain socket
    probes the address first: an unreachable store fails at once, without torch's connection retries."""

    def connect() -> Any:
        with socket.create_connection((host, port), timeout=timeout):
            pass
        client = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                               timeout=timedelta(seconds=timeout))
        return dist.PrefixStore(prefix, client)

    return connect


__all__ = ["DONE", "Heartbeat", "HostIdentity", "Silence", "local_identity", "ranks_text", "store_connector",
           "tcp_address", "watched_peers"]
