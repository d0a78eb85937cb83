"""Private torch names the plain-torch core uses, resolved at import: the pipelining runtime's pieces (action
lists, forward-only runs, P2P batching, the step's arguments), the checkpoint loader, DTensor's strided shard,
the default store. The one module the rest of the package imports for torch's private names.

Its siblings hold the larger concerns: :mod:`.torch_release` (the installed release, its known gaps, how a name is
resolved), :mod:`.shape_inference` (torch's stage shape inference, per release), :mod:`.trace_api` (what the
execution trace wraps) and :mod:`.stage_shapes` (receive descriptors rewritten to new shapes). Their names that
the package uses are re-exported here.

Policy (see the package docstring): a torch that lacks one fails ``import lightning_pipe`` with an ``ImportError``
naming the attribute and the versions checked, instead of a run failing obscurely (or computing something else).
``tests/unit/test_compat.py`` checks every entry by name.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch
from torch.distributed.pipelining import schedules as _torch_schedules

from lightning_pipe._compat.dcp import DCP_METADATA_PRIVATE  # noqa: F401  (re-exported)
from lightning_pipe._compat.shape_inference import (  # noqa: F401  (re-exported)
    FORWARD_CONTEXT,
    METADATA_INFERENCE,
    PRIVATE_TORCH_STATE,
    BatchNormBase,
    GuardedPipelineStage,
    InferenceGuard,
    reset_schedule_shapes,
)
from lightning_pipe._compat.torch_release import (  # noqa: F401  (re-exported)
    CHECKED_TORCH,
    PRIVATE_TORCH_API,
    TORCH_GAPS,
    TORCH_VERSION,
    TorchGap,
    _module,
    _release,
    _resolve,
    torch_gap,
    versions_checked,
)
from lightning_pipe._compat.trace_api import (  # noqa: F401  (re-exported)
    TRACE_OWNERS,
    TRACE_TORCH_API,
    missing_trace_api,
    swapped_compute_loss,
    swapped_p2p,
)

# ------------------------------------------------------------------------------------------- checkpoint loading
_dcp_planner = _module("torch.distributed.checkpoint.default_planner")
_dcp_loader = _module("torch.distributed.checkpoint.state_dict_loader")
_EmptyStateDictLoadPlanner = _resolve(_dcp_planner, "_EmptyStateDictLoadPlanner", _dcp_planner.__name__)
_load_state_dict = _resolve(_dcp_loader, "_load_state_dict", _dcp_loader.__name__)


def dcp_load_everything(storage_reader: Any) -> dict[str, Any]:
    """Every entry of a torch.distributed.checkpoint directory, in one process, without knowing the keys first
    (consolidation). Torch's public ``load`` needs a state dict of the right keys; this is what ``dcp_to_torch_save``
    does internally, with the same two private names."""
    flat: dict[str, Any] = {}
    _load_state_dict(flat, storage_reader=storage_reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return flat


# ------------------------------------------------------------------------------------------- pipelining runtime
# Private pieces used for custom action-list schedules and schedule plans as data.
_WHERE = "torch.distributed.pipelining.schedules"
PipelineScheduleRuntime = _resolve(_torch_schedules, "_PipelineScheduleRuntime", _WHERE)
Action = _resolve(_torch_schedules, "_Action", _WHERE)
ComputationType = _resolve(_torch_schedules, "_ComputationType", _WHERE)
_validate_schedule = _resolve(_torch_schedules, "_validate_schedule", _WHERE)
_add_send_recv = _resolve(_torch_schedules, "_add_send_recv", _WHERE)

# The split backward the runtime runs for I / W actions (the planner's profiler times exactly these).
_torch_backward = _module("torch.distributed.pipelining._backward")
stage_backward_input = _resolve(_torch_backward, "stage_backward_input", _torch_backward.__name__)
stage_backward_weight = _resolve(_torch_backward, "stage_backward_weight", _torch_backward.__name__)

# DTensor's strided shard: rank t of n holds part t of each of k equal blocks (block 0's part t, block 1's part
# t, ...), and ``full_tensor`` / ``distribute_tensor`` / sharding propagation through ``linear`` keep that layout.
# It is what a fused projection (q|k|v in one Linear) needs under tensor parallelism: split by heads, not by rows.
_placement_types = _module("torch.distributed.tensor.placement_types")
_StridedShard = _resolve(_placement_types, "_StridedShard", _placement_types.__name__)


def strided_shard(dim: int, blocks: int) -> Any:
    """The placement that splits each of ``blocks`` equal blocks of ``dim`` over a mesh dimension."""
    refusal = torch_gap("strided_shard")
    if refusal is not None:
        raise NotImplementedError(f"{refusal} Split q, k and v as separate projections (ColwiseParallel each) "
                                  "or use torch >= 2.12.")
    return _StridedShard(dim, split_factor=blocks)


def is_strided_shard(placement: Any) -> bool:
    """Whether ``placement`` is a strided shard (:func:`strided_shard`, or FSDP's over a tensor-parallel split)."""
    return isinstance(placement, _StridedShard)


# fp16 under tensor parallelism overrides how the world-agreeing scaler unscales (lightning/precision.py).
_sharded_scaler = _module("torch.distributed.fsdp.sharded_grad_scaler")
ShardedGradScaler = _resolve(_sharded_scaler, "ShardedGradScaler", _sharded_scaler.__name__)
_resolve(ShardedGradScaler, "_unscale_grads_", "ShardedGradScaler")

PRIVATE_TORCH_API.update({
    "_StridedShard": _StridedShard,
    "ShardedGradScaler._unscale_grads_": ShardedGradScaler._unscale_grads_,
    "stage_backward_input": stage_backward_input,
    "stage_backward_weight": stage_backward_weight,
    "_PipelineScheduleRuntime": PipelineScheduleRuntime,
    "_Action": Action,
    "_ComputationType": ComputationType,
    "_validate_schedule": _validate_schedule,
    "_add_send_recv": _add_send_recv,
    "_EmptyStateDictLoadPlanner": _EmptyStateDictLoadPlanner,
    "_load_state_dict": _load_state_dict,
})
COMPUTE_TYPES = ("F", "B", "I", "W", "OVERLAP_F_B")


def parse_action(text: str) -> Any:
    """``"1F0"`` / ``"2I3"`` / ``"(0F3;3B1)OVERLAP_F_B"`` -> torch ``_Action`` (``None`` for an empty string)."""
    return Action.from_str(text)


_KINDS = {kind: ComputationType.from_str(kind) for kind in ("F", "B", "I", "W")}


def compute_action(stage: int, kind: str, microbatch: int) -> Any:
    """``compute_action(1, "F", 0)`` == ``parse_action("1F0")``, without parsing (orders of 10^5 actions)."""
    return Action(stage, _KINDS[kind], microbatch)


def is_compute(action: Any) -> bool:
    return action.computation_type.value in COMPUTE_TYPES


def torch_pipeline_order(torch_class: type, multi_stage: bool, pipeline_size: int, num_stages: int,
                         stages_of_rank: list[list[int]], microbatches: int, lowered: bool = True
                         ) -> dict[int, list[Any]]:
    """Per-rank action lists torch's schedule class computes, without a process group or model.

    Torch's schedules compute ``pipeline_order`` for *all* ranks in their constructor from a few stage attributes
    (index, count, group size/rank), so stand-in stages for rank 0 are enough. ``lowered=False`` skips the lowering
    to communication actions, quadratic in the action count (seconds at 64 ranks x 512 micro-batches).
    """
    if not lowered and multi_stage:
        torch_class = _order_only(torch_class)
    def stage(index: int) -> SimpleNamespace:
        return SimpleNamespace(stage_index=index, num_stages=num_stages, group_size=pipeline_size, group_rank=0,
                               is_first=index == 0, is_last=index == num_stages - 1, submod=None)

    local = [stage(s) for s in stages_of_rank[0]]
    schedule = (torch_class(local, n_microbatches=microbatches, loss_fn=_no_loss, scale_grads=False) if multi_stage
                else torch_class(local[0], n_microbatches=microbatches, loss_fn=_no_loss, scale_grads=False))
    order = getattr(schedule, "pipeline_order", None)
    if not isinstance(order, dict) or len(order) != pipeline_size:
        raise RuntimeError(f"torch {torch.__version__}: {torch_class.__name__}.pipeline_order is not a per-rank "
                           "dict of actions any more; lightning_pipe._compat.torch_pipeline_order needs updating.")
    return {rank: list(order[rank]) for rank in range(pipeline_size)}


@functools.cache
def _order_only(torch_class: type) -> type:
    """``torch_class`` whose constructor stops once ``pipeline_order`` is computed (no lowering)."""
    def skip(self: Any, actions: Any, format: str = "compute_only") -> None:
        return None

    return type(f"{torch_class.__name__}OrderOnly", (torch_class,), {"_prepare_schedule_with_comms": skip})


def _no_loss(output: Any, target: Any) -> Any:  # pragma: no cover - never called: no step runs
    return output


def torch_check_actions(actions: dict[int, list[Any]], pipeline_size: int, num_stages: int,
                        microbatches: int) -> None:
    """Torch's own plain-data checks of compute-only action lists (counts, order, lowering to sends/receives).

    Raises what torch raises (``AssertionError``/``ValueError``); callers turn that into a config error.
    """
    _validate_schedule(actions, pipeline_size, num_stages, microbatches)
    stage_rank: dict[int, int] = {}
    for rank, acts in actions.items():
        for action in acts:
            for part in (action.sub_actions or (action,)) if action is not None else ():
                stage_rank.setdefault(part.stage_index, rank)
    _add_send_recv({r: list(acts) for r, acts in actions.items()}, lambda s: stage_rank[s], num_stages)


def action_list_schedule(stages: list[Any], microbatches: int, loss_fn: Callable[..., Any],
                         actions: dict[int, list[Any]]) -> Any:
    """Torch's ``_PipelineScheduleRuntime`` running the given compute-only action lists (it adds the sends and
    receives itself), with ``scale_grads=False`` (see [Note: loss scaling] in engine)."""
    schedule = PipelineScheduleRuntime(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    schedule.pipeline_order = {rank: list(acts) for rank, acts in actions.items()}
    schedule._prepare_schedule_with_comms(schedule.pipeline_order)
    return schedule


# --------------------------------------------------------------------------- forward-only runs of action-list schedules
# [Note: forward-only action lists]
# ``schedule.eval()`` runs the training action list with ``has_backward=False``; each backward action is expected to
# be a no-op. That holds across ranks (the stage skips backward compute and sends/receives nothing), but not between
# two adjacent stages on one rank (V placement: rank r holds r and 2p-1-r; for r = p-1 the two are neighbours):
# there the runtime hands the input gradient over locally via ``get_local_bwd_output``, which asserts
# ``has_backward``. So for eval we run the *forward part* of the lowered action list: every F, SEND_F and RECV_F in
# its original order, the forward halves of OVERLAP_F_B, nothing else. Dropping actions only removes waits (a
# backward waits on a RECV_B), never adds one, so the forward-only list cannot deadlock where the full one did not.
# UNSHARD / RESHARD stay too (in order, so in pairs): an FSDP stage must be gathered for its forwards (local only).
# Since torch 2.15 every send is paired with an explicit wait (WAIT_SEND_F after SEND_F) and the runtime refuses a
# step that leaves a send unwaited ("Pipeline sends have no matching wait"): the forward sends keep their waits.
_FORWARD_TYPES = ("F", "SEND_F", "WAIT_SEND_F", "RECV_F", "UNSHARD", "RESHARD")


def _forward_part(actions: list[Any]) -> list[Any]:
    out: list[Any] = []
    for action in actions:
        if action is None:
            continue
        if action.computation_type.value == "OVERLAP_F_B":
            out.extend(a for a in action.sub_actions or () if a.computation_type.value in _FORWARD_TYPES)
        elif action.computation_type.value in _FORWARD_TYPES:
            out.append(action)
    return out


@contextlib.contextmanager
def forward_only_actions(schedule: Any) -> Iterator[None]:
    """Inside this context an action-list schedule (``_PipelineScheduleRuntime``) runs forward actions only.

    A no-op for other schedules. See [Note: forward-only action lists].
    """
    if not isinstance(schedule, PipelineScheduleRuntime):
        yield
        return
    if not hasattr(schedule, "pipeline_order_with_comms"):
        raise RuntimeError(
            f"torch {torch.__version__}: {type(schedule).__name__} has no attribute 'pipeline_order_with_comms'; "
            "lightning_pipe._compat.forward_only_actions needs updating for this torch version."
        )
    full = schedule.pipeline_order_with_comms
    schedule.pipeline_order_with_comms = {rank: _forward_part(actions) for rank, actions in full.items()}
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = full


# --------------------------------------------------------------------------- split backward (runtime/stage.py)
# [Note: split backward detaches stage outputs] in runtime/stage.py: a stage output handed to torch as an alias that
# autograd does not count as a view, so torch's in-place detach of it leaves the original (and what saved it) alone.
_unsafe_view = _resolve(torch.ops.aten, "_unsafe_view", "torch.ops.aten")
PRIVATE_TORCH_API["aten._unsafe_view"] = _unsafe_view


def detachable_alias(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s data (no copy) and autograd history under a new tensor that autograd does not count as a view:
    an in-place ``detach_`` of the alias leaves ``tensor`` as it was. aten's ``_unsafe_view`` is the op ``reshape``
    lowers to where a view must not be made."""
    return _unsafe_view(tensor, tensor.shape)


def split_backward_actions(order: dict[int, list[Any]]) -> list[str]:
    """The split input / weight backward actions (I / W, alone or inside an overlapped pair) of per-rank action
    lists, as sorted strings (empty: a full backward only)."""
    return sorted({str(part) for actions in order.values() for action in actions if action is not None
                   for part in (action.sub_actions or (action,)) if part.computation_type.value in ("I", "W")})


def runs_split_backward(schedule: Any) -> bool:
    """Whether ``schedule``'s action lists (torch's ``pipeline_order``, every rank's) hold split backward actions.
    Torch's single-stage schedules have none."""
    order = getattr(schedule, "pipeline_order", None)
    return isinstance(order, dict) and bool(split_backward_actions(order))


# --------------------------------------------------------------------------- failure propagation (watchdog.py)
# The default process group's store (the rendezvous TCPStore every rank already shares) carries the first failure
# of a run to the other ranks; torch has no public accessor for it.
_c10d = _module("torch.distributed.distributed_c10d")
default_store = _resolve(_c10d, "_get_default_store", _c10d.__name__)
"""``default_store()``: the store of the default process group (needs an initialised process group)."""
PRIVATE_TORCH_API["_get_default_store"] = default_store


# --------------------------------------------------------------------------- gradient norms in hooks (lightning/grad_norms.py)
# torch.nn.utils.clip_grad_norm_ takes its total norm from the module global ``_get_total_norm`` at each call (the
# public ``torch.nn.utils.get_total_norm`` is the same function): replacing that global for the length of a hook
# makes every clip by norm inside it global over the pipeline, however the user imported clip_grad_norm_.
_clip_grad = _module("torch.nn.utils.clip_grad")
_resolve(_clip_grad, "_get_total_norm", _clip_grad.__name__)
PRIVATE_TORCH_API["torch.nn.utils.clip_grad._get_total_norm"] = _clip_grad._get_total_norm


@contextlib.contextmanager
def total_norm_replaced(fn: Callable[..., torch.Tensor]) -> Iterator[None]:
    """Within: ``clip_grad_norm_`` and ``get_total_norm`` compute their total norm with ``fn`` (same signature)."""
    original = _clip_grad._get_total_norm
    utils = torch.nn.utils
    _clip_grad._get_total_norm = fn
    utils.get_total_norm = fn
    try:
        yield
    finally:
        _clip_grad._get_total_norm = original
        utils.get_total_norm = original


# --------------------------------------------------------------------------- in-place change detection (dp_overlap.py)
def tensor_version(tensor: torch.Tensor) -> int:
    """Autograd's counter of in-place changes to ``tensor`` (``Tensor._version``): tells whether Lightning's
    ``zero_grad`` touched a gradient the overlapped sync averaged early ([Note: overlapped data-parallel sync])."""
    return int(tensor._version)


# --------------------------------------------------------------------------- a runtime of our own over torch's pieces
# Chimera (lightning_pipe/schedules/chimera/) drives two single-stage pipelines from one thread. It uses torch's own
# P2P batching and a torch schedule per pipeline for the P2P warm-up and shape inference; these are private names.
# The P2P helpers are looked up in torch's module at every call, so the trace recorder's wrappers see them.
_resolve(_torch_schedules, "_batch_p2p", _WHERE)
_resolve(_torch_schedules, "_wait_batch_p2p", _WHERE)
_resolve(_torch_schedules.PipelineScheduleSingle, "_initialize_stage", f"{_WHERE}.PipelineScheduleSingle")


def batch_p2p(ops: list[Any], desc: str) -> list[Any]:
    """Torch's ``_batch_p2p``: post the P2P ops (send / receive work handles)."""
    return _torch_schedules._batch_p2p(ops, desc=desc)


def wait_batch_p2p(works: list[Any]) -> None:
    """Torch's ``_wait_batch_p2p``."""
    _torch_schedules._wait_batch_p2p(works)


# torch 2.11's takes (args, kwargs): its shape inference is forward-only and needs no target.
_INITIALIZE_TAKES_TARGET = "target" in inspect.signature(_torch_schedules.PipelineScheduleSingle._initialize_stage).parameters


def initialize_stage(schedule: Any, args: tuple[Any, ...], target: Any) -> None:
    """A single-stage torch schedule's first-step set-up of its stage (P2P warm-up, forward and backward shape
    inference), without running a step; a no-op once done (until ``reset_schedule_shapes`` or a train/eval switch)."""
    if _INITIALIZE_TAKES_TARGET:
        schedule._initialize_stage(args, {}, target)
    else:
        schedule._initialize_stage(args, {})


_TAKES_RETURN_OUTPUTS: dict[Any, bool] = {}  # per schedule class (read once: the step runs every batch)


def _step_takes_return_outputs(schedule_class: Any) -> bool:
    takes = _TAKES_RETURN_OUTPUTS.get(schedule_class)
    if takes is None:
        try:
            takes = "return_outputs" in inspect.signature(schedule_class.step).parameters
        except (TypeError, ValueError, AttributeError):  # a step inspect cannot read: called without it
            takes = False
        _TAKES_RETURN_OUTPUTS[schedule_class] = takes
    return takes


def train_step_kwargs(schedule: Any) -> dict[str, Any]:
    """Keyword arguments for a training ``schedule.step`` whose last-stage outputs nobody reads:
    ``return_outputs=False`` where the schedule's ``step`` takes it (a public argument of torch's schedules; a
    schedule of another runtime may not take it: then nothing).

    [Note: no outputs kept by a training step]
    By default torch's schedules keep every micro-batch's last-stage output (``save_forward_output``) until the next
    step and concatenate them into the step's return value. A training step reads only the loss, so on the last stage
    that kept the logits of all m micro-batches alive through the optimizer step, plus one more copy for the
    concatenation: for a language model, m times a micro-batch's tokens x vocabulary. Forward-only passes
    (evaluation, prediction) still return the outputs they are for."""
    return {"return_outputs": False} if _step_takes_return_outputs(type(schedule)) else {}


PRIVATE_TORCH_API.update({"_batch_p2p": _torch_schedules._batch_p2p,
                          "_wait_batch_p2p": _torch_schedules._wait_batch_p2p,
                          "PipelineScheduleSingle._initialize_stage":
                              _torch_schedules.PipelineScheduleSingle._initialize_stage})


# ------------------------------------------------------------------------------------------- torch.compile
def compile_modes() -> list[str] | None:
    """The ``mode`` names ``torch.compile`` accepts with inductor (``torch._inductor.list_mode_options``, every
    checked release), or ``None`` where they cannot be read; imported only when layers are compiled (inductor's
    import takes a second)."""
    try:
        from torch._inductor import list_mode_options
        return list(list_mode_options())
    except Exception:  # a release without it: torch.compile checks the mode itself
        return None
