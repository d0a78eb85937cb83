"""Batches as the engine sees them: inputs and target checked on every rank, the shape signature that decides when
torch must re-infer its buffers, padding of short evaluation batches, and the loss contract.

[Note: token-weighted loss]
``loss_fn`` returns either a scalar tensor, the *mean* over the batch's samples, or a pair ``(sum, count)``: the sum
of per-item losses and how many items it sums over (e.g. tokens whose label is not -100). A mean averages well over
equal micro-batches; a masked-LM mean does not (micro-batches hold different numbers of tokens), so for the pair the
batch loss is ``global sum / global count`` across micro-batches and data-parallel replicas, as on one device over
the whole batch (``sum / max(count, 1)``). The backward is linear in the loss, so the engine runs the schedule with
each micro-batch's *sum* as the loss (times ``1 / (accumulate_grad_batches * N)``, ``N`` the batch's target element
count, only so that gradient magnitudes stay those of a mean, which matters to fp16 loss scaling), learns the counts
on the last stage, and then multiplies this batch's fresh gradients by ``N * dp / global_count`` — ``dp``
because the replicas' gradients are averaged afterwards (lightning_pipe/parallel/grads.py). Where they are averaged
*before* that factor (the overlapped data-parallel sync, FSDP's reduce-scatter in the schedule, expert gradients
that sum several replicas' losses), ``N`` is the data ranks' mean count, the same on every rank: a per-rank factor
applied after averaging would scale each shard's slice by its own rank's count (a padded batch holds different counts
per rank). With ``accumulate_grad_batches`` each batch is normalised by its own count, as Lightning does on one device.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from lightning_pipe.config import PipelineConfigError, config_error
from lightning_pipe.layers.stages import LayerContractError, check_layer_io, layer_args

TensorSpec = tuple[tuple[int, ...], torch.dtype, bool]  # shape without the batch rows, dtype, requires_grad


@dataclass(frozen=True)
class Signature:
    """What torch's P2P buffers depend on: the mode and the shapes/dtypes of one micro-batch's inputs (and target)."""

    mode: str
    """``train`` or ``eval``."""
    rows: int
    """Rows of one micro-batch."""
    inputs: tuple[TensorSpec, ...]
    target: tuple[TensorSpec, ...] = ()

    def with_rows(self, rows: int) -> Signature:
        return replace(self, rows=rows)

    def structure(self) -> Signature:
        """What torch's inferred state depends on once shapes are planned (runtime/shapes.py): the mode and each
        tensor's rank, dtype and requires_grad — no rows, no lengths."""
        def ranks(specs: tuple[TensorSpec, ...]) -> tuple[TensorSpec, ...]:
            return tuple(((len(shape),), dtype, grad) for shape, dtype, grad in specs)
        return Signature(self.mode, 0, ranks(self.inputs), ranks(self.target))


def _spec(t: Tensor) -> TensorSpec:
    return tuple(t.shape[1:]), t.dtype, t.requires_grad


def signature(mode: str, args: tuple[Tensor, ...], mb_rows: int, target: Any = None) -> Signature:
    targets = tuple(_spec(t) for t in leaves(target) if isinstance(t, Tensor) and t.dim() > 0)
    return Signature(mode, mb_rows, tuple(_spec(a) for a in args), targets)


def input_args(inputs: Any, owner: str) -> tuple[Tensor, ...]:
    """``split_batch``'s inputs as the first layer's positional arguments, checked on every rank before any waits:
    tensors (or a tuple of them) that all hold the batch in dim 0; contiguous.

    A view (a collator's ``v[:, :longest]``, an expanded mask) is copied once, contiguous: torch cuts the batch into
    micro-batches along dim 0 and torch 2.11 checks every micro-batch against the first one's strides, which a
    contiguous batch's row blocks share ([Note: contiguous on the wire] in runtime/wire.py). A contiguous input is
    used as it is."""
    check_layer_io(inputs, f"{owner}.split_batch returned inputs that are")
    args = layer_args(inputs)
    rows = {a.shape[0] if a.dim() > 0 else None for a in args}
    if None in rows or len(rows) != 1:
        raise LayerContractError(
            f"{owner}.split_batch returned inputs of shapes {[tuple(a.shape) for a in args]}. Rule: every input "
            "holds the batch in dim 0, with the same number of rows (the pipeline cuts micro-batches along it). "
            "Move the batch to dim 0, or pass batch-independent values as module attributes instead of inputs.")
    return tuple(a if a.is_contiguous() else a.contiguous() for a in args)


