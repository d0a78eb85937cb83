"""How a failure is told: one line per failure for the other ranks, and whether an error only says that a peer went
away ([Note: failure propagation] in runtime/watchdog.py)."""

from __future__ import annotations

_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
              "remote process exited", "ncclremoteerror", "nccl communicator was aborted", "socket closed")
"""How gloo and NCCL word "a peer went away" (lower case)."""
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


def is_peer_connection_error(error: BaseException) -> bool:
    """Whether ``error`` (or an exception it was raised from) says a peer process went away, rather than what
    failed there."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if any(text in str(current).lower() for text in _PEER_LOST):
            return True
        current = current.__cause__ or current.__context__
    return False


def consequence_note(rank: int, cause: str) -> str:
    """What a rank adds to its lost-connection error: the first failure of the run, which is the real cause."""
    return (f"lightning_pipe: rank {rank} lost its connection because another rank failed first: {cause}\n"
            "lightning_pipe: (that rank's traceback is in its own output; the error above is only the consequence).")


__all__ = ["MAX_MESSAGE", "consequence_note", "describe_failure", "is_peer_connection_error"]
