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
* a rank that failed itself is never stopped by the thread (its exception belongs to the user's code), and a peer
  gets ``grace`` seconds first: errors that every rank raises by design (configuration checks) arrive at nearly
  the same time on all ranks, and each of those ranks then reports instead of being killed;
* the thread never acts on store errors: the store lives in one process (rank 0, or torchrun's agent), which may
  end normally before a slower peer's teardown; peers of a *killed* process see its closed sockets anyway.

The same thread enforces a deadline (used after SIGTERM: if the ranks do not stop together in time, stop anyway).
Plain torch: the Lightning adapter (``lightning_pipe.lightning.faults``) decides when to start, report and stop.
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

FAILURE_KEY = "first_failure"
MAX_MESSAGE = 2000
"""Characters of an error message kept in the store (tracebacks stay in the failing rank's own output)."""


def describe_failure(rank: int, error: BaseException) -> str:
    """``"rank 1: ValueError: <message>"`` on one line: what peers print when they stop because of this error.

    Torch's pipeline stage re-raises a layer's error as ``RuntimeError("[Stage 1] failed to run forward ...")``
    from the original: the innermost cause is named first, the wrapper after it."""
    chain = [error]
    while chain[-1].__cause__ is not None and len(chain) < 10:
        chain.append(chain[-1].__cause__)
    parts = [f"{type(e).__name__}: {' '.join(str(e).split()) or '(no message)'}" for e in reversed(chain)]
    text = parts[0] + "".join(f" (raised inside {part})" for part in parts[1:])
    if len(text) > MAX_MESSAGE:
        text = text[:MAX_MESSAGE] + " ..."
    return f"rank {rank}: {text}"


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
        interval: seconds between two polls of the store.
        grace: seconds a peer's failure is left for this rank to fail on its own before this process is stopped.
        before_exit: called just before this process ends (e.g. to end child processes it launched).
    """

    def __init__(self, store: Any, rank: int, *, interval: float = 0.5, grace: float = 5.0,
                 before_exit: Callable[[], None] | None = None) -> None:
        self.store = store
        self.rank = rank
        self.interval = interval
        self.grace = grace
        self.before_exit = before_exit
        self.failed_here = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._deadline: tuple[float, str, int] | None = None
        self._exit = os._exit  # replaced in unit tests

    # ------------------------------------------------------------------ control
    def start(self) -> FailureWatch:
        self._thread = threading.Thread(target=self._run, name=f"lightning_pipe-watch-rank{self.rank}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling; returns once the thread is done with the store (at most one poll later)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=max(2.0, 4 * self.interval))

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def report(self, error: BaseException | str) -> str | None:
        """Record this rank's failure for its peers (the first failure of the run is kept); returns the failure the
        store holds afterwards (this one, or an earlier one of another rank), or None when the store is gone."""
        self.failed_here = True  # from now on this rank is never stopped by its own thread
        text = error if isinstance(error, str) else describe_failure(self.rank, error)
        try:
            return self.store.compare_set(FAILURE_KEY, "", text).decode(errors="replace")
        except Exception:  # the store's process ended: its peers learn from closed sockets instead
            return None

    def first_failure(self) -> str | None:
        """The first failure any rank reported, or None."""
        try:
            if self.store.check([FAILURE_KEY]):
                return self.store.get(FAILURE_KEY).decode(errors="replace")
        except Exception:
            pass
        return None

    def set_deadline(self, seconds: float, message: str, code: int) -> None:
        """End this process with ``message`` and ``code`` unless :meth:`clear_deadline` comes first."""
        self._deadline = (time.monotonic() + seconds, message, code)

    def clear_deadline(self) -> None:
        self._deadline = None

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        peer_failed_at: float | None = None
        store_gone = False
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            deadline = self._deadline
            if deadline is not None and now >= deadline[0]:
                self.terminate(deadline[1], deadline[2])
                return
            if self.failed_here or store_gone:
                continue
            if peer_failed_at is None:
                try:
                    if self.store.check([FAILURE_KEY]):
                        peer_failed_at = now
                except Exception:
                    store_gone = True  # its process ended (see the note): nothing more to learn from it
            elif now - peer_failed_at >= self.grace:
                # `grace` let this rank fail on its own first (the same configuration error on every rank).
                self._stop_for_peer()
                return

    def _stop_for_peer(self) -> None:
        failure = self.first_failure() or "(its error could not be read from the store)"
        self.terminate(
            f"lightning_pipe: rank {self.rank} stops because another rank failed: {failure}\n"
            f"lightning_pipe: (its traceback is in that rank's output). Every rank of a pipeline waits on the "
            f"others, so rank {self.rank} cannot go on; it exits with code 1 now instead of waiting for the "
            "process-group timeout.", 1)

    def terminate(self, message: str, code: int) -> None:
        """Print ``message``, run ``before_exit`` and end the process with ``code`` (no cleanup: the main thread may
        be blocked in a collective that would never return)."""
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


__all__ = ["FailureWatch", "any_rank", "describe_failure"]
