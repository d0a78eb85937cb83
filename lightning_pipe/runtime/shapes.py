"""Every stage's tensor shapes per micro-batch, planned before the step from the batch's own shapes.

[Note: shapes without re-inference]
Torch sizes each stage's receive buffers by running the stage for real on the first step (about one micro-batch's
forward and backward per stage, one stage after the other: ~100 ms on the recipe's GPT step) and keeps them static.
Re-inferring for every batch of another length would pay that again; with dynamic padding — every batch a new
length — on every step, and micro-batches of one batch could not differ at all.

What a new shape really needs is only the shapes: the structure torch inferred (which tensors cross each boundary,
their dtypes and ``requires_grad``, who sends to whom, which gradients are absent) does not change with a length.
So torch infers once per *structure* (:meth:`~lightning_pipe.layers.batches.Signature.structure`: the mode and each
tensor's rank, dtype and requires_grad) and the engine plans the shapes of every micro-batch itself:

* every rank of a pipeline reads the same batch, so every rank knows each micro-batch's first-stage input shapes;
* each rank runs its own stages on **meta tensors** (``torch.func.functional_call`` with the parameters as meta
  tensors: no compute, no memory, no side effect on the module) for each distinct input shape, and passes the output
  shapes to the next stage's rank in one small int64 message per boundary (a chain in stage order: a rank receives
  only from a lower stage, so it cannot deadlock; V and interleaved placements included);
* right after torch's stage initialisation in the step (``_compat.stage_shapes.after_initialize``) the receive
  descriptors of each micro-batch get their planned shapes (gradients have their activations' shapes).

Plans are cached by the batch's micro-batch shapes (LRU, identical on the ranks of a pipeline since they read the
same batches, so a hit needs no message at all), and each stage's meta forward by its input shapes; after an
epoch that has seen every length a step sends nothing and runs nothing extra. Alternatives we did not take: an LRU
of torch-inferred states per signature keeps a set of receive buffers per entry and still pays ~100 ms per unseen
length, and cannot give micro-batches of one batch different lengths; sending each activation's shape ahead of it
(Megatron's ``variable_seq_lengths``) needs a blocking receive inside torch's batched P2P, where both neighbours
posting receives first would deadlock. A stage whose forward cannot run on meta tensors (data-dependent shapes, a
value read with ``.item()``, a plain tensor attribute that is not a buffer) makes the plan fail on every rank
alike (one all-reduce on a miss); the engine then falls back to torch's inference per shape, and
micro-batches of different lengths are refused there. Torch 2.11 keeps shapes elsewhere: fallback as well.
A layer whose usual forward has no meta kernel but an equivalent one that does can say so: any submodule with a
``meta_forward_context()`` method has it entered around the meta forwards of its stage (``HFCausalLM``'s MoE decoder
layers run transformers' ``batched_mm`` experts there: torch's ``grouped_mm`` refuses fp32 on meta).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

Shape = tuple[int, ...]
TensorsAt = tuple[tuple[Shape, torch.dtype], ...]
"""One micro-batch's tensors at one stage boundary: (shape, dtype) each, in order."""

_ROW = 64  # int64 slots per micro-batch in a boundary message: status, count, then (dtype, ndim, *dims) per tensor
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2)
_TAG = 24_001  # gloo matches P2P by tag too: these messages never pair with a schedule's activation


class PlanFailed(Exception):
    """A stage's forward did not run on meta tensors (the plan is refused on every rank of the pipeline)."""


@dataclass(frozen=True)
class StageShapes:
    """One local stage's planned shapes: per micro-batch, its input tensors and its output tensors."""

    inputs: tuple[TensorsAt, ...]
    outputs: tuple[TensorsAt, ...]


