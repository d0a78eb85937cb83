"""Private Lightning names the adapter builds on (DDPStrategy uses the same ones), resolved at import.

Imported only by :mod:`lightning_pipe.lightning`: a Lightning release that moves one fails at ``import
lightning_pipe`` with a message naming it (see the package docstring for the policy).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import lightning
import torch
from torchmetrics import Metric

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
all_gather_ddp_if_available = _resolve("lightning.fabric.utilities.distributed", "_all_gather_ddp_if_available")
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
# lightning/loading.py: the two modules that read a checkpoint file through fabric's `_load` (imported as
# `pl_load`): LightningModule.load_from_checkpoint's, and TorchCheckpointIO's (a Trainer's resume under other
# strategies). Each looks the name up at call time.
CHECKPOINT_LOADERS = (importlib.import_module("lightning.pytorch.core.saving"),
                      importlib.import_module("lightning.fabric.plugins.io.torch_io"))
for _loader in CHECKPOINT_LOADERS:
    if not callable(getattr(_loader, "pl_load", None)):
        raise ImportError(f"lightning {lightning.__version__}: {_loader.__name__} has no pl_load; lightning_pipe was "
                          f"checked on lightning {CHECKED_LIGHTNING} and wraps it. Update "
                          "lightning_pipe/_compat/lightning.py.")
# lightning/module.py: LightningModule.load_from_checkpoint's decorator (a classmethod that refuses instances).
restricted_classmethod = _resolve("lightning.pytorch.utilities.model_helpers", "_restricted_classmethod")
# lightning/summary.py: the model summary callback's summary object, and Lightning's table of it.
_ModelSummaryCallback = _resolve("lightning.pytorch.callbacks", "ModelSummary")
format_summary_table = _resolve("lightning.pytorch.utilities.model_summary.model_summary", "_format_summary_table")
# lightning/strategy.py: self.log's per-call move of its metric to the value's device (see fast_metric_moves).
_ResultMetric = _resolve("lightning.pytorch.trainer.connectors.logger_connector.result", "_ResultMetric")
_Trainer = _resolve("lightning.pytorch", "Trainer")

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
    _method(_ResultMetric, "to"),  # fast_metric_moves: a move to where the metric already is returns it as is
    _method(_ModelSummaryCallback, "_summary"),  # lightning/summary.py: the whole pipeline's summary
    _method(_Trainer, "_run"),  # requested_weights_only: the argument it holds
)


def summary_depth(callback: Any) -> int:
    """A ``ModelSummary`` callback's ``max_depth`` (its private ``_max_depth``; 0: it prints nothing)."""
    return int(callback._max_depth)


def requested_weights_only(trainer: Any) -> bool | None:
    """The ``weights_only`` of the ``Trainer.fit/validate/test/predict`` call running on ``trainer`` now.

    Lightning 2.6 hands it to ``Strategy.load_checkpoint`` only for strategies that restore before setup: for
    those that restore after it (FSDP's, ModelParallel's, ours) ``Trainer._run`` calls
    ``_restore_modules_and_callbacks(ckpt_path)`` without it, and the strategy sees ``None``. It is a local of
    ``Trainer._run``, read from that frame on the stack; ``None`` when no call is running (or it was not a bool)."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code.co_name == "_run" and frame.f_locals.get("self") is trainer:
                value = frame.f_locals.get("weights_only")
                return value if isinstance(value, bool) else None
            frame = frame.f_back
        return None
    finally:
        del frame  # (a frame kept in a local is a reference cycle)


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


# [Note: self.log's move to the device it is on]
# ``self.log(name, value)`` calls ``_ResultMetric.to(value.device)`` on every call, for a metric that is almost always
# already there. Lightning 2.6 implements that move as ``apply_to_collection`` over the metric's whole ``__dict__``
# (its hooks' dicts, its defaults, its metadata dataclasses, which it rebuilds by deep copy): per logged value, the
# largest single item of a pipeline step's host work beyond torch's (measured in docs/performance.md). While a
# PipelineStrategy runs, a move to a device on which every tensor the move would reach already lies returns the
# metric as it is (what the move computes, without the copies); any other move, and any metric that holds another
# metric, takes Lightning's own path. The walk below reaches what ``apply_to_collection`` reaches (mappings,
# sequences, dataclass fields), so "already there" is exact, not assumed.


def _already_on(values: Iterable[Any], device: torch.device) -> bool:
    """Whether every tensor ``apply_to_collection`` would reach in ``values`` lies on ``device`` (and no Metric)."""
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.device != device:
                return False
        elif value is None or isinstance(value, (str, bytes, int, float)):
            continue
        elif isinstance(value, Metric):
            return False  # a metric inside: moved by its own .to, Lightning's path
        elif isinstance(value, Mapping):
            if value and not _already_on(value.values(), device):
                return False
        elif isinstance(value, Sequence):
            if value and not _already_on(value, device):
                return False
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            if not _already_on([getattr(value, f.name, None) for f in dataclasses.fields(value)], device):
                return False
        # any other object: apply_to_collection leaves it as it is
    return True


def fast_metric_moves() -> Callable[[], None]:
    """Make ``self.log``'s move of a metric to the device it is on free ([Note: self.log's move to the device it is
    on]) until the returned undo runs. Nested installs are counted: the first undo that balances them restores."""
    original = _ResultMetric.__dict__["to"]
    if getattr(original, "_lightning_pipe_original", None) is not None:
        original._lightning_pipe_installs += 1
    else:
        def to(self: Any, *args: Any, **kwargs: Any) -> Any:
            if (len(args) == 1 and not kwargs and isinstance(args[0], torch.device)
                    and _already_on(self.__dict__.values(), args[0])):
                return self
            return original(self, *args, **kwargs)

        to._lightning_pipe_original = original  # type: ignore[attr-defined]
        to._lightning_pipe_installs = 1  # type: ignore[attr-defined]
        _ResultMetric.to = to
    installed = _ResultMetric.__dict__["to"]
    done = [False]

    def undo() -> None:
        if done[0]:
            return
        done[0] = True
        installed._lightning_pipe_installs -= 1
        if installed._lightning_pipe_installs == 0 and _ResultMetric.__dict__.get("to") is installed:
            _ResultMetric.to = installed._lightning_pipe_original

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
