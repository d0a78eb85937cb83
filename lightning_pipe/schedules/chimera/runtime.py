"""The runtime of one Chimera rank: two torch ``PipelineStage`` objects (down and up pipeline) driven from one thread
through a merged per-rank action order ([Note: the merged order] in ``schedules/chimera/spec.py``).

[Note: driving two pipelines from one thread]
Everything that touches the wire is torch's: each stage builds its own send / receive ops
(``get_fwd_recv_ops`` ...) over its own pipeline's process group, and torch's ``_batch_p2p`` / ``_wait_batch_p2p``
post and wait them; compute is the stage's ``forward_one_chunk`` / ``backward_one_chunk``. What this class adds is
only the loop over the merged order:

- before a compute action, its receives are posted and waited (the action cannot run without its input);
- after it, its sends are posted and *not* waited until the end of the step. So a rank only ever blocks on an
  input, which is exactly the dependency model of the simulator's deadlock check: an order the simulator accepts
  cannot hang here. (Waiting on a send early could: its receiver may be blocked on our other pipeline.)
- That holds on gloo, where a posted send progresses on its own. On NCCL a send and a later receive between the same
  two ranks queue on one stream, so two neighbours can each wait behind their own send (torch's 1F1B fuses sends
  with the next receives for this reason): the engine refuses non-CPU devices until that path is built and tested.
- P2P messages carry no tag, so the two pipelines use two process groups, and each stage runs its micro-batches'
  forwards and backwards in order: on each (group, sender, receiver) the sends and receives then match one to one.

Shape inference and the P2P warm-up are torch's too: a single-stage torch schedule per pipeline (``ScheduleGPipe``
over m/2 micro-batches, never stepped in training) owns the "initialized" flags; :meth:`step` asks it to initialise
its stage, the down pipeline on every rank first, then the up one (both chains are blocking and run in that order on
every rank, so they cannot wait on each other). Evaluation and prediction run the down pipeline only, through that
schedule's own ``eval``: its outputs land on the down pipeline's last stage (rank p-1), as with one pipeline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.distributed.pipelining import ScheduleGPipe
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

from lightning_pipe._compat import torch as _compat

DOWN, UP = 0, 1  # the two pipelines


def pipeline_of(microbatch: int, m: int) -> int:
    """The pipeline that runs a (global) micro-batch: the first half goes down, the second half up."""
    return DOWN if microbatch < m // 2 else UP


class ChimeraRuntime:
    """This rank's two stages and its merged order; ``step`` / ``eval`` like a torch schedule."""

    def __init__(self, down: Any, up: Any, actions: list[Any], microbatches: int,
                 loss_fn: Callable[[Any, Any], Tensor]) -> None:
        self.stages = (down, up)
        self.actions = list(actions)
        self.microbatches = microbatches
        self.half = microbatches // 2
        self._loss_fn = loss_fn
        # Shape inference / warm-up per pipeline, and the down pipeline's forward-only runs.
        self.holders = tuple(ScheduleGPipe(st, n_microbatches=self.half, loss_fn=loss_fn, scale_grads=False)
                             for st in self.stages)
        for action in self.actions:
            q = pipeline_of(action.microbatch_index, microbatches)
            if self.stages[q].stage_index != action.stage_index:
                raise RuntimeError(f"Chimera order: action {action} is not for this rank's {('down', 'up')[q]} stage "
                                   f"{self.stages[q].stage_index}")

    def _compute_loss(self, output: Any, target: Any) -> Tensor:
        """The loss of one micro-batch (a method of its own so the trace recorder can time it, as on torch's)."""
        return self._loss_fn(output, target)

    def reset_shapes(self) -> None:
        """Re-infer both pipelines' P2P shapes at the next step ([Note: re-inference on a new shape] in shape_book.py)."""
        for holder in self.holders:
            _compat.reset_schedule_shapes(holder)

    def eval(self, *args: Any, target: Any = None) -> Any:
        """Forward only, over the down pipeline (inputs on rank 0, outputs on rank p-1)."""
        return self.holders[DOWN].eval(*args, target=target)

    def step(self, *args: Tensor, target: Tensor) -> None:
        """One training step over the whole batch: every rank passes the batch's inputs and target; the stages
        that need them (each pipeline's first / last) take their half."""
        arg_mbs, _ = split_args_kwargs_into_chunks(tuple(args), {}, self.microbatches)
        target_mbs = list(target.tensor_split(self.microbatches))
        for stage in self.stages:
            stage.has_backward = True
            stage.clear_runtime_states()
        for q, (stage, holder) in enumerate(zip(self.stages, self.holders)):
            first = q * self.half
            _compat.initialize_stage(holder, arg_mbs[first] if stage.is_first else (),
                                     target_mbs[first] if stage.is_last else None)
        losses: dict[int, Tensor] = {}
        sends: list[list[Any]] = []
        for action in self.actions:
            mb = action.microbatch_index
            q = pipeline_of(mb, self.microbatches)
            stage, chunk = self.stages[q], mb - q * self.half
            if action.computation_type.value == "F":
                _compat.wait_batch_p2p(_compat.batch_p2p(stage.get_fwd_recv_ops(chunk), "fwd_recv"))
                output = stage.forward_one_chunk(chunk, arg_mbs[mb] if stage.is_first else (), {},
                                                 save_forward_output=False)
                if stage.is_last:
                    losses[mb] = self._compute_loss(output, target_mbs[mb])
                sends.append(_compat.batch_p2p(stage.get_fwd_send_ops(chunk), "fwd_send"))
            else:
                _compat.wait_batch_p2p(_compat.batch_p2p(stage.get_bwd_recv_ops(chunk), "bwd_recv"))
                stage.backward_one_chunk(chunk, loss=losses.pop(mb, None), last_backward=chunk == self.half - 1)
                sends.append(_compat.batch_p2p(stage.get_bwd_send_ops(chunk), "bwd_send"))
        for works in sends:  # only after the whole order: an early wait could block (see the note above)
            _compat.wait_batch_p2p(works)
