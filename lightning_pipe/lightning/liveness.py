"""A trainer run's failure watch with heartbeats: which store it talks to, who runs where, what a lost host's
survivors print ([Note: heartbeats] in runtime/heartbeat.py, [Note: failure propagation] in runtime/watchdog.py)."""

from __future__ import annotations

import uuid
from typing import Any

import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_pipe._compat import lightning as _compat
from lightning_pipe._compat import torch as _compat_torch
from lightning_pipe.config import config_error
from lightning_pipe.runtime.heartbeat import Heartbeat, local_identity, store_connector, tcp_address
from lightning_pipe.runtime.watchdog import FailureWatch

DEFAULT_HEARTBEAT_TIMEOUT = 30.0
"""Seconds of silence after which a peer (or the store) is taken for lost ([Note: heartbeats]).

The beat comes from a thread of its own, so a long step, a compilation or ``prepare_data`` does not delay it; what
can is a process that holds Python's lock in one native call, or a machine swapping hard. 30 s leaves room for that
and still ends every surviving process within a minute of a lost host (the silence, one poll, and the 5 s its
peers give a reported failure)."""


def resolve_heartbeat_timeout(value: float | int | None) -> float | None:
    """``PipelineStrategy(heartbeat_timeout=...)``: seconds (at least 2), or None / 0 for no heartbeats."""
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 2:
        raise config_error(
            "The heartbeat timeout (seconds of silence after which a peer, or the rendezvous store, is taken for "
            "lost) must be at least 2 seconds: the ranks beat every 0.5 s.", f"heartbeat_timeout={value!r}",
            "heartbeat_timeout", "give seconds (default 30), or 0 / null to turn heartbeats off")
    return float(value)


def start_watch(strategy: Any, heartbeat_timeout: float | None, before_exit: Any,
                on_signal: Any = None) -> FailureWatch:
    """The run's :class:`FailureWatch` (not started). A collective: every rank calls it, once per trainer run.

    Its keys are private to the run (a process that runs fit, then validate, reuses the store). With a TCP store
    and a heartbeat timeout, the watch has a connection of its own with short calls, and a :class:`Heartbeat`."""
    base = _compat_torch.default_store()
    address = tcp_address(base)
    identity = local_identity(strategy.node_rank, address[0] if address else None)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (uuid.uuid4().hex[:12], identity))
    prefix = f"lightning_pipe/faults/{gathered[0][0]}/"
    kwargs: dict[str, Any] = {"world_size": strategy.world_size, "before_exit": before_exit, "on_signal": on_signal}
    if heartbeat_timeout is None or address is None:
        return FailureWatch(dist.PrefixStore(prefix, base), strategy.global_rank, **kwargs)
    host, port = address
    connect = store_connector(host, port, prefix, timeout=min(5.0, heartbeat_timeout / 3))
    heartbeat = Heartbeat(strategy.global_rank, strategy.world_size, heartbeat_timeout,
                          [ident for _, ident in gathered], f"{host}:{port}")
    return FailureWatch(connect(), strategy.global_rank, heartbeat=heartbeat, reconnect=connect,
                        on_lost=lambda: restart_note(strategy), **kwargs)


def restart_note(strategy: Any) -> str:
    """What a restart would repeat: the step this run reached and its newest checkpoint (or that it has none)."""
    module = strategy.lightning_module
    trainer = getattr(module, "_trainer", None) if module is not None else None
    if trainer is None:
        return ""
    step = trainer.global_step
    newest: tuple[int, str] | None = None
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint):
            continue
        saved = _compat.last_checkpoint_step(callback)
        path = getattr(callback, "last_model_path", "") or getattr(callback, "best_model_path", "")
        if saved > 0 and path and (newest is None or saved > newest[0]):
            newest = (saved, path)
    if newest is None:
        return (f"\nlightning_pipe: this run reached global step {step} and saved no checkpoint: a restart starts "
                "from the beginning (ModelCheckpoint(every_n_train_steps=N, save_last=True) bounds the loss).")
    return (f"\nlightning_pipe: this run reached global step {step}; its newest checkpoint is {newest[1]!r} (step "
            f"{newest[0]}): a restart with ckpt_path=\"last\" repeats {step - newest[0]} step(s).")


def step_status(phase: str, batch_idx: int | None, trainer: Any, done: bool = False) -> str:
    """What a rank is doing, as its heartbeat tells its peers."""
    what = {"train": "training", "validate": "validation"}.get(phase, phase)
    where = f"{'after' if done else 'in'} {what} batch {batch_idx}"
    return f"{where} (global step {trainer.global_step})" if phase == "train" else where


__all__ = ["DEFAULT_HEARTBEAT_TIMEOUT", "resolve_heartbeat_timeout", "restart_note", "start_watch", "step_status"]
