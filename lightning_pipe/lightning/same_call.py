"""Calls every rank must make together, checked through the store before their first collective.

[Note: every rank saves]
A pipeline checkpoint is written by every rank (each its own stages), so ``trainer.save_checkpoint`` is a
collective, as Lightning's docstring says of strategies that shard. The DDP habit ``if trainer.is_global_zero:
trainer.save_checkpoint(path)`` then left rank 0 alone in the save's first broadcast: gloo's ``Connection reset by
peer`` when the other ranks' script ended there, a silent hang (until the process-group timeout) when they went on to
``trainer.test``, whose own first broadcast could even pair with rank 0's. So before its first collective a save
*meets* the other ranks through the rendezvous store, which needs no peer to be at the same point: each rank posts
what it is doing under the meeting's number and counts itself in; the meeting holds when every rank posted the same
kind of call. The other places a rank can be meet too, so that a rank at the wrong one says so at once:

- every Trainer run meets at its start (``setup_environment``, before its first collective): a rank starting
  ``trainer.test`` while another saves sees the mismatch, and both raise the rule;
- a rank inside a pipeline step while a peer waits in a save can never finish that step: its failure watch
  (runtime/watchdog.py, one more counter read per poll while in a step) posts that it is in a step, names the rule
  and ends the process after :data:`IN_STEP_GRACE_S` (its main thread is blocked in a transfer); the saving rank
  reads the post and raises the rule;
- a rank whose script ends posts that at exit (lightning/world.py), and a rank waiting for it raises at once.

Every rank keeps the same count of meetings (the same program), so the n-th meeting of each rank is the same call.
A rank that is elsewhere, unlabelled (a collective of the user's own), is waited for up to the process-group
timeout, with a notice naming it after :data:`NOTICE_AFTER_S`. One store write and a few reads per save and per
Trainer run; nothing per step beyond the watch's read while a peer waits.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from lightning_pipe._compat import torch as _compat_torch
from lightning_pipe.config import PipelineConfigError

PREFIX = "lightning_pipe/same_call/"
IN_STEP_GRACE_S = 2.0
"""How long a rank may be seen inside a step while a peer waits in a save before it is declared stuck there."""
NOTICE_AFTER_S = 30.0
POLL_S = 0.02
EXITED = "exit|its script ended"

_world: Any = None
_next = 0


def _store() -> Any:
    return dist.PrefixStore(PREFIX, _compat_torch.default_store())


def _index() -> int:
    """This process's next meeting number (counted afresh for a new default group)."""
    global _world, _next
    if _world is not dist.group.WORLD:
        _world, _next = dist.group.WORLD, 0
    return _next


def _post(store: Any, n: int, rank: int, label: str) -> None:
    global _next
    store.set(f"{n}/{rank}", label)
    store.add(f"{n}/arrived", 1)
    _next = n + 1


def _describe(label: str) -> str:
    return label.split("|", 1)[1]


def rule(kind: str, labels: dict[int, str]) -> str:
    """The error every rank raises when the ranks are not all in the same call ([Note: every rank saves])."""
    doing = "; ".join(f"rank {r}: {_describe(label)}" for r, label in sorted(labels.items()))
    if kind == "save":
        what = ("Trainer.save_checkpoint is a collective under PipelineStrategy: every rank must call it at the same "
                "point of the program (each writes its own stages' layers; rank 0 alone holds only its own). The "
                "DDP habit `if trainer.is_global_zero: trainer.save_checkpoint(path)` does not apply: call "
                "trainer.save_checkpoint(path) on every rank (the files are written once, where rank 0's path "
                "says).")
    else:
        what = ("Every rank runs each Trainer call together under PipelineStrategy (fit, validate, test, predict, "
                "save_checkpoint): the ranks of a pipeline pass every batch through together.")
    return f"{what} The ranks are not in the same call: {doing}."


