"""Failures and preemption under :class:`~lightning_pipe.PipelineStrategy`: every rank stops, none hangs.

Two mechanisms, wired into the strategy's hooks by :class:`PipelineFaults` (one per trainer run):

* **a failure on one rank** is written to the store and stops the others ([Note: failure propagation] in
  :mod:`lightning_pipe.runtime.watchdog`);
* **SIGTERM** (SLURM preemption, Kubernetes) stops every rank together at a step boundary ([Note: SIGTERM at a
  step boundary]).

[Note: SIGTERM at a step boundary]
Lightning 2.6's SIGTERM handler runs ``dist.broadcast`` *inside the signal handler*. Under the pipeline the signal
lands mid-schedule: rank 0 enters the broadcast while rank 1 is blocked on rank 0's next activation, and both wait
until the process-group timeout. Our handler only records the signal (and forwards it to the ranks this process
launched, as Lightning does); no collective, no I/O. After every step each rank joins a MAX all-reduce of "SIGTERM
seen here" over the world (:func:`~lightning_pipe.runtime.watchdog.any_rank`; in training it rides the step's loss
all-reduce instead: [Note: one collective at the step's end] in runtime/agreement.py, and Lightning's own per-step
SIGTERM broadcast, redundant then, is skipped), so all ranks learn it at the same step and
then stop the way Lightning stops on SIGTERM (``SIGTERMException``, exit code 0, the callbacks' ``on_exception``):
in training after the optimizer step that closes the current accumulation window, in evaluation and prediction
after the current batch. Because every rank is at the same point, checkpoint saves (collective here) work:
``ModelCheckpoint(save_on_exception=True)`` and ``OnExceptionCheckpoint`` save as usual, and a
``ModelCheckpoint(save_last=True)`` also saves ``last`` then, so a preempted run resumes from where it stopped. If
the ranks have not agreed within :data:`SIGTERM_DEADLINE_S` (a rank stuck outside any step), the process ends anyway.
SLURM's requeue signal (SIGUSR1 with ``SLURMEnvironment(auto_requeue=True)``) has the same problem — Lightning saves
a checkpoint inside its handler — and the same cure: recorded in the handler, agreed in the same all-reduce, and
Lightning's requeue (checkpoint, ``scontrol requeue``) run by every rank at that step boundary: in training at the
end of the batch whose optimizer step closes the accumulation window (``on_train_batch_end``, where
``ModelCheckpoint(every_n_train_steps=...)`` saves), so the checkpoint holds that step's parameters, optimizer and
scheduler state and the loop resumes at the next batch; in evaluation and prediction after the current batch.

[Note: the same last batch]
Every rank iterates its own data loader; the stages of a pipeline (and its tensor ranks, and the replicas, which
average each step) must run the same number of batches. A rank whose loader yields fewer (a per-rank
``limit_train_batches``, an uneven shard, an iterable dataset) would end its epoch and wait in the next collective
while the others wait for its transfers of the next batch: a silent hang until the process-group timeout. Lightning's
fetcher looks one batch ahead, so after each step every rank knows whether that was its last batch; "last here" and
"more here" ride in the SIGTERM all-reduce above (no collective of their own), and if both are set somewhere, every
rank raises the same error at that step, naming who ran out after how many batches.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.environments import LightningEnvironment
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_pipe._compat import lightning as _compat
from lightning_pipe.config import PipelineConfigError, config_error
from lightning_pipe.lightning.liveness import start_watch, step_status
from lightning_pipe.lightning.same_call import StuckInStep, step_of
from lightning_pipe.runtime.watchdog import FailureWatch, any_rank, consequence_note

DEFAULT_TIMEOUT = timedelta(minutes=10)
"""The process-group timeout: how long one collective or P2P transfer may wait before it fails.

