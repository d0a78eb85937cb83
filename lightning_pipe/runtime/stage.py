"""The stage every engine builds: torch's ``PipelineStage`` with the shape-inference guard
(``_compat.GuardedPipelineStage``), plus the hooks the engine calls on each stage, declared here as no-ops.

A schedule that needs other stages (weight versions, one update per micro-batch: ``schedules/pipedream/``) subclasses
:class:`PipelineStage`, names the class in ``ScheduleSpec.stage_class`` and overrides the hooks it uses; the engine
calls them on every stage, without asking what kind of stage it holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from lightning_pipe._compat import torch as _compat
from lightning_pipe._compat.stage_shapes import ChunkShapes
from lightning_pipe.layers.stages import LayerContractError
from lightning_pipe.runtime.rng import StageStream
from lightning_pipe.runtime.wire import own_outputs, tag_receives, tag_sends

CallHook = Callable[[Callable[[], Any], tuple[Any, ...], dict[str, Any]], Any]
"""``hook(run, args, kwargs)``: around one call of a stage method; ``run()`` makes the call (through the hooks
registered before this one) and returns its result, which the hook returns (or replaces)."""


class CallHooks:
    """An owned list of hooks around the stage methods torch's schedules call (``forward_one_chunk``,
    ``backward_one_chunk``, ``backward_weight_one_chunk``, ``get_{fwd,bwd}_{send,recv}_ops``).

    [Note: stage call hooks]
    The data-parallel overlap (permanent), the rebalance ``LayerTimer`` (while attached) and the trace recorder
    (per recorded step) each hook the same methods; this registry composes them. The first hook of a method
    installs one dispatcher on the instance (outside any class override: hooks see the call the schedule made), the
    last one removed puts back what was there before. The hook registered last is the outermost; removing one
    leaves the others in place. Users call :meth:`add_call_hook` on the stages they are handed (no import needed).
    """

    def add_call_hook(self, name: str, hook: CallHook) -> Callable[[], None]:
        """Run ``hook`` around every call of ``self.<name>``; returns the function that removes it."""
        registry: dict[str, _Hooked] = self.__dict__.setdefault("_call_hooks", {})
        hooked = registry.get(name)
        if hooked is None:
            hooked = registry[name] = _Hooked(self, name)
        hooked.hooks.append(hook)

        def remove() -> None:
            if hook in hooked.hooks:
                hooked.hooks.remove(hook)
                if not hooked.hooks:
                    hooked.restore()
                    del registry[name]

        return remove


class _Hooked:
    """The hooks of one method of one stage, and what the instance held before the dispatcher."""

    def __init__(self, owner: Any, name: str) -> None:
        self.owner, self.name = owner, name
        self.hooks: list[CallHook] = []
        self.had = name in vars(owner)
        self.before = vars(owner).get(name)
        self.call = getattr(owner, name)

        def dispatch(*args: Any, **kwargs: Any) -> Any:
            return self.run(tuple(self.hooks), args, kwargs)

        setattr(owner, name, dispatch)

    def run(self, hooks: tuple[CallHook, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not hooks:
            return self.call(*args, **kwargs)
        return hooks[-1](lambda: self.run(hooks[:-1], args, kwargs), args, kwargs)

    def restore(self) -> None:
        if self.had:
            setattr(self.owner, self.name, self.before)
        else:
            delattr(self.owner, self.name)


class PipelineStage(CallHooks, ChunkShapes, _compat.GuardedPipelineStage):
    """One stage of one pipeline on this rank (same constructor as ``_compat.GuardedPipelineStage``)."""

    updates_per_microbatch = False
    """The optimizer steps inside the schedule, once per micro-batch (PipeDream): read by the engine and the
    strategy, which then skip the per-batch optimizer step."""
    updater: Any = None
    """What applies a per-micro-batch update (``MicrobatchUpdate``; set by the engine); unused by other stages."""

    random_stream: StageStream | None = None
    """This stage's random stream (set by the engine): [Note: random streams per stage] in rng.py."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._whole_backwards: set[int] = set()  # [Note: a split backward with no input grad]
        if not self.is_last:  # its outputs cross to the next stage ([Note: contiguous on the wire])
            self.submod.register_forward_hook(own_outputs)

    # ------------------------------------------------------------------ compute, in the stage's random stream
    def _in_stream(self, run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        stream = self.random_stream
        if stream is None or stream.held:  # held for the whole step (one stage per rank): nothing to enter
            return run(*args, **kwargs)
        return stream.run(run, *args, **kwargs)

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._in_stream(super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> Any:
        if not full_backward and self._inputs_need_grad is False:  # [Note: a split backward with no input grad]
            self._whole_backwards.add(bwd_chunk_id)
            full_backward = True
        return self._in_stream(super().backward_one_chunk, bwd_chunk_id, loss=loss, full_backward=full_backward,
                               last_backward=last_backward)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> Any:
        if bwd_chunk_id in self._whole_backwards:  # its weight gradients came with its whole backward
            self._whole_backwards.discard(bwd_chunk_id)
            return None
        return self._in_stream(super().backward_weight_one_chunk, bwd_chunk_id, last_backward=last_backward)

    # [Note: a split backward with no input grad]
    # Torch's input half of a split backward (``stage_backward_input``) records, for the weight half, the weights
    # reachable from the stage's inputs that need a gradient. A stage after one with nothing to train (a frozen
    # embedding or backbone, parameter-free layers) receives inputs that need none, so it records no weight at all,
    # and its weight half then computes nothing: its layers never train, silently (torch does the whole backward in
    # the weight half for the first stage only). Such a stage runs its whole backward in the input half instead:
    # the same gradients (there is no input gradient to send), its weight half a no-op. Whether the inputs need a
    # gradient is read at each forward (a pre-hook, split-backward schedules only); it is the same for every
    # micro-batch of a step, since it follows from which earlier layers train.
    _inputs_need_grad: bool | None = None
    """Whether the last forward's tensor inputs needed a gradient (``None``: not watched, no split backward)."""

    def keep_saved_outputs(self) -> None:
        """Under a split backward: hand torch this stage's outputs as aliases it may detach in place
        ([Note: split backward detaches stage outputs]), and watch whether its inputs need a gradient ([Note: a
        split backward with no input grad]). The first stage runs no input backward: nothing to do."""
        if not self.is_first:
            self.submod.register_forward_hook(detachable_outputs)
            self.submod.register_forward_pre_hook(self._watch_inputs)

    def _watch_inputs(self, module: Any, args: tuple[Any, ...]) -> None:
        self._inputs_need_grad = any(isinstance(a, Tensor) and a.requires_grad for a in args)

    def flush_update(self) -> None:
        """Apply an update that is due (per-micro-batch stages); called by the engine after each training step."""

    def stash_live(self) -> None:
        """Keep the current weights as the version the next batch runs on (weight-versioned stages); called by the
        engine right before each optimizer step."""

    # ------------------------------------------------------------------ the wire ([Note: contiguous on the wire])
    # torch builds the ops; these put contiguous tensors in them and tag each with what it carries (wire.py).
    # ``act_send_info`` / ``grad_send_info`` / ``*_recv_info`` are torch's per-stage P2P tables (every checked
    # release); where their order does not match the ops, positions are reported as unknown.
    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[Any]:
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        if ops:
            table = self.act_send_info
            sends = [(i, dst) for i in sorted(table) for dst in table[i] if dst is not None]
            positions, peers = _unzip(sends)
            self._check_send_shapes(ops, positions, fwd_chunk_id)
            tag_sends(ops, self.stage_index, fwd_chunk_id, "forward send", positions, peers)
        return ops

    expected_sends: Callable[[Any, int], list[tuple[int, ...] | None] | None] | None = None
    """(stage, micro-batch) -> the shapes the next stage receives into (set by the engine: ShapeBook)."""

    def _check_send_shapes(self, ops: list[Any], positions: list[int], microbatch: int) -> None:
        """[Note: sends of the receiver's shape]
        The next stage receives into a buffer shaped by the batch's shapes (planned, or inferred per signature),
        not by what this stage computed. A layer whose output shape follows its input's *values* (a data-dependent
        selection) sends another size: a smaller tensor lands in a larger buffer unnoticed in a forward-only pass
        (stale rows read as outputs), a larger one aborts gloo. So every forward send is checked against that
        shape, on the host (shapes only, no device sync)."""
        expected = self.expected_sends(self, microbatch) if self.expected_sends is not None else None
        if expected is None or len(positions) != len(ops):
            return
        for op, position in zip(ops, positions):
            want = expected[position] if position < len(expected) else None
            if want is not None and tuple(op.tensor.shape) != want:
                raise LayerContractError(
                    f"Stage {self.stage_index}, micro-batch {microbatch}: output {position} has shape "
                    f"{tuple(op.tensor.shape)}, but the next stage receives it into {want}, the shape this batch's "
                    "input shapes give. Rule: a layer's output shape follows from its input shapes, not from their "
                    "values (a selection like x[x > 0] or x[:, :n] with n read from the data changes it). Keep such "
                    "a selection inside one stage, or pad its result back to a shape the input decides "
                    "(docs/module-contract.md).")

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[Any]:
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        if ops:
            sends = [(i, dst) for i, dst in enumerate(self.grad_send_info or ()) if dst is not None]
            tag_sends(ops, self.stage_index, bwd_chunk_id, "backward send", *_unzip(sends))
        return ops

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[Any]:
        ops = super().get_fwd_recv_ops(fwd_chunk_id)
        if ops:
            tag_receives(ops, self.args_recv_info.get(fwd_chunk_id), self.stage_index, fwd_chunk_id,
                              "forward receive")
        return ops

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[Any]:
        ops = super().get_bwd_recv_ops(bwd_chunk_id)
        if ops:
            tag_receives(ops, self.grad_recv_info.get(bwd_chunk_id), self.stage_index, bwd_chunk_id,
                              "backward receive")
        return ops


def detachable_outputs(module: Any, args: Any, output: Any) -> Any:
    """Forward hook: each of the stage's outputs that autograd tracks, as an alias torch's in-place detach leaves
    the original alone ([Note: split backward detaches stage outputs]); ``None`` (unchanged) when none is tracked.

    [Note: split backward detaches stage outputs]
    After a split backward's input half (I), torch frees the output side of the graph by detaching the stage's
    outputs *in place* (``stage_backward_input``; on the last stage, ``backward_one_chunk``). The weight half (W)
    runs later on the retained graph, and any node of it that saved one of those very tensors then fails ("Trying to
    use a saved tensor that has been detached in-place"). That happens whenever a stage returns a tensor it also
    fed to a layer with weights: ``f = h + carry; return fc(f), f`` (a residual stream carried along), or a last
    layer returning ``(logits, hidden)``. So under a split backward the stage returns zero-copy aliases that
    autograd does not count as views (``_compat.detachable_alias``): torch detaches the alias, the saved original
    keeps its history, and the gradients flow through the alias unchanged. Views are left alone: torch skips them on
    the last stage, and a non-last stage's views were already made tensors of their own (``own_outputs``, which
    runs first)."""
    tensors = output if isinstance(output, tuple) else (output,)
    tracked = [isinstance(t, Tensor) and t.requires_grad and t._base is None for t in tensors]
    if not any(tracked):
        return None
    aliased = tuple(_compat.detachable_alias(t) if alias else t for t, alias in zip(tensors, tracked))
    return aliased if isinstance(output, tuple) else aliased[0]


def _unzip(pairs: list[tuple[int, Any]]) -> tuple[list[int], list[Any]]:
    return [i for i, _ in pairs], [peer for _, peer in pairs]