def check_target(target: Any, microbatches: int, owner: str, rows: int | None = None) -> Tensor:
    """A training target is one tensor whose dim 0 divides into the micro-batches: torch cuts it like the inputs.
    A dict / tuple / list of such tensors is accepted too when ``rows`` (the inputs' batch rows) is given: every
    tensor in it must then hold those rows in dim 0 ([Note: structured targets])."""
    if isinstance(target, Tensor) and target.dim() > 0 and target.shape[0] % microbatches == 0:
        return target
    if rows is not None and isinstance(target, (dict, tuple, list)):
        found = leaves(target)
        if found and all(isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == rows for t in found):
            return target  # type: ignore[return-value]  # the engine gives torch row indices instead
    seen = (f"a tensor of shape {tuple(target.shape)}" if isinstance(target, Tensor)
            else "None" if target is None else _describe_tree(target))
    raise LayerContractError(
        f"{owner}.split_batch returned a training target that is {seen}, with microbatches={microbatches}"
        + (f" and {rows} input rows" if rows is not None else "") + ". Rule: in training the target is a tensor "
        "with the batch in dim 0, or a dict / tuple / list of such tensors with the inputs' rows in dim 0 (it is "
        "cut into micro-batches with the inputs and given to loss_fn on the last stage, in the same structure). "
        "Return `(inputs, target)` with such a target from split_batch."
        + (" None usually means the batch holds no target at all: a dict batch without its 'labels' (transformers' "
           "collators, HFCausalLM) or 'target' key." if target is None else ""))


def rows_mismatch(owner: str, output: Any, target: Any, err: Exception, microbatches: int, batch_idx: Any
                  ) -> PipelineConfigError | None:
    """A failed loss whose output (from the first stage's batch) and target (this rank's batch) disagree in rows:
    the pipeline's ranks read different batches. Said only on failure (a layer may reshape its rows)."""
    def rows(value: Any) -> int | None:
        if isinstance(value, (tuple, list)) and value:
            return rows(value[0])
        if isinstance(value, dict) and value:
            return rows(next(iter(value.values())))
        return value.shape[0] if isinstance(value, Tensor) and value.dim() > 0 else None

    out_rows, target_rows = rows(output), rows(target)
    if out_rows is None or target_rows is None or out_rows == target_rows:
        return None
    m = microbatches
    return config_error(
        f"{owner}.loss_fn failed ({type(err).__name__}: {' '.join(str(err).split())[:300]}) on a micro-batch whose "
        f"output from the first stage has {out_rows} rows while this rank's target has {target_rows}. Rule: every "
        "rank of a pipeline reads the same batches, of the same size and order (its first stage's inputs and its "
        "last stage's targets come from the same batch).",
        f"a first-stage micro-batch of {out_rows} rows, this rank's batch of {target_rows * m} rows "
        f"(microbatches={m}, batch_idx {batch_idx})", "batch_size",
        "build every rank's DataLoader alike, and let Lightning's distributed sampler shard the data "
        "(use_distributed_sampler=True)")


# [Note: structured targets]
# torch's schedules cut a target with tensor_split along dim 0, so they take one tensor. A dict (or tuple) target —
# labels and a mask, say — works as it does on one device: the engine hands torch the row indices
# ``arange(rows)`` as the target, torch cuts them into micro-batches exactly as it cuts the inputs, and the loss of
# each micro-batch gets the structured target's rows at those indices (``select_rows``), in the structure
# split_batch returned. Evaluation already passes the whole target to loss_fn on the merged outputs.
def is_structured(target: Any) -> bool:
    return isinstance(target, (dict, tuple, list))


def leaves(value: Any) -> list[Any]:
    """The values of nested dicts / tuples / lists, in order (a value that is none of them: itself)."""
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in leaves(v)]
    if isinstance(value, (tuple, list)):
        return [leaf for v in value for leaf in leaves(v)]
    return [value]


def select_rows(target: Any, rows: Tensor) -> Any:
    """The micro-batch of a structured target: every tensor's rows at ``rows`` (indices on any device), in the
    same structure."""
    if isinstance(target, dict):
        return type(target)((k, select_rows(v, rows)) for k, v in target.items())
    if isinstance(target, (tuple, list)):
        items = [select_rows(v, rows) for v in target]
        return type(target)(*items) if hasattr(target, "_fields") else type(target)(items)  # namedtuples too
    return target.index_select(0, rows.to(target.device)) if isinstance(target, Tensor) else target