A failed rank stops its peers within seconds through the store, and SIGTERM and dead processes end a run at once,
so this limit only ends a rank that waits on a peer which is alive but stuck (a hung data loader, a deadlock). It
must still exceed the longest *legitimate* one-sided wait: a downstream stage waiting while the stages before it
compile or run their first step, or while local rank 0 runs ``prepare_data``. 10 minutes is torch's own NCCL
default (Lightning and gloo use 30); raise it with ``PipelineStrategy(timeout=...)`` for longer one-sided work."""

SIGTERM_DEADLINE_S = 25.0
"""Seconds after SIGTERM by which the ranks must have agreed to stop; later, this process ends without a
checkpoint. torchrun, SLURM and Kubernetes follow SIGTERM with SIGKILL after 30 s by default: this ends first, with
its message. When a peer or the store has already fallen silent, the process ends at once ([Note: heartbeats])."""


def resolve_timeout(timeout: timedelta | float | int | None) -> timedelta:
    """``PipelineStrategy(timeout=...)``: a ``timedelta`` or seconds (Hydra passes numbers); None: the default."""
    if timeout is None:
        return DEFAULT_TIMEOUT
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise config_error(
            "The process-group timeout (how long a rank waits on another in one transfer) must be a positive "
            "duration.", f"timeout={timeout!r}", "timeout",
            "give seconds (e.g. 600) or a datetime.timedelta; null for the default of 10 minutes")
    return timedelta(seconds=float(seconds))


class PipelineSignalConnector(_compat.SignalConnector):
    """Lightning's signal connector whose SIGTERM handler only records the signal ([Note: SIGTERM at a step
    boundary]); everything else (SLURM requeue, handler restore at teardown) is Lightning's."""

    def __init__(self, trainer: Trainer, faults: PipelineFaults) -> None:
        super().__init__(trainer)
        self.faults = faults

    def _sigterm_notifier_fn(self, signum: Any, _: Any) -> None:
        # A signal handler: no collective, no I/O (printing here can raise "reentrant call" on a busy stream).
        self.faults.sigterm_received(signum)

    def _slurm_sigusr_handler_fn(self, signum: Any, _: Any) -> None:
        # SLURM auto-requeue: Lightning saves a checkpoint right in the handler (a collective here); every rank runs
        # Lightning's handler later, at the same step boundary (PipelineFaults.after_step).
        self.faults.requeue_pending = True

    def run_requeue(self) -> None:
        """Lightning's SLURM requeue (checkpoint, then ``scontrol requeue`` on rank 0), outside the signal handler."""
        _compat.SignalConnector._slurm_sigusr_handler_fn(self, signal.SIGUSR1, None)

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["faults"] = None  # holds a thread; a spawned rank builds its own at setup
        return state


class _FaultHooks(Callback):
    """The fault handling's two places in Lightning's callback order, first among the callbacks (one callback:
    Lightning calls every hook of every callback on every batch, overridden or not):

    * ``on_train_batch_end``: an agreed SLURM requeue runs after the optimizer step ([Note: SIGTERM at a step
      boundary]): the training step itself runs before it, so a checkpoint saved there would hold the parameters of
      the step before;
    * ``on_exception``: a failure is reported before the checkpoint callbacks' ``on_exception`` (Lightning runs
      checkpoint callbacks last): their save is collective and would otherwise wait on peers that do not know yet."""

    def __init__(self, faults: PipelineFaults) -> None:
        self.faults = faults

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.faults.requeue_if_due()

    def on_exception(self, trainer: Trainer, pl_module: Any, exception: BaseException) -> None:
        self.faults.report(exception)