class ShapePlanner:
    """Plans the shapes of this rank's stages for a batch ([Note: shapes without re-inference])."""

    def __init__(self, stages: list[Any], stage_to_rank: Callable[[int], int], group: Any, device: torch.device,
                 guard: Callable[[], contextlib.AbstractContextManager], cache_size: int = 512) -> None:
        self.stages = sorted(stages, key=lambda st: st.stage_index)
        self.stage_to_rank, self.group, self.device, self.guard = stage_to_rank, group, device, guard
        self.rank = dist.get_rank(group) if group is not None else 0
        self._plans: OrderedDict[Any, dict[int, StageShapes]] = OrderedDict()
        self._cache_size = cache_size
        self._forwards: dict[Any, TensorsAt] = {}
        self._meta_state: dict[int, dict[int, tuple[weakref.ref, Tensor]]] = {}
        self.meta_forwards = 0  # stage forwards run on meta tensors (each distinct input shape once)
        self.exchanges = 0  # plans that needed the boundary messages (cache misses)
        self.error: BaseException | None = None

    def plan(self, key: Any, first_inputs: list[TensorsAt]) -> dict[int, StageShapes]:
        """Each local stage's shapes for micro-batches whose first-stage inputs are ``first_inputs``. Collective over
        the pipeline group on a cache miss (every rank calls it for the same batch); raises :class:`PlanFailed` on
        every rank alike when a stage could not be planned."""
        full_key = (key, tuple(first_inputs))
        cached = self._plans.get(full_key)
        if cached is not None:
            self._plans.move_to_end(full_key)
            return cached
        plan = self._exchange(first_inputs)
        self._plans[full_key] = plan
        if len(self._plans) > self._cache_size:
            self._plans.popitem(last=False)
        return plan

    # ------------------------------------------------------------------ the chain of boundary messages
    def _exchange(self, first_inputs: list[TensorsAt]) -> dict[int, StageShapes]:
        self.exchanges += 1
        m = len(first_inputs)
        plan: dict[int, StageShapes] = {}
        sends: list[Any] = []
        failed = False
        for stage in self.stages:
            s = stage.stage_index
            if stage.is_first:
                inputs: list[TensorsAt] | None = list(first_inputs)
            elif self.stage_to_rank(s - 1) == self.rank:  # V placement: the previous stage is on this rank
                inputs = list(plan[s - 1].outputs) if s - 1 in plan else None
            else:
                inputs = self._receive(self.stage_to_rank(s - 1), m)
            outputs: list[TensorsAt] | None = None
            if inputs is not None and not failed:
                try:
                    outputs = [self._forward(stage, x) for x in inputs]
                except Exception as err:  # any failure of the user's forward on meta: fall back
                    self.error = err
            failed = failed or outputs is None
            if not failed:
                assert inputs is not None and outputs is not None
                plan[s] = StageShapes(tuple(inputs), tuple(outputs))
            if not stage.is_last and self.stage_to_rank(s + 1) != self.rank:
                sends.append(self._send(None if failed else outputs, self.stage_to_rank(s + 1), m))
        for work in sends:
            work.wait()
        flag = torch.tensor([1 if failed else 0], dtype=torch.int64, device=self.device)
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if int(flag.item()):
            raise PlanFailed(f"a stage's forward did not run on meta tensors ({self.error!r} on this rank)"
                             if self.error is not None else "a stage on another rank could not be planned")
        return plan

    def _send(self, outputs: list[TensorsAt] | None, dst: int, m: int) -> Any:
        message = torch.zeros(m, _ROW, dtype=torch.int64)
        message[:, 0] = -1
        if outputs is not None:
            try:
                for mb, tensors in enumerate(outputs):
                    message[mb] = torch.tensor(_encode(tensors), dtype=torch.int64)
            except (ValueError, RuntimeError):  # too many dims for a row, an unknown dtype: refuse the plan
                message[:, 0] = -1
        return dist.isend(message.to(self.device), dst=dist.get_global_rank(self.group, dst), group=self.group,
                          tag=_TAG)

    def _receive(self, src: int, m: int) -> list[TensorsAt] | None:
        message = torch.empty(m, _ROW, dtype=torch.int64, device=self.device)
        dist.recv(message, src=dist.get_global_rank(self.group, src), group=self.group, tag=_TAG)
        rows = message.cpu().tolist()
        if any(row[0] != 1 for row in rows):
            return None
        return [_decode(row) for row in rows]

    # ------------------------------------------------------------------ one stage on meta tensors
    def _forward(self, stage: Any, inputs: TensorsAt) -> TensorsAt:
        module: nn.Module = stage.submod
        key = (stage.stage_index, module.training, inputs)
        known = self._forwards.get(key)
        if known is not None:
            return known
        state = self._meta_state.setdefault(id(module), {})
        args = tuple(torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in inputs)
        cpu_rng = torch.get_rng_state()
        self.meta_forwards += 1
        try:
            with self.guard(), torch.no_grad(), warnings.catch_warnings(), contextlib.ExitStack() as layers:
                warnings.simplefilter("ignore")
                for sub in module.modules():
                    enter = getattr(sub, "meta_forward_context", None)
                    if callable(enter):
                        layers.enter_context(enter())
                layers.enter_context(_swapped(module, state))
                out = module(*args)
        finally:
            torch.set_rng_state(cpu_rng)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if not all(isinstance(o, Tensor) and o.device.type == "meta" for o in outs):
            raise PlanFailed(f"stage {stage.stage_index}'s outputs on meta inputs are not meta tensors")
        result = tuple((tuple(o.shape), o.dtype) for o in outs)
        self._forwards[key] = result
        return result