def _describe_tree(value: Any) -> str:
    if isinstance(value, dict):
        return f"a dict with keys {list(value)[:8]} (values {[_describe_leaf(v) for v in list(value.values())[:8]]})"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {[_describe_leaf(v) for v in value[:8]]}"
    return f"a {type(value).__name__}"


def _describe_leaf(value: Any) -> str:
    return f"tensor{tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__


def pad_rows(args: tuple[Tensor, ...], rows: int) -> tuple[Tensor, ...]:
    """Pad along dim 0 to ``rows`` by repeating the last row (the padded rows' outputs are trimmed away)."""
    return tuple(a if a.shape[0] == rows else torch.cat([a, a[-1:].expand(rows - a.shape[0], *a.shape[1:])])
                 for a in args)


def trim_rows(x: Any, rows: int) -> Any:
    if isinstance(x, (tuple, list)):
        return type(x)(trim_rows(t, rows) for t in x)
    return x[:rows] if isinstance(x, Tensor) else x


# ------------------------------------------------------------------------------------------------ the loss contract
@dataclass(frozen=True)
class LossParts:
    """``loss_fn``'s result, read: a mean (``count is None``) or a sum over ``count`` items."""

    value: Tensor
    count: Tensor | None = None

    def detached(self) -> LossParts:
        return LossParts(self.value.detach(), self.count)

    def reduced(self) -> Tensor:
        """The loss: the mean as given, or ``sum / max(count, 1)`` (no counted item: loss and gradient 0)."""
        if self.count is None:
            return self.value
        return self.value / self.count.to(self.value.dtype).clamp_min(1)


_LOSS_RULE = ("Rule: loss_fn returns a scalar tensor (the mean over the batch's samples) or a pair (sum, count) — "
              "a scalar tensor summed over `count` items and their number (an int or a scalar tensor), e.g. "
              "`(losses.sum(), (labels != -100).sum())` for a token-weighted loss.")


def loss_parts(result: Any, owner: str) -> LossParts:
    """Read a ``loss_fn`` result ([Note: token-weighted loss]); anything else is refused naming ``owner``."""
    if type(result) is Tensor and result.dim() == 0 and result.is_floating_point():  # the usual mean, per micro-batch
        return LossParts(result)
    if isinstance(result, (Tensor, int, float)):
        return LossParts(_scalar(result, owner, "its loss"))
    if isinstance(result, (tuple, list)) and len(result) == 2:
        total = _scalar(result[0], owner, "the sum of its (sum, count) pair")
        count = result[1]
        if isinstance(count, Tensor) and count.numel() == 1 and not count.is_complex():
            return LossParts(total, count.detach().reshape(()).to(total.device, torch.float64))
        if isinstance(count, (int, float)) and not isinstance(count, bool):
            return LossParts(total, torch.tensor(float(count), dtype=torch.float64, device=total.device))
        raise TypeError(f"{owner}.loss_fn returned a (sum, count) pair whose count is {_describe(count)}. {_LOSS_RULE}")
    raise TypeError(f"{owner}.loss_fn returned {_describe(result)}. {_LOSS_RULE}")


def _scalar(value: Any, owner: str, what: str) -> Tensor:
    if isinstance(value, Tensor) and value.numel() == 1 and value.is_floating_point():
        # (a 0-dim loss as it is: a reshape would add a view, and its backward, per micro-batch)
        return value if value.dim() == 0 else value.reshape(())
    hint = ""
    if isinstance(value, Tensor) and value.numel() > 1:
        hint = " Reduce per-sample losses: `losses.mean()`, or return `(losses.sum(), losses.numel())`."
    elif isinstance(value, (int, float)):
        hint = " A Python number carries no gradient: compute the loss from `output` with torch operations."
    raise TypeError(f"{owner}.loss_fn returned {what} as {_describe(value)}. {_LOSS_RULE}{hint}")


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, (int, float)):
        return f"a Python {type(value).__name__} ({value!r})"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} ({', '.join(type(v).__name__ for v in value[:4])})"
    return f"a {type(value).__name__}"


def target_elements(target: Any) -> int:
    """``N`` of [Note: token-weighted loss]: the batch's target element count (any positive constant would do)."""
    return max(1, sum(t.numel() for t in leaves(target) if isinstance(t, Tensor)))