class PipelineFaults:
    """One trainer run's failure watch and SIGTERM agreement on this rank (see the module docstring)."""

    def __init__(self, strategy: Any, trainer: Trainer, watch: FailureWatch) -> None:
        self.strategy = strategy
        self.trainer: Any = trainer  # Lightning sets several of the attributes used here outside __init__
        self.watch = watch
        self.sigterm_pending = False
        self.stopping = False  # every rank agreed to stop on SIGTERM
        self.requeue_pending = False  # SLURM's requeue signal (SIGUSR1), recorded by the handler
        self._requeued = False
        self._requeue_due = False  # agreed in training: runs at the end of the batch (_FaultHooks)
        self.failed = False
        self.heartbeat = getattr(watch, "heartbeat", None)  # [Note: heartbeats]; None: no liveness watch
        self._hooks = _FaultHooks(self)
        self._undo_skip: Any = None

    @classmethod
    def start(cls, strategy: Any, heartbeat_timeout: float | None = None) -> PipelineFaults | None:
        """Start watching (after the process group exists; a collective: every rank calls it). None on one rank."""
        if strategy.world_size < 2 or strategy.lightning_module is None:
            return None
        trainer: Any = strategy.lightning_module.trainer
        holder: list[PipelineFaults] = []
        parent = os.getppid()
        watch = start_watch(strategy, heartbeat_timeout, before_exit=lambda: _end_launched_ranks(strategy, parent),
                            on_signal=lambda signum: holder[0].signal_seen(signum) if holder else None)
        watch.checks.append(StuckInStep(strategy.global_rank, lambda: step_of(strategy)))  # [Note: every rank saves]
        faults = cls(strategy, trainer, watch)
        holder.append(faults)
        connector = _compat.signal_connector(trainer)
        if isinstance(connector, PipelineSignalConnector):
            connector.faults = faults
        else:
            _compat.set_signal_connector(trainer, PipelineSignalConnector(trainer, faults))
        trainer.callbacks.insert(0, faults._hooks)
        # Lightning's own per-step SIGTERM broadcast: redundant under this agreement ([Note: SIGTERM at a step
        # boundary]); one collective less per step.
        faults._undo_skip = _compat.skip_sigterm_broadcast(trainer)
        watch.start()
        return faults

    # ------------------------------------------------------------------ failures
    def report(self, exception: BaseException) -> None:
        """This rank failed: tell the others (once). An agreed SIGTERM stop is not a failure."""
        self.watch.hold_if_ending()  # the watch is ending this process: this error is only a consequence
        if self.failed or (isinstance(exception, SIGTERMException) and self.stopping):
            return
        self.failed = True
        self.watch.report(exception)
        cause = self.watch.cause_of(exception)
        if cause is not None:  # this rank's error is only gloo's / NCCL's "the peer is gone": name the cause
            note = consequence_note(self.strategy.global_rank, cause)
            exception.add_note(note)
            try:
                sys.stderr.write(note + "\n")
                sys.stderr.flush()
            except Exception:
                pass

    def before_step(self, phase: str, batch_idx: int | None) -> None:
        """What this rank is doing, for its peers' messages if it falls silent ([Note: heartbeats])."""
        if self.heartbeat is not None:
            self.heartbeat.status = step_status(phase, batch_idx, self.trainer)

    # ------------------------------------------------------------------ SIGTERM
    def signal_seen(self, signum: int) -> None:
        """On the watch's guard thread, as soon as a signal arrives, even while the main thread waits in a native
        call and its handler cannot run ([Note: signals while blocked] in runtime/watchdog.py)."""
        if signum == signal.SIGTERM:
            self.sigterm_received(signum)

    def sigterm_received(self, signum: Any) -> None:
        """Called from the signal handler: record, forward to launched ranks, arm the deadline."""
        if self.sigterm_pending:
            return
        self.sigterm_pending = True
        launcher = self.strategy.launcher
        if launcher is not None and hasattr(launcher, "kill"):
            launcher.kill(signum)  # the ranks this process started (Lightning's popen launcher) stop with us
        if self.heartbeat is not None and self.heartbeat.contact_lost():  # no step boundary can come: a peer or the store is silent
            self.watch.set_deadline(0.0, f"lightning_pipe: rank {self.strategy.global_rank} received SIGTERM while "
                                    "a peer or the rendezvous store is silent (no step can end); exiting now, "
                                    "without a checkpoint, with code 143.", 143)
            return
        self.watch.set_deadline(
            SIGTERM_DEADLINE_S,
            f"lightning_pipe: rank {self.strategy.global_rank} received SIGTERM {SIGTERM_DEADLINE_S:.0f} s ago and "
            "the ranks did not reach a step boundary together (a rank is stuck outside a step); exiting now, "
            "without a checkpoint, with code 143.", 143)

    def train_flags(self) -> list[bool]:
        """What :meth:`after_step` agrees on after a training step; the engine reads them during the step and
        agrees them with the step's loss ([Note: one collective at the step's end] in runtime/agreement.py)."""
        return self._flags("train")

    def _flags(self, phase: str) -> list[bool]:
        last = _compat.is_last_batch(self.trainer, phase)
        return [self.sigterm_pending, self.requeue_pending and not self._requeued, last, not last]

    def after_step(self, phase: str, batch_idx: int | None) -> None:
        """Every rank, after every step: agree on SIGTERM ([Note: SIGTERM at a step boundary]) and on where the
        epoch ends ([Note: the same last batch]), in one all-reduce (in training: the one of the step's loss)."""
        engine = getattr(self.strategy, "engine", None)
        agreed = engine.take_agreed_flags() if phase == "train" and engine is not None else None
        if self.heartbeat is not None:
            self.heartbeat.status = step_status(phase, batch_idx, self.trainer, done=True)
        if not self.stopping:
            last = _compat.is_last_batch(self.trainer, phase)
            group = self._step_group(phase, engine)
            if agreed is None:
                agreed = any_rank(self._flags(phase), self.strategy.root_device, group)
            sigterm, requeue, last_somewhere, more_somewhere = agreed
            if last_somewhere and more_somewhere:
                raise uneven_batches_error(phase, batch_idx, last, self.strategy.global_rank, group)
            if requeue:
                self._requeued = True  # once per run: ranks may get the signal a step apart
                self._requeue_due = True
                if phase != "train":
                    self.requeue_if_due()
            if not sigterm:
                return
            self.stopping = True
            self.watch.clear_deadline()
            rank_zero_info(f"lightning_pipe: SIGTERM received: every rank stops together at the end of the current "
                           f"{'training' if phase == 'train' else phase} batch.")
        if phase != "train":
            raise SIGTERMException
        accumulate = max(1, self.trainer.accumulate_grad_batches)
        if batch_idx is None or (batch_idx + 1) % accumulate == 0:
            # Lightning raises SIGTERMException after this batch's optimizer step (training_epoch_loop).
            _compat.signal_connector(self.trainer).received_sigterm = True

    def requeue_if_due(self) -> None:
        """Lightning's requeue (checkpoint, ``scontrol requeue`` on rank 0) once the ranks agreed on it; in training
        only after the optimizer step that closes the accumulation window (every rank at the same batch)."""
        if not self._requeue_due or (self.trainer.training and _compat.should_accumulate(self.trainer)):
            return
        self._requeue_due = False
        _compat.signal_connector(self.trainer).run_requeue()

    @staticmethod
    def _step_group(phase: str, engine: Any) -> Any:
        """The ranks that agree after a step: the world, except in predict, where no step meets another replica
        (nothing is averaged, nothing is logged across ranks) and Lightning's sampler gives replicas unequal
        shares when the data does not divide: there one replica's ranks (None: the world), unless expert
        parallelism exchanges tokens across replicas in every forward."""
        if phase != "predict" or engine is None or engine.groups.experts is not None:
            return None
        return engine.groups.replica

    def on_exception(self, exception: BaseException) -> None:
        """Strategy.on_exception: a failure is reported; an agreed SIGTERM stop saves ``last`` when asked."""
        self.report(exception)
        if isinstance(exception, SIGTERMException) and self.stopping:
            _save_last_on_preemption(self.trainer)

    def stop(self) -> None:
        """Strategy.teardown. After a normal end (or an agreed stop) every rank stops polling before any may exit:
        the store lives in rank 0's process, and a peer still polling it would log a failed connection."""
        if self._hooks in self.trainer.callbacks:
            self.trainer.callbacks.remove(self._hooks)
        if self._undo_skip is not None:
            self._undo_skip()
        if not self.failed:
            self.strategy.barrier("lightning_pipe.faults.stop")
        else:
            self.watch.wait_seen()  # peers read this failure before this process (maybe the store's) ends
        self.watch.stop()


