"""What crosses a stage boundary: contiguous tensors, and P2P failures that name what was being sent.

[Note: contiguous on the wire]
Layers may return views (a slice of a padded batch, a transpose, an expanded mask), and ``split_batch`` may hand
over views too. torch's send and receive take contiguous tensors only (gloo: "input tensor has to be contiguous"),
and torch >= 2.12 allocates each receive buffer with the *strides* its metadata recorded on the sending side, so a
non-contiguous output fails on both ranks. Both ends are fixed where the wire is, and nowhere else:

* a send whose tensor is not contiguous sends a contiguous copy instead (the stage's output, the autograd graph
  and what a local neighbour on the same rank receives are untouched);
* a receive into a non-contiguous buffer gets a contiguous buffer of the same shape, dtype and ``requires_grad``
  instead, once: torch keeps the buffer it finds in its receive info, so the layer reads the same values, laid out
  contiguously.

A contiguous tensor passes through as it is (one ``is_contiguous()`` per op): no copy on the hot path.

The stage's outputs get one more rule (:func:`own_outputs`, a forward hook on every stage but the last): an output
that is a view, or not contiguous, is replaced by a contiguous copy of its own, inside the graph. torch's split
backward (I/W schedules) detaches a stage's outputs in place, which a view refuses ("Can't detach views
in-place"), and a contiguous output also gives contiguous metadata, so the receiving stage's buffers and the
gradients it sends back are laid out alike. The copy costs one output-sized copy per micro-batch, only on stages
whose layers return such views.

[Note: naming a failed P2P op]
Each op a stage hands to the schedule carries a :class:`WireTag` (stage, micro-batch, direction, position of the
tensor among the stage's outputs / inputs, peer stage). While the engine runs a schedule step, torch's
``_batch_p2p`` / ``_wait_batch_p2p`` are wrapped (``_compat.swapped_p2p``, undone after the step): an exception
inside them is re-raised as :class:`P2PError` naming the ops of that batch with their tensors' shape, dtype and
layout, on the rank where it happened (``watchdog.describe_failure`` carries that line to the peers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from lightning_pipe._compat import torch as _compat

_TAG = "_lightning_pipe_wire"  # the attribute a tagged torch P2POp carries


class WireTag(NamedTuple):
    """Where one P2P op comes from (a tuple: one is made per op, every micro-batch)."""

    stage: int
    microbatch: int
    kind: str
    """``forward send`` / ``forward receive`` / ``backward send`` / ``backward receive``."""
    position: int | None
    """Index of the tensor among the stage's outputs (forward send, backward receive) or inputs (forward receive,
    backward send); ``None`` when torch's op list could not be matched to them."""
    peer: int | None
    """The peer's stage index, where known."""


class P2PError(RuntimeError):
    """A torch send / receive of the pipeline failed; the message names the ops and their tensors."""


def describe_tensor(t: torch.Tensor) -> str:
    layout = "contiguous" if t.is_contiguous() else f"not contiguous (stride {tuple(t.stride())})"
    return f"shape {tuple(t.shape)}, {t.dtype}, {layout}, on {t.device}"


def describe_op(op: Any) -> str:
    tag: WireTag | None = getattr(op, _TAG, None)
    tensor = describe_tensor(op.tensor) if isinstance(getattr(op, "tensor", None), torch.Tensor) else "no tensor"
    if tag is None:
        return f"an untagged P2P op with global rank {getattr(op, 'peer', '?')} (torch's warm-up?): {tensor}"
    what = "output" if tag.kind in ("forward send", "backward receive") else "input"
    where = f"{what} {tag.position}" if tag.position is not None else f"an {what} (position unknown)"
    toward = " to" if tag.kind.endswith("send") else " from"
    peer = f"{toward} stage {tag.peer}" if tag.peer is not None else ""
    grad = "the gradient of " if tag.kind.startswith("backward") else ""
    return f"stage {tag.stage}, micro-batch {tag.microbatch}, {tag.kind} of {grad}{where}{peer}: {tensor}"