def _meta_twin(t: Tensor) -> Tensor:
    """``t`` on the meta device, a parameter still a parameter (some layers check)."""
    meta = t.detach().to("meta")
    return nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta


@contextlib.contextmanager
def _swapped(module: nn.Module, twins: dict[int, tuple[weakref.ref, Tensor]]) -> Any:
    """``module``'s parameters and buffers replaced by their meta twins inside, the originals back after. ``twins``
    (by the original's id: a shared tensor has one twin) is filled as tensors are met, so it survives a stage
    whose parameters were replaced since (materialised, moved).

    Each (module, name) slot is swapped once, whatever paths reach it: ``torch.func.functional_call`` swaps per
    *name*, so a module shared by two layers (one ``nn.Linear`` used twice in a stage) was swapped twice and
    restored in the same order, leaving the meta tensor in place (with ``tie_weights``), or refused both names
    ("functional_call got multiple values for keys [...], which are tied"). ``modules()`` visits each module once.
    """
    swapped: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for sub in module.modules():
            slot_maps: tuple[dict[str, Any], ...] = (sub._parameters, sub._buffers)
            for slots in slot_maps:
                for name, t in list(slots.items()):
                    if t is not None:
                        known = twins.get(id(t))
                        if known is None or known[0]() is not t:  # new, or another tensor at a freed one's id
                            known = twins[id(t)] = (weakref.ref(t), _meta_twin(t))
                        swapped.append((slots, name, t))
                        slots[name] = known[1]
        yield
    finally:
        for slots, name, t in reversed(swapped):
            slots[name] = t


def _encode(tensors: TensorsAt) -> list[int]:
    row = [1, len(tensors)]
    for shape, dtype in tensors:
        row += [_DTYPES.index(dtype), len(shape), *shape]
    if len(row) > _ROW:
        raise ValueError("boundary too large for one message row")
    return row + [0] * (_ROW - len(row))


def _decode(row: list[int]) -> TensorsAt:
    out, i = [], 2
    for _ in range(row[1]):
        dtype, ndim = _DTYPES[row[i]], row[i + 1]
        out.append((tuple(row[i + 2:i + 2 + ndim]), dtype))
        i += 2 + ndim
    return tuple(out)


def split_rows(rows: int, m: int) -> list[int]:
    """Rows of each micro-batch as torch cuts a batch (``torch.tensor_split``: the first ``rows % m`` one larger)."""
    base, extra = divmod(rows, m)
    return [base + (1 if i < extra else 0) for i in range(m)]


def first_inputs(args: tuple[Tensor, ...], m: int) -> list[TensorsAt]:
    """The micro-batches' first-stage input shapes when torch cuts ``args`` into ``m`` along dim 0."""
    return [tuple(((r, *a.shape[1:]), a.dtype) for a in args) for r in split_rows(args[0].shape[0], m)]


def shapes_of(microbatches: list[tuple[Tensor, ...]]) -> list[TensorsAt]:
    """The shapes of explicit micro-batches (the module's ``trim_microbatch``)."""
    return [tuple((tuple(a.shape), a.dtype) for a in mb) for mb in microbatches]
