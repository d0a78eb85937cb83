"""Private Lightning names the adapter builds on (DDPStrategy uses the same ones), resolved at import.

Imported only by :mod:`lightning_pipe.lightning`: a Lightning release that moves one fails at ``import
lightning_pipe`` with a message naming it (see the package docstring for the policy).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import lightning

CHECKED_LIGHTNING = ("2.6",)


def _resolve(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ImportError(
            f"lightning {lightning.__version__} has no {module}.{name}; lightning_pipe was checked on lightning "
            f"{CHECKED_LIGHTNING} and needs it. Install lightning 2.6 or update lightning_pipe/_compat/lightning.py."
        ) from err


def _method(owner: type, name: str) -> tuple[type, str]:
    if not callable(getattr(owner, name, None)):
        raise ImportError(
            f"lightning {lightning.__version__}: {owner.__qualname__} has no method {name}; lightning_pipe was "
            f"checked on lightning {CHECKED_LIGHTNING} and overrides or calls it. Update "
            "lightning_pipe/_compat/lightning.py."
        )
    return owner, name


default_backend_for_device = _resolve("lightning.fabric.utilities.distributed",
                                      "_get_default_process_group_backend_for_device")
distributed_is_initialized = _resolve("lightning.fabric.utilities.distributed", "_distributed_is_initialized")
init_dist_connection = _resolve("lightning.fabric.utilities.distributed", "_init_dist_connection")
sync_ddp_if_available = _resolve("lightning.fabric.utilities.distributed", "_sync_ddp_if_available")
optimizers_to_device = _resolve("lightning.fabric.utilities.optimizer", "_optimizers_to_device")
convert_fp_tensor = _resolve("lightning.fabric.plugins.precision.utils", "_convert_fp_tensor")
DtypeContextManager = _resolve("lightning.fabric.plugins.precision.utils", "_DtypeContextManager")
MultiProcessingLauncher = _resolve("lightning.pytorch.strategies.launchers", "_MultiProcessingLauncher")
SubprocessScriptLauncher = _resolve("lightning.pytorch.strategies.launchers", "_SubprocessScriptLauncher")
_Precision = _resolve("lightning.pytorch.plugins.precision", "Precision")
_Strategy = _resolve("lightning.pytorch.strategies", "Strategy")
# lightning/faults.py: the trainer's signal handling (its SIGTERM handler runs a collective inside the handler;
# ours defers the stop to a step boundary) and ModelCheckpoint's "last" save on preemption.
SignalConnector = _resolve("lightning.pytorch.trainer.connectors.signal_connector", "_SignalConnector")
_ModelCheckpoint = _resolve("lightning.pytorch.callbacks", "ModelCheckpoint")
_FitLoop = _resolve("lightning.pytorch.loops", "_FitLoop")

# Private methods we override or call: (class, method name).
PRIVATE_LIGHTNING_METHODS = (
    _method(MultiProcessingLauncher, "_collect_rank_zero_results"),  # lightning/launchers.py
    _method(_Precision, "_after_closure"),  # lightning/precision.py: fp16 optimizer_step
    _method(_Strategy, "_configure_launcher"),  # lightning/strategy.py
    _method(SignalConnector, "_sigterm_notifier_fn"),  # lightning/faults.py: replaced (no collective inside)
    _method(SignalConnector, "_slurm_sigusr_handler_fn"),  # lightning/faults.py: deferred to a step boundary
    _method(_ModelCheckpoint, "_save_last_checkpoint"),  # lightning/faults.py: "last" on SIGTERM
    _method(_ModelCheckpoint, "_monitor_candidates"),  # lightning/faults.py
    _method(_FitLoop, "_should_accumulate"),  # lightning/strategy.py: does an optimizer step follow this batch?
)


def should_accumulate(trainer: Any) -> bool:
    """Whether the current training batch only accumulates (no optimizer step after it): Lightning's own rule."""
    return bool(trainer.fit_loop._should_accumulate())


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer behind a ``LightningOptimizer`` (its private ``_optimizer``), or the argument itself."""
    inner = getattr(optimizer, "_optimizer", None)
    return optimizer if inner is None else inner


def train_dataloader(trainer: Any) -> Any:
    """The training data loader(s) the trainer will use (``fit_loop._data_source``: the loader passed to ``fit``,
    or the module's / datamodule's ``train_dataloader()``), before Lightning wraps them. ``schedule="auto"`` reads
    one batch from it at setup to profile the model."""
    return trainer.fit_loop._data_source.dataloader()


# lightning/faults.py: private attributes (instance attributes, so tests/unit/test_faults.py checks they exist).
def signal_connector(trainer: Any) -> Any:
    """The trainer's ``_signal_connector`` (lightning/faults.py replaces it with one that defers SIGTERM)."""
    return trainer._signal_connector


def set_signal_connector(trainer: Any, connector: Any) -> None:
    trainer._signal_connector = connector


def skip_sigterm_broadcast(trainer: Any) -> Callable[[], None]:
    """Turn off the training loop's per-step SIGTERM broadcast (``_broadcast_sigterm_tensor``, Lightning >= 2.5): a
    collective and a host read every batch that lightning/faults.py makes redundant (its agreement sets
    ``received_sigterm`` on every rank alike, and the loop raises on it after that batch). Returns the undo."""
    loop = trainer.fit_loop.epoch_loop
    if not callable(getattr(type(loop), "_broadcast_sigterm_tensor", None)):
        return lambda: None  # a Lightning without it: nothing to skip
    loop._broadcast_sigterm_tensor = lambda: None

    def undo() -> None:
        vars(loop).pop("_broadcast_sigterm_tensor", None)

    return undo


def last_checkpoint_step(callback: Any) -> int:
    """The global step a ``ModelCheckpoint`` last saved at (its ``_last_global_step_saved``)."""
    return int(callback._last_global_step_saved)


def save_last_checkpoint(callback: Any, trainer: Any) -> None:
    """``ModelCheckpoint``'s own "last" save, with its monitor candidates (both private methods, checked above)."""
    callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))


def is_last_batch(trainer: Any, phase: str) -> bool:
    """Whether the batch of ``phase`` that just ran is the last one of its loader(s) here: Lightning's fetcher looks
    one batch ahead (``batch_progress.is_last_batch``; always False for a ``dataloader_iter`` step, which cannot)."""
    if phase == "train":
        loop = trainer.fit_loop.epoch_loop
    elif phase == "validate":
        loop = trainer.fit_loop.epoch_loop.val_loop if trainer.state.fn == "fit" else trainer.validate_loop
    else:
        loop = trainer.test_loop if phase == "test" else trainer.predict_loop
    progress = getattr(loop, "batch_progress", None)
    return bool(progress is not None and progress.is_last_batch)


def versions_checked() -> bool:
    """Whether the installed Lightning is a version this module was verified against."""
    return lightning.__version__.startswith(CHECKED_LIGHTNING)
