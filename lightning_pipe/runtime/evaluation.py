"""The engine's forward-only path: validation, test and predict under a training schedule's layout.

Evaluation runs the schedule's forward actions only (``_compat.forward_only_actions``), pads a short last batch to
a shape torch already knows (where no shape planner does it for free), keeps accumulated gradients across torch's
shape inference, and gives every rank the last stage's result: loggers live on rank 0, the loss on the last stage.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_pipe._compat import torch as _compat
from lightning_pipe._compat.stage_shapes import SplitOverride
from lightning_pipe.layers.batches import input_args, loss_parts, pad_rows, signature, trim_rows
from lightning_pipe.parallel.fsdp import reshard
from lightning_pipe.runtime.microbatches import Microbatches, explicit_microbatches, microbatch_loss
from lightning_pipe.runtime.shapes import first_inputs, shapes_of
from lightning_pipe.runtime.wire import named_p2p_failures

# ``engine`` is the PipelineEngine (engine.py imports this module).


def forward_only(engine: Any, args: tuple[Tensor, ...], mbs: Microbatches | None = None) -> Any:
    """The last stage's outputs for ``args`` (a list of the micro-batches' outputs for explicit ``mbs``); ``None``
    on ranks without the last stage."""
    m, rows = engine.plan.microbatches, args[0].shape[0]
    if mbs is not None:
        sig = signature("eval", mbs.args[0], mbs.args[0][0].shape[0])
        engine.shapes.use(sig, shapes_of(mbs.args), explicit=True)
        padded = m
    else:
        sig = signature("eval", args, math.ceil(rows / m))
        known = engine.shapes.signature
        if (engine.shapes.planner is None and known is not None and known.rows > sig.rows
                and known == sig.with_rows(known.rows)):
            sig = known  # a short last batch: pad to the shape torch already knows
        padded = sig.rows * m
        engine.shapes.use(sig, first_inputs(pad_rows(args, padded), m), explicit=False)
    # Torch's shape inference for an FSDP stage clears its .grad (stage.py, _post_metadata_inference_cleanup):
    # validation in the middle of gradient accumulation must not lose the accumulated gradients.
    kept = [p.grad for p in engine.parameters]
    split = (SplitOverride(engine.schedule, mbs.args if engine.has_first else None, m, keep_chunks=True)
             if mbs is not None else contextlib.nullcontext())
    # Lightning evaluates under inference_mode; torch's P2P buffers must stay ordinary tensors so that the
    # next training step can reuse them, so run under no_grad instead.
    with torch.inference_mode(False), torch.no_grad(), _compat.forward_only_actions(engine.schedule), \
            named_p2p_failures(), split:
        step_args = pad_rows(args, padded) if engine.has_first and mbs is None else ()
        dummy_target = torch.zeros(padded, device=engine.device) if engine.has_last else None
        out = engine.schedule.eval(*step_args, target=dummy_target)
    release_outputs(engine.stages)
    engine.shapes.planned = None
    # FSDP: gathered weights would be stale after the next step ([Note: FSDP under the pipeline schedule])
    reshard(engine.stage_modules)
    for p, grad in zip(engine.parameters, kept):
        p.grad = grad
    if not engine.has_last:
        return None
    return out if mbs is not None else trim_rows(out, rows)


def release_outputs(stages: list[Any]) -> None:
    """Drop what torch's stages keep of a forward-only step once its result is in hand.

    [Note: evaluation keeps no stage outputs]
    Torch's stages keep every micro-batch's output (``output_chunks``, last stage) and its inputs and outputs for the
    backward (``fwd_cache``) until the *next* step clears them; a forward-only step has no backward to pop them. So
    while the last stage computed the eval loss, three copies of the batch's outputs coexisted: the chunks, the
    merged batch ``eval`` returned, and the loss's temporaries (for a language model, logits-sized each); and every
    stage held the batch's boundary activations through the rest of the validation step. ``clear_runtime_states``
    (public, on every supported torch) is what the next step would run first; nothing reads the cleared state in
    between: the merged result is a new tensor (``keep_chunks`` returns a new list).
    """
    for stage in stages:
        stage.clear_runtime_states()


def eval_loss(engine: Any, module: Any, batch: Any) -> Tensor:
    """The batch's loss in validation / test, the same value on every rank."""
    owner = engine._owner
    inputs, target = module.split_batch(batch)
    if target is None:
        raise ValueError(f"compute_loss needs a target, but {owner}.split_batch returned None for it.")
    args = input_args(inputs, owner)
    mbs = explicit_microbatches(module, inputs, args, target, engine.plan.microbatches, owner)
    out = forward_only(engine, args, mbs)
    if engine.has_last:
        with torch.inference_mode(False), torch.no_grad():
            loss = (microbatch_loss(module.loss_fn, out, mbs, owner) if mbs is not None else
                    loss_parts(module.loss_fn(out, target), owner).reduced()).detach().float()
    else:
        loss = torch.zeros((), device=engine.device)
    return broadcast_loss(engine, loss)


def eval_output(engine: Any, module: Any, batch: Any) -> Any:
    """``compute_output``: the last stage's outputs, on every rank."""
    inputs, target = module.split_batch(batch)
    args = input_args(inputs, engine._owner)
    out = forward_only(engine, args, explicit_microbatches(module, inputs, args, target, engine.plan.microbatches,
                                                           engine._owner))
    return broadcast_object(engine, out)


def broadcast_loss(engine: Any, loss: Tensor) -> Tensor:
    """The loss exists on the last stage; loggers live on rank 0: give every rank the same value."""
    loss = loss.detach().to(engine.device, torch.float32).reshape(())
    if engine.plan.pipeline_size > 1:
        loss = loss.contiguous()
        dist.broadcast(loss, group=engine.groups.pp, group_src=engine.last_pp_rank)
    return loss


def broadcast_object(engine: Any, obj: Any) -> Any:
    if engine.plan.pipeline_size == 1:
        return obj
    holder = [obj if engine.has_last else None]
    if engine.has_last and isinstance(obj, Tensor):
        holder = [obj.cpu()]
    dist.broadcast_object_list(holder, group=engine.groups.pp, group_src=engine.last_pp_rank,
                               device=engine.device if engine.device.type == "cuda" else None)
    out = holder[0]
    return out.to(engine.device) if isinstance(out, Tensor) else out