def uneven_batches_error(phase: str, batch_idx: int | None, last: bool, rank: int,
                         group: Any = None) -> PipelineConfigError:
    """Every rank of ``group`` (None: the world), when some of them just ran their last batch of ``phase`` and
    others have more: which ran out, after how many batches (one gather, on this error path only), as the error
    every rank raises."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (rank, last), group=group)
    done = [r for r, is_last in gathered if is_last]
    more = [r for r, is_last in gathered if not is_last]
    count = "?" if batch_idx is None else str(batch_idx + 1)
    what = {"train": "training", "validate": "validation"}.get(phase, phase)
    setting = {"train": "limit_train_batches", "validate": "limit_val_batches", "test": "limit_test_batches",
               "predict": "limit_predict_batches"}.get(phase, "limit_train_batches")
    if phase == "predict":
        rule = ("Rule: the ranks of one replica (its pipeline stages, FSDP shards and tensor ranks; with expert "
                "parallelism every rank) pass each predict batch through together, so the rest would wait forever "
                "(replicas may predict different numbers of batches). Give those ranks the same batches: a predict "
                "dataset whose length divides by data_parallel_size x fsdp_size (Lightning's predict sampler does "
                f"not pad), the same Trainer({setting}=...) everywhere, or an IterableDataset that yields as many "
                "batches on each of them.")
    else:
        rule = ("Rule: every rank runs the same batches of an epoch (the stages and tensor ranks of a pipeline pass "
                "each batch through together, and replicas average every step), so the rest would wait for each "
                f"other forever. Give every rank the same number of batches: the same Trainer({setting}=...) "
                "everywhere, a DistributedSampler (Lightning adds one; it pads the shards to equal length), an "
                "IterableDataset that yields as many batches on every rank.")
    return PipelineConfigError(
        f"The ranks' {what} data ends at different batches: rank(s) {done} ran out after {count} batches (batch_idx "
        f"{batch_idx} was their last) while rank(s) {more} have more. " + rule)


def _save_last_on_preemption(trainer: Any) -> None:
    """Every ``ModelCheckpoint(save_last=...)`` writes ``last`` now, unless it already saved at this step (or saves
    on exception by itself)."""
    if trainer.sanity_checking or trainer.fast_dev_run or trainer.state.fn != TrainerFn.FITTING:
        return
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint) or not callback.save_last:
            continue
        if getattr(callback, "save_on_exception", False) or _compat.last_checkpoint_step(callback) == trainer.global_step:
            continue
        _compat.save_last_checkpoint(callback, trainer)
        rank_zero_info(f"lightning_pipe: saved {callback.last_model_path} at global step {trainer.global_step} "
                       "after SIGTERM; resume with ckpt_path=\"last\" (or that path).")


OUTLIVE_LAUNCHER_S = 10.0
"""How long a rank Lightning's popen launcher started waits, before ending on its watch, for the launching process."""


