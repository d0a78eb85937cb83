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
from lightning_pipe.layers.batches import input_args, leaves, loss_parts, pad_rows, signature, trim_rows
from lightning_pipe.parallel.fsdp import reshard
from lightning_pipe.runtime.microbatches import Microbatches, SplitOverride, explicit_microbatches, microbatch_loss
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
    if mbs is not None:
        return out
    broken = batch_first_rule(out, padded, m, engine.owner)
    return broken if broken is not None else trim_rows(out, rows)


class BrokenRule(str):
    """What :func:`forward_only` returns on the last stage in place of an output that breaks a rule: the message,
    raised on every rank once the step's broadcast has carried it (an error on one rank alone would leave the others
    waiting in that broadcast)."""


def batch_first_rule(out: Any, padded: int, m: int, owner: str) -> BrokenRule | None:
    """[Note: evaluation outputs are joined along dim 0]
    Torch's schedule joins the micro-batches' outputs along dim 0, and a short last batch is padded then trimmed
    there, so evaluation is exact only for outputs with the batch in dim 0. Training computes the loss per
    micro-batch and never joins outputs: a flattened ``[batch * seq, vocab]`` or sequence-first ``[seq, batch, ...]``
    output would train at parity, then predict wrong shapes silently and fail validation inside ``loss_fn`` on the
    last stage alone. Refused here, naming the shape, on every rank."""
    shapes = [tuple(value.shape) for value in leaves(out) if isinstance(value, Tensor)]
    bad = next((shape for shape in shapes if not shape or shape[0] != padded), None)
    if bad is None:
        return None
    return BrokenRule(
        f"{owner}'s last layer returned an output of shape {list(bad)} for {padded} rows ({m} micro-batches of "
        f"{padded // m}) in validation / test / predict. Rule: the pipeline joins the micro-batches' outputs along "
        "dim 0, so the last layer's output has the batch in dim 0 (one row per sample, e.g. [batch, seq, vocab]; "
        "not flattened to [batch * seq, vocab], not sequence-first). Return it batch-first and reshape inside "
        "loss_fn.")


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
    owner = engine.owner
    inputs, target = module.split_batch(batch)
    if target is None:
        raise ValueError(f"compute_loss needs a target, but {owner}.split_batch returned None for it (a batch "
                         "without its 'labels' or 'target' key?).")
    args = input_args(inputs, owner)
    mbs = explicit_microbatches(module, inputs, args, target, engine.plan.microbatches, owner)
    out = forward_only(engine, args, mbs)
    broken = out if isinstance(out, BrokenRule) else None
    if engine.has_last and broken is None:
        with torch.inference_mode(False), torch.no_grad():
            loss = (microbatch_loss(module.loss_fn, out, mbs, owner) if mbs is not None else
                    loss_parts(module.loss_fn(out, target), owner).reduced()).detach().float()
    else:
        loss = torch.zeros((), device=engine.device)
    return broadcast_loss(engine, loss, broken)


def eval_output(engine: Any, module: Any, batch: Any) -> Any:
    """``compute_output``: the last stage's outputs, on every rank."""
    inputs, target = module.split_batch(batch)
    args = input_args(inputs, engine.owner)
    out = forward_only(engine, args, explicit_microbatches(module, inputs, args, target, engine.plan.microbatches,
                                                           engine.owner))
    out = broadcast_object(engine, out)
    if isinstance(out, BrokenRule):
        raise ValueError(str(out))
    return out


def eval_loss_and_output(engine: Any, module: Any, batch: Any) -> tuple[Tensor, Any]:
    """``compute_loss(batch, return_outputs=True)`` in validation / test: the last stage's outputs on every rank
    (one forward), and the loss each rank computes from them (the same value everywhere)."""
    owner = engine._owner
    inputs, target = module.split_batch(batch)
    args = input_args(inputs, owner)
    mbs = explicit_microbatches(module, inputs, args, target, engine.plan.microbatches, owner)
    out = broadcast_object(engine, forward_only(engine, args, mbs))
    if isinstance(out, BrokenRule):
        raise ValueError(str(out))
    with torch.inference_mode(False), torch.no_grad():
        loss = (microbatch_loss(module.loss_fn, out, mbs, owner) if mbs is not None else
                loss_parts(module.loss_fn(out, target), owner).reduced())
    return loss.detach().float(), out


def broadcast_loss(engine: Any, loss: Tensor, broken: BrokenRule | None = None) -> Tensor:
    """The loss exists on the last stage; loggers live on rank 0: give every rank the same value (or the last
    stage's :class:`BrokenRule`, raised on every rank)."""
    loss = loss.detach().to(engine.device, torch.float32).reshape(())
    if engine.plan.pipeline_size > 1:
        # the loss and whether the last stage broke a rule, in one broadcast; the message only when it did. The
        # output's shape is the same for every batch of one signature: the flag is read on the host (a device sync
        # on CUDA) at a signature's first evaluation only.
        packed = torch.stack([loss, loss.new_tensor(float(broken is not None))])
        dist.broadcast(packed, group=engine.groups.pp, group_src=engine.last_pp_rank)
        loss = packed[0]
        key = engine.shapes.signature
        if key not in engine.eval_checked:
            engine.eval_checked.add(key)
            if packed[1].item():
                broken = broadcast_object(engine, broken)
    if broken is not None:
        raise ValueError(str(broken))
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
