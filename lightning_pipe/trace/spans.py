"""Named spans inside a recorded step: code below the schedule (an MoE layer's token exchange) marks what it does,
and the step recorder, while armed, turns each span into a slice of its own ([Note: how the trace is recorded]).

Nothing is timed unless a recorder listens: ``span`` is then one list check.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

SpanSink = Callable[[str, str], contextlib.AbstractContextManager[None]]
"""``sink(kind, label)``: a context manager that records the code it encloses as one slice."""

_sinks: list[SpanSink] = []


@contextlib.contextmanager
def listening(sink: SpanSink) -> Iterator[None]:
    """Route spans to ``sink`` for the duration (the innermost listener wins)."""
    _sinks.append(sink)
    try:
        yield
    finally:
        _sinks.remove(sink)


@contextlib.contextmanager
def span(kind: str, label: str = "") -> Iterator[None]:
    """Mark the enclosed code as one ``kind`` slice (e.g. ``"dispatch"``) when a recorder listens."""
    if not _sinks:
        yield
        return
    with _sinks[-1](kind, label):
        yield
