"""Signals seen off the main thread, for the failure watch's guard thread ([Note: signals while blocked])."""

from __future__ import annotations

import os
import select
import signal
import threading


class SignalPipe:
    """Signals seen off the main thread ([Note: signals while blocked]).

    [Note: signals while blocked]
    Python runs a signal handler on the main thread, between two bytecodes: while that thread waits inside a native
    call (a P2P receive from a peer whose host is gone), the handler waits too, and SIGTERM from torchrun, SLURM or
    Kubernetes would go unanswered until their ``SIGKILL``. The C-level handler also writes the signal's number to the
    file given to :func:`signal.set_wakeup_fd`, at once; the guard thread reads it there and acts (the SIGTERM
    deadline, or an immediate exit when a peer is already silent). The Python handler still runs later, if ever."""

    def __init__(self, read: int, write: int, previous: int) -> None:
        self.read, self.write, self.previous = read, write, previous

    @classmethod
    def open(cls) -> SignalPipe | None:
        """Route signal numbers to a pipe; None off the main thread (only it may set the wakeup file)."""
        if threading.current_thread() is not threading.main_thread():
            return None
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        try:
            previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except ValueError:
            os.close(read)
            os.close(write)
            return None
        return cls(read, write, previous)

    def wait(self, seconds: float) -> bytes:
        """The signal numbers that arrived within ``seconds`` (empty if none)."""
        try:
            ready, _, _ = select.select([self.read], [], [], seconds)
            return os.read(self.read, 64) if ready else b""
        except OSError:
            return b""

    def close(self) -> None:
        """Give the wakeup file back (on the main thread only; elsewhere the pipe stays open, as the handler may
        still write to it)."""
        if threading.current_thread() is not threading.main_thread():
            return
        current = signal.set_wakeup_fd(self.previous)
        if current != self.write:  # replaced by someone else since: theirs stays
            signal.set_wakeup_fd(current)
        for fd in (self.read, self.write):
            os.close(fd)


__all__ = ["SignalPipe"]