def meet(kind: str, detail: str, rank: int, world_size: int, failed: Callable[[], bool],
         timeout: float) -> bool:
    """Post ``kind`` (``"save"``, ``"run"``) and wait until every rank posted this meeting; raise the rule on every
    rank if they are not all in the same kind of call. False when a peer's failure ended the wait (the caller skips
    its collective: the ranks are stopping)."""
    if world_size < 2 or not dist.is_initialized():
        return True
    store, n = _store(), _index()
    _post(store, n, rank, f"{kind}|{detail}")
    start = time.monotonic()
    noticed = False
    while int(store.add(f"{n}/arrived", 0)) < world_size:
        if failed():
            return False
        waited = time.monotonic() - start
        if waited > timeout:
            missing = [r for r in range(world_size) if not store.check([f"{n}/{r}"])]
            raise PipelineConfigError(rule(kind, {rank: f"{kind}|{detail}"}) + f" Rank(s) {missing} did not come "
                                      f"within {timeout:.0f} s (the process-group timeout).")
        if waited > NOTICE_AFTER_S and not noticed:
            noticed = True
            sys.stderr.write(f"lightning_pipe: rank {rank} waits in {detail} for the other ranks ({waited:.0f} s): "
                             "every rank must make this call.\n")
        time.sleep(POLL_S)
    labels = {r: store.get(f"{n}/{r}").decode() for r in range(world_size)}
    if len({label.split("|", 1)[0] for label in labels.values()}) > 1:
        raise PipelineConfigError(rule("save" if any(v.startswith("save|") for v in labels.values()) else kind,
                                       labels))
    return True


def peer_waiting() -> bool:
    """Whether another rank posted this process's next meeting (it waits there for this one)."""
    if not dist.is_initialized():
        return False
    try:
        return int(_store().add(f"{_index()}/arrived", 0)) > 0
    except Exception:  # the store's process ended: nothing to learn
        return False


def post_elsewhere(rank: int, label: str) -> None:
    """This rank will not come to its next meeting (it is stuck in a step, or its script ended): say so there."""
    try:
        _post(_store(), _index(), rank, label)
    except Exception:  # the store's process ended: nobody waits on it
        pass


def post_at_exit(rank: int) -> None:
    """At this process's exit: a peer waiting for it learns it never comes ([Note: every rank saves]). At a normal
    end the store's host (rank 0) may have ended first; torch's C++ logger then prints the failed send on stderr,
    though nobody can be waiting: the attempt is made with stderr pointed at /dev/null."""
    try:
        sys.stderr.flush()
        saved, quiet = os.dup(2), os.open(os.devnull, os.O_WRONLY)
        os.dup2(quiet, 2)
    except OSError:  # no file descriptors to swap: post as it is
        post_elsewhere(rank, EXITED)
        return
    try:
        post_elsewhere(rank, EXITED)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(quiet)


class StuckInStep:
    """The failure watch's check ([Note: every rank saves]): this rank has been inside a pipeline step for
    :data:`IN_STEP_GRACE_S` while a peer waits in a meeting; then it posts that and returns the rule to stop with."""

    def __init__(self, rank: int, step: Callable[[], str | None]) -> None:
        self.rank, self.step = rank, step
        self._since: float | None = None

    def __call__(self) -> str | None:
        step = self.step()
        if step is None or not peer_waiting():
            self._since = None
            return None
        now = time.monotonic()
        if self._since is None:
            self._since = now
            return None
        if now - self._since < IN_STEP_GRACE_S:
            return None
        post_elsewhere(self.rank, f"step|{step}")
        return (f"rank {self.rank}: PipelineConfigError: another rank called Trainer.save_checkpoint (or started a "
                f"Trainer call) while this rank runs {step}, which needs every rank. "
                + rule("save", {self.rank: f"step|{step}"}))




def strategy_meet(strategy: Any, kind: str, detail: str) -> bool:
    """:func:`meet` for a PipelineStrategy: its rank, world, timeout, and the failure its watch knows of."""
    faults = strategy._faults

    def failed() -> bool:
        return faults is not None and (faults.failed or faults.watch.first_failure() is not None)

    return meet(kind, detail, strategy.global_rank, strategy.world_size, failed, strategy._timeout.total_seconds())


def start_together(strategy: Any) -> None:
    """At the start of every Trainer call (``setup_environment``), before its first collective: every rank is
    starting it too."""
    trainer = strategy.lightning_module.trainer if strategy.lightning_module is not None else None
    fn = getattr(getattr(trainer, "state", None), "fn", None)
    strategy_meet(strategy, "run", f"trainer.{getattr(fn, 'value', fn)}")


def step_of(strategy: Any) -> str | None:
    """The pipeline step this rank is inside, for :class:`StuckInStep` (``None`` between steps)."""
    engine = getattr(strategy, "engine", None)
    phase = getattr(engine, "phase", None)
    if engine is None or phase is None:
        return None
    what = {"train": "training", "validate": "validation"}.get(phase, phase)
    return f"a {what} step (batch_idx {engine.batch_idx})"


__all__ = ["EXITED", "StuckInStep", "meet", "peer_waiting", "post_at_exit", "post_elsewhere", "rule", "start_together",
           "step_of", "strategy_meet"]