# ------------------------------------------------------------------------------------------------ the stage's ops
def tag_sends(ops: list[Any], stage: int, microbatch: int, kind: str, positions: list[int], peers: list[Any]) -> None:
    """Tag send ops and make their tensors contiguous ([Note: contiguous on the wire]). ``positions`` / ``peers``
    list, in torch's op order, what each op should send; a count that does not match leaves the positions unknown."""
    matched = len(positions) == len(ops)
    for i, op in enumerate(ops):
        if not op.tensor.is_contiguous():
            op.tensor = op.tensor.contiguous()
        setattr(op, _TAG, WireTag(stage, microbatch, kind, positions[i] if matched else None,
                                  peers[i] if matched else None))


def tag_receives(ops: list[Any], infos: Any, stage: int, microbatch: int, kind: str) -> None:
    """Tag receive ops and give a non-contiguous receive buffer a contiguous replacement, in the receive info torch
    reads the received tensor from ([Note: contiguous on the wire])."""
    for op in ops:
        tensor, position, info = op.tensor, None, None
        for i, candidate in enumerate(infos or ()):
            if getattr(candidate, "buffer", None) is tensor:
                position, info = i, candidate
                break
        if info is not None and not tensor.is_contiguous():
            # (a buffer not found in the infos stays: torch's own error, named by P2PError, beats a receive into a
            # buffer torch never reads)
            fresh = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
            op.tensor = info.buffer = fresh.requires_grad_(tensor.requires_grad)
        setattr(op, _TAG, WireTag(stage, microbatch, kind, position, getattr(info, "source", None)))


def own_outputs(module: torch.nn.Module, args: Any, output: Any) -> Any:
    """Forward hook: the stage's views / non-contiguous outputs as contiguous tensors of their own ([Note:
    contiguous on the wire]); ``None`` (the output unchanged) when there is none."""
    tensors = output if isinstance(output, tuple) else (output,)
    if all(not isinstance(t, torch.Tensor) or (t._base is None and t.is_contiguous()) for t in tensors):
        return None
    owned = tuple(t.contiguous() if not t.is_contiguous() else t.clone() if t._base is not None else t
                  if isinstance(t, torch.Tensor) else t for t in tensors)
    return owned if isinstance(output, tuple) else owned[0]


# ------------------------------------------------------------------------------------------------ failures
@contextlib.contextmanager
def named_p2p_failures() -> Iterator[None]:
    """Within the context a failure inside torch's ``_batch_p2p`` / ``_wait_batch_p2p`` raises :class:`P2PError`
    naming the ops ([Note: naming a failed P2P op])."""
    posted: dict[int, list[Any]] = {}  # id(work) -> the ops of its batch, while the work is alive (this step)

    def wrap_batch(original: Callable[..., Any]) -> Callable[..., Any]:
        def batch_p2p(p2p_ops: list[Any], *args: Any, **kwargs: Any) -> Any:
            try:
                works = original(p2p_ops, *args, **kwargs)
            except P2PError:
                raise
            except Exception as err:
                raise P2PError(_message("posting", p2p_ops, err)) from err
            for work in works or ():
                posted[id(work)] = p2p_ops
            return works

        return batch_p2p

    def wrap_wait(original: Callable[..., Any]) -> Callable[..., Any]:
        def wait_batch_p2p(works: list[Any], *args: Any, **kwargs: Any) -> Any:
            try:
                out = original(works, *args, **kwargs)
            except P2PError:
                raise
            except Exception as err:
                ops = list({id(op): op for w in works or () for op in posted.get(id(w), ())}.values())
                raise P2PError(_message("waiting for", ops, err)) from err
            for work in works or ():  # done: its tensors need not outlive it here (torch 2.15 frees them early)
                posted.pop(id(work), None)
            return out

        return wait_batch_p2p

    with _compat.swapped_p2p(wrap_batch, wrap_wait):
        yield


def _message(doing: str, ops: list[Any], err: BaseException) -> str:
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    listed = "; ".join(describe_op(op) for op in ops) if ops else "(the ops of this batch are unknown)"
    return (f"Pipeline P2P failed on global rank {rank} while {doing} {len(ops)} op(s): {listed}. "
            f"torch said: {type(err).__name__}: {' '.join(str(err).split())}")
