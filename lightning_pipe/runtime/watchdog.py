"""No hangs after a failure: a rank that fails tells the others through the rendezvous store, and they stop.

[Note: failure propagation]
Every rank of a pipeline waits on its neighbours (a stage's receive blocks until the previous stage sends). When a
rank raises and its process *stays alive* (a notebook, a script that catches the exception, a hung data loader),
its sockets stay open, so its peers see no error: they wait until the process-group timeout. Hence:

* the failing rank writes ``"rank r: <Type>: <message>"`` under one key of the c10d store (``compare_set``: the
  first failure wins, so later "connection closed" errors of its peers never hide the cause);
* a daemon thread on every rank polls that key (one cheap ``check`` per ``interval``) and, when *another* rank
  failed, prints a message naming it and its error and ends this process with a non-zero code (``os._exit``: the
  main thread is blocked inside a collective and cannot be interrupted any other way);
* a rank that failed itself is not stopped for a peer's failure (its exception belongs to the user's code; only a
  silent host or a deadline, [Note: heartbeats], still stop it while it is in a run), and a peer
  gets ``grace`` seconds first: errors that every rank raises by design (configuration checks) arrive at nearly
  the same time on all ranks, and each of those ranks then reports instead of being killed;
* the thread never acts on store errors: the store lives in one process (rank 0, or torchrun's agent), which may
  end normally before a slower peer's teardown; peers of a *killed* process see its closed sockets anyway.

A failing process that *ends* closes its sockets, and its peers' transfers fail at once with the backend's own error
(gloo's "Connection closed by peer"): that error, not the cause, is what rank 0's user would see. Hence:

* every rank reads the first failure as soon as it appears (its thread's next poll, or its own report; kept in
  :attr:`FailureWatch.seen`) and counts itself under ``SEEN_KEY``; a failed rank waits at its teardown (:meth:`FailureWatch.wait_seen`, about one poll)
  until every rank has read its failure, so peers know it even when the store's process (rank 0) is the one ending;
* a rank whose own error is a lost connection (:func:`is_peer_connection_error`) names the first failure of another
  rank as the cause (:func:`consequence_note`, added to its exception and printed).

A per-rank hook that fails between collectives (a ``parallelize_layer`` failing on one tensor rank) is reported at
once with :func:`report_now`, before its rank waits in any agreement its peers may never reach.

A second thread, which never touches the store, enforces a deadline (used after SIGTERM: if the ranks do not stop
together in time, stop anyway) and, with a :class:`~lightning_pipe.runtime.heartbeat.Heartbeat`, stops this process
when a peer or the store falls silent ([Note: heartbeats]). Plain torch: the Lightning adapter (``lightning_pipe.lightning.faults``) decides when to start, report and stop.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_pipe.runtime.failure_text import consequence_note, describe_failure, is_peer_connection_error
from lightning_pipe.runtime.heartbeat import Heartbeat
from lightning_pipe.runtime.signals import SignalPipe

FAILURE_KEY = "first_failure"
SEEN_KEY = "failure_seen"
"""Counts the ranks whose watch has read the first failure."""
_ACTIVE: FailureWatch | None = None
"""The watch running in this process (one trainer run at a time), for :func:`report_now`."""
RECONNECT_EVERY_S = 3.0
"""Seconds between two attempts to replace a failed store connection."""
HOLD_S = 60.0
"""The longest a main thread waits in :meth:`FailureWatch.hold_if_ending` for its watch to end the process."""


def any_rank(flags: Sequence[bool], device: torch.device, group: Any | None = None) -> list[bool]:
    """For each flag, whether it is set on any rank of ``group`` (one MAX all-reduce; every rank must call it at
    the same point of its program, like any collective)."""
    value = torch.tensor([1 if flag else 0 for flag in flags], dtype=torch.int32, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return [bool(v) for v in value.tolist()]


class FailureWatch:
    """Reports this rank's failure to its peers and stops this process when a peer failed ([Note: failure
    propagation]).

    Args:
        store: a store every rank shares, with keys private to this run (e.g. a ``PrefixStore`` per run).
        rank: this process's global rank (names it in messages).
        world_size: how many ranks watch this store (:meth:`wait_seen` waits for that many).
        interval: seconds between two polls of the store.
        grace: seconds a peer's failure is left for this rank to fail on its own before this process is stopped.
        before_exit: called just before this process ends (e.g. to end child processes it launched).
        heartbeat: this rank's beats and its view of its peers ([Note: heartbeats]); None: no liveness watch.
        on_lost: adds lines to the message printed when a peer or the store falls silent (e.g. the newest
            checkpoint to restart from).
        on_signal: called on the guard thread with each signal number the process receives while the watch runs
            ([Note: signals while blocked]).
        reconnect: makes a new connection to the store after one failed (a client of the watch's own); None: a
            failed store is taken for gone (its process ended) and no longer polled.
    """

    def __init__(self, store: Any, rank: int, *, world_size: int = 1, interval: float = 0.5, grace: float = 5.0,
                 before_exit: Callable[[], None] | None = None, heartbeat: Heartbeat | None = None,
                 reconnect: Callable[[], Any] | None = None, on_lost: Callable[[], str] | None = None,
                 on_signal: Callable[[int], None] | None = None) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.seen: str | None = None
        """The first failure of the run, once this rank's thread read it."""
        self.interval = interval
        self.grace = grace
        self.before_exit = before_exit
        self.failed_here = False
        self.store_gone = False  # its process ended (rank 0's): every later call would fail (and log) again
        self.heartbeat = heartbeat
        self._reconnect = reconnect
        self.on_lost = on_lost
        self.on_signal = on_signal
        self._signals: SignalPipe | None = None
        self._broken_at: float | None = None  # the store connection failed then; replaced at most every few s
        self._seen_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._guard_thread: threading.Thread | None = None
        self._deadline: tuple[float, str, int] | None = None
        self._exit = os._exit  # replaced in unit tests
        self.ending = threading.Event()
        """Set once this watch ends the process: its message is printed, its exit follows (:meth:`hold_if_ending`)."""
        self.checks: list[Callable[[], str | None]] = []
        """Polled with the store: one that returns a message reports it as this rank's failure and ends the process
        (e.g. a rank stuck in a step no peer will join: [Note: every rank saves] in lightning/same_call.py)."""

    # ------------------------------------------------------------------ control
    def start(self) -> FailureWatch:
        global _ACTIVE
        _ACTIVE = self
        self._thread = threading.Thread(target=self._run, name=f"lightning_pipe-watch-rank{self.rank}", daemon=True)
        if self.on_signal is not None:
            self._signals = SignalPipe.open()
        self._guard_thread = threading.Thread(target=self._guard, name=f"lightning_pipe-guard-rank{self.rank}",
                                              daemon=True)
        self._thread.start()
        self._guard_thread.start()
        return self

    def stop(self) -> None:
        """Stop polling; returns once the thread is done with the store (at most one poll later)."""
        global _ACTIVE
        if _ACTIVE is self:
            _ACTIVE = None
        self._stop.set()
        for thread in (self._thread, self._guard_thread):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=max(2.0, 4 * self.interval))
        self._thread = self._guard_thread = None
        signals, self._signals = self._signals, None
        if signals is not None:
            signals.close()
        if self.heartbeat is not None and self._usable():
            try:  # ended normally: peers stop watching this rank
                self.heartbeat.finish(self.store)
            except Exception:
                pass
        self.on_signal = self.on_lost = None  # they hold the run's objects (and this watch: a reference cycle)
        if self._reconnect is not None:  # the watch's own connection: closed now, not whenever a collection runs
            self.store, self.store_gone = None, True

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def report(self, error: BaseException | str) -> str | None:
        """Record this rank's failure for its peers (the first failure of the run is kept); returns the failure the
        store holds afterwards (this one, or an earlier one of another rank), or None when the store is gone."""
        self.failed_here = True  # not stopped for a peer's failure from now on (a silent host or the deadline still do)
        text = error if isinstance(error, str) else describe_failure(self.rank, error)
        if not self._usable():
            return self.seen
        try:
            first = self.store.compare_set(FAILURE_KEY, "", text).decode(errors="replace")
            self._read(first)  # this rank knows the first failure now: counted at once, not at the next poll
            return first
        except Exception:  # the store is out of reach: what this rank's thread read before is all there is
            self._lost_store()
            return self.seen

    def hold_if_ending(self, at_most: float = HOLD_S) -> None:
        """On the main thread, about to handle its own error: if this watch is ending the process, wait for that end
        (at most ``at_most`` seconds). The error is then a consequence (a peer's connection closing while this rank
        waits on its launcher, [Note: a launched rank outlives no launcher] in lightning/faults.py): printing it would
        bury the watch's message under a second, misleading one."""
        if self.ending.is_set() and threading.current_thread() is threading.main_thread():
            time.sleep(at_most)

    def _usable(self) -> bool:
        return not self.store_gone and self._broken_at is None

    def _read(self, first: str) -> bool:
        """Keep the first failure and count this rank as having read it (once, whichever thread comes first)."""
        with self._seen_lock:
            if self.seen is not None:
                return False
            self.seen = first
        self.store.add(SEEN_KEY, 1)
        return True

    def cause_of(self, error: BaseException) -> str | None:
        """Another rank's first failure, when ``error`` (this rank's, reported) is only a lost connection to it."""
        if not is_peer_connection_error(error):
            return None
        first = self.first_failure() or self.seen
        return first if first is not None and not first.startswith(f"rank {self.rank}:") else None

    def wait_seen(self, timeout: float | None = None) -> bool:
        """After this rank failed: wait (at most ``timeout``, default two polls and a second) until every rank's
        thread has read the first failure, so that it outlives the store if this process hosts it. True if all did."""
        end = time.monotonic() + (2 * self.interval + 1.0 if timeout is None else timeout)
        while self._usable():
            try:
                if int(self.store.add(SEEN_KEY, 0)) >= self.world_size:
                    return True
            except Exception:  # the store is out of reach: nobody can read it any more
                self._lost_store()
                break
            if time.monotonic() >= end or not self.running:
                return False
            time.sleep(min(0.05, self.interval))
        return False

    def first_failure(self) -> str | None:
        """The first failure any rank reported, or None."""
        if not self._usable():
            return None
        try:
            if self.store.check([FAILURE_KEY]):
                return self.store.get(FAILURE_KEY).decode(errors="replace")
        except Exception:
            self._lost_store()
        return None

    def set_deadline(self, seconds: float, message: str, code: int) -> None:
        """End this process with ``message`` and ``code`` unless :meth:`clear_deadline` comes first."""
        self._deadline = (time.monotonic() + seconds, message, code)

    def clear_deadline(self) -> None:
        self._deadline = None

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        """The store's side: this rank's beats, and the first failure (read at once, acted on after ``grace``)."""
        peer_failed_at: float | None = None
        while not self._stop.wait(self.interval):
            if self.store_gone or not self._connected():
                continue
            try:
                if self.heartbeat is not None:
                    self.heartbeat.beat(self.store)
                if self.seen is None and self.store.check([FAILURE_KEY]):
                    # read at once (the store's process may end soon after), then counted as read
                    self._read(self.store.get(FAILURE_KEY).decode(errors="replace"))
            except Exception:
                self._lost_store()  # its process ended, or its host is out of reach (see the notes)
                continue
            stuck = next((m for m in (check() for check in self.checks) if m is not None), None)
            if stuck is not None:
                self.report(stuck)
                self.wait_seen()  # peers read it before this process ends (a launcher may end them when it does)
                self.terminate(stuck, 1)
                return
            if self.seen is None or self.failed_here:
                continue
            if peer_failed_at is None:
                peer_failed_at = time.monotonic()
            elif time.monotonic() - peer_failed_at >= self.grace:
                # `grace` let this rank fail on its own first (the same configuration error on every rank).
                self._stop_for_peer()
                return

    def _guard(self) -> None:
        """The clock's side, which never calls the store (a call on a cut link can outlast its timeout): the
        deadline, and silent peers or a silent store ([Note: heartbeats])."""
        while not self._wait_or_signal(min(self.interval, 1.0)):
            deadline = self._deadline
            if deadline is not None and time.monotonic() >= deadline[0]:
                self.terminate(deadline[1], deadline[2])
                return
            beat = self.heartbeat
            if beat is None:  # (a rank that failed itself is watched too: its teardown may wait on the silent host)
                continue
            silence = beat.silence()
            if silence is not None:
                self._stop_for_silence(beat.describe_silence(silence), "those ranks' host is lost or cut off from "
                                       "this one", report=True)
                return
            quiet = beat.store_silence()
            if quiet is not None:
                self._stop_for_silence(beat.describe_store_silence(quiet), "that host is lost, or this host is cut "
                                       "off from it", report=False)
                return

    def _wait_or_signal(self, seconds: float) -> bool:
        """Wait ``seconds`` (less when a signal arrives, which is passed on); True once the watch is stopped."""
        signals = self._signals
        if signals is None:
            return self._stop.wait(seconds)
        for signum in signals.wait(seconds):
            if self.on_signal is not None:
                try:
                    self.on_signal(signum)
                except Exception:
                    pass
        return self._stop.is_set()

    def _connected(self) -> bool:
        """Whether the store connection is usable; a failed one is replaced, at most every
        :data:`RECONNECT_EVERY_S`."""
        if self._broken_at is None:
            return True
        if self._reconnect is None or time.monotonic() - self._broken_at < RECONNECT_EVERY_S:
            return False
        try:
            self.store = self._reconnect()
            self._broken_at = None
            return True
        except Exception:
            self._broken_at = time.monotonic()
            return False

    def _lost_store(self) -> None:
        if self._reconnect is None:
            self.store_gone = True  # nothing more to learn from it, and every later call would fail (and log)
        elif self._broken_at is None:
            self._broken_at = time.monotonic()

    def _stop_for_silence(self, what: str, meaning: str, *, report: bool) -> None:
        """A peer or the store fell silent: tell the others when the store still answers here (they may watch
        other peers), then end this process."""
        if report:
            teller = threading.Thread(target=self.report, args=(f"rank {self.rank}: lost contact with {what}",),
                                      daemon=True)
            teller.start()
            teller.join(timeout=2.0)
        extra = ""
        if self.on_lost is not None:
            try:
                extra = self.on_lost()
            except Exception:
                pass
        self.terminate(
            f"lightning_pipe: rank {self.rank} stops: {what}: {meaning}.\n"
            f"lightning_pipe: every rank of a pipeline waits on the others, so rank {self.rank} cannot go on; it "
            f"exits with code 1 now instead of waiting for the process-group timeout.{extra}", 1)

    def _stop_for_peer(self) -> None:
        failure = self.first_failure() or self.seen or "(its error could not be read from the store)"
        self.terminate(
            f"lightning_pipe: rank {self.rank} stops because another rank failed: {failure}\n"
            f"lightning_pipe: (its traceback is in that rank's output). Every rank of a pipeline waits on the "
            f"others, so rank {self.rank} cannot go on; it exits with code 1 now instead of waiting for the "
            "process-group timeout.", 1)

    def terminate(self, message: str, code: int) -> None:
        """Print ``message``, run ``before_exit`` and end the process with ``code`` (no cleanup: the main thread may
        be blocked in a collective that would never return)."""
        self.ending.set()
        try:
            sys.stdout.flush()
            sys.stderr.write(message.rstrip() + "\n")
            sys.stderr.flush()
        except Exception:
            pass
        if self.before_exit is not None:
            try:
                self.before_exit()
            except Exception:
                pass
        self._exit(code)


def report_now(error: BaseException) -> None:
    """Report ``error`` to the other ranks now, if a watch runs in this process: for a failure in a per-rank hook
    that this rank keeps for a later agreement, which peers blocked in the hook's own collectives never reach."""
    if _ACTIVE is not None:
        _ACTIVE.report(error)


__all__ = ["FailureWatch", "any_rank", "consequence_note", "describe_failure", "is_peer_connection_error",
           "report_now"]