def _end_launched_ranks(strategy: Any, launcher_pid: int) -> None:
    """Before this process ends on its watch (a peer's failure, a silent peer, a step a peer's save waits on).

    [Note: a launched rank outlives no launcher]
    The launching process (local rank 0 of Lightning's popen launcher) ends the ranks it launched, as Lightning does
    on Ctrl-C, so none outlives the run. A launched rank first waits, up to :data:`OUTLIVE_LAUNCHER_S`, for the
    launching process to end: Lightning's child observer SIGKILLs that process as soon as it sees a launched rank end
    with an error, which would cut off the launching rank's own error (often the cause) before it is printed. Meanwhile
    this rank's main thread, woken by the launcher's closing connections, waits too (``hold_if_ending``)."""
    launcher = strategy.launcher
    if isinstance(launcher, _compat.SubprocessScriptLauncher):  # this process launched the node's other ranks
        launcher.kill(signal.SIGKILL)
        return
    if type(strategy.cluster_environment) is not LightningEnvironment or strategy.local_rank == 0:
        return  # not a rank Lightning's launcher started (torchrun, SLURM: no observer ends the others)
    end = time.monotonic() + OUTLIVE_LAUNCHER_S
    while os.getppid() == launcher_pid and time.monotonic() < end:
        time.sleep(0.05)


__all__ = ["DEFAULT_TIMEOUT", "PipelineFaults", "PipelineSignalConnector", "resolve_timeout"]
