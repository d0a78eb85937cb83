"""Private torch names the plain-torch core uses (pipelining runtime, checkpoint loader), resolved at import.

Policy (see the package docstring): a torch that lacks one fails ``import lightning_pipe`` with an ``ImportError``
naming the attribute and the versions checked, instead of a run failing obscurely (or computing something else).
``tests/unit/test_compat.py`` checks every entry by name.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch.distributed.pipelining import schedules as _torch_schedules
from torch.distributed.pipelining import stage as _torch_stage


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


TORCH_VERSION = _release(torch.__version__)
"""The installed torch's (major, minor)."""
CHECKED_TORCH = ("2.11", "2.12", "2.13", "2.14", "2.15")
"""Releases this module was checked against (docs/versions.md says what ran on each)."""


def _resolve(owner: Any, name: str, where: str) -> Any:
    obj = getattr(owner, name, None)
    if obj is None:
        raise ImportError(
            f"torch {torch.__version__} has no {where}.{name}; lightning_pipe was checked on torch "
            f"{', '.join(CHECKED_TORCH)} and needs it. Install one of those or update lightning_pipe/_compat/torch.py."
        )
    return obj


def _module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise ImportError(f"torch {torch.__version__} has no module {name}; lightning_pipe was checked on torch "
                          f"{', '.join(CHECKED_TORCH)}. Update lightning_pipe/_compat/torch.py.") from err


def versions_checked() -> bool:
    """Whether the installed torch is a release this module was verified against."""
    return f"{TORCH_VERSION[0]}.{TORCH_VERSION[1]}" in CHECKED_TORCH


# ------------------------------------------------------------------------------------------- the restricted tier
# [Note: torch versions]
# ``import lightning_pipe`` works on every checked release. A feature that a release lacks *or computes wrongly* is
# refused where it is used (the strategy's constructor, before any process starts), naming the feature, the
# installed torch and the release that has it right; never an ImportError for the package, never a silent change
# of results. The gaps below were measured on each release's CPU build (docs/versions.md).
@dataclass(frozen=True)
class TorchGap:
    """A feature that torch releases before ``fixed_in`` lack or get wrong."""

    feature: str
    fixed_in: tuple[int, int]
    why: str

    def applies(self) -> bool:
        return TORCH_VERSION < self.fixed_in

    def message(self) -> str:
        return (f"{self.feature} needs torch >= {self.fixed_in[0]}.{self.fixed_in[1]}: {self.why}. "
                f"Installed: torch {torch.__version__}.")


TORCH_GAPS = {
    "split_backward": TorchGap(
        "A split input/weight backward (schedules zb_h1, zbv, dualpipev, v_half, v_min, custom lists with I/W actions)",
        (2, 13),
        "torch's stage_backward_weight computes wrong weight gradients when a weight is used more than once inside "
        "one stage (measured 17 % and 62 % off against autograd; torch 2.13 fixed it by clamping saved gradients)"),
    "strided_shard": TorchGap(
        "Tensor parallelism of a fused projection (FusedColwiseParallel, e.g. the GPT recipe's q|k|v)", (2, 12),
        "DTensor's _StridedShard redistribution raises a ValueError for it"),
}


def torch_gap(key: str) -> str | None:
    """The refusal message for feature ``key`` of :data:`TORCH_GAPS` on this torch, or ``None`` if it is fine."""
    gap = TORCH_GAPS[key]
    return gap.message() if gap.applies() else None


PRIVATE_TORCH_STATE: tuple[str, ...] = ()
"""Private *instance state* of torch's objects that this torch needs us to read or reset (per release)."""


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
# Names of the private flags by which torch's schedules remember that P2P buffer shapes were inferred.
_SINGLE_FLAGS = ("_stage_forward_initialized", "_stage_backward_initialized")
_MULTI_FLAGS = ("_stages_forward_initialized", "_stages_backward_initialized")

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

# Everything above that tests/unit/test_compat.py checks by name.
PRIVATE_TORCH_API = {
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
}
COMPUTE_TYPES = ("F", "B", "I", "W", "OVERLAP_F_B")


def parse_action(text: str) -> Any:
    """``"1F0"`` / ``"2I3"`` / ``"(0F3;3B1)OVERLAP_F_B"`` -> torch ``_Action`` (``None`` for an empty string)."""
    return Action.from_str(text)


def is_compute(action: Any) -> bool:
    return action.computation_type.value in COMPUTE_TYPES


def torch_pipeline_order(torch_class: type, multi_stage: bool, pipeline_size: int, num_stages: int,
                         stages_of_rank: list[list[int]], microbatches: int) -> dict[int, list[Any]]:
    """Per-rank action lists torch's schedule class computes, without a process group or model.

    Torch's schedules compute ``pipeline_order`` for *all* ranks in their constructor from a few stage attributes
    (index, count, group size/rank), so stand-in stages for rank 0 are enough.
    """
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


def _flags(schedule: Any) -> tuple[str, str]:
    if isinstance(schedule, _torch_schedules.PipelineScheduleSingle):
        return _SINGLE_FLAGS
    if isinstance(schedule, _torch_schedules.PipelineScheduleMulti):
        return _MULTI_FLAGS
    raise TypeError(f"Unknown schedule type {type(schedule).__name__}")


def reset_schedule_shapes(schedule: Any) -> None:
    """Make torch re-infer the stages' P2P buffer shapes on the next step (the micro-batch size changed).

    Torch infers shapes once and only re-infers on a train/eval switch; a batch of another size would otherwise be
    received into buffers of the old size.
    """
    for flag in _flags(schedule):
        if not hasattr(schedule, flag):
            raise RuntimeError(
                f"torch {torch.__version__}: {type(schedule).__name__} has no attribute {flag!r}; "
                "lightning_pipe._compat.reset_schedule_shapes needs updating for this torch version."
            )
        setattr(schedule, flag, False)
    if not METADATA_INFERENCE:
        for stage in _schedule_stages(schedule):
            if isinstance(stage, _PipelineStage):
                _forget_inferred_shapes(stage)


def _schedule_stages(schedule: Any) -> list[Any]:
    return list(schedule._stages) if hasattr(schedule, "_stages") else [schedule._stage]


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


# --------------------------------------------------------------------------- execution trace (lightning_pipe.trace)
# [Note: how the trace is recorded] in trace/recorder.py: while a step is recorded, these torch names are wrapped on this rank's
# own stage and schedule objects (instance attributes) and, for the two module functions, in torch's schedules module;
# all are restored when the step ends. Checked on torch 2.13 for PipelineScheduleSingle (GPipe, 1F1B) and the
# _PipelineScheduleRuntime family, which all reach compute and P2P through exactly these names.
TRACE_TORCH_API = {
    "_PipelineStageBase.forward_one_chunk": ("stage", "forward_one_chunk"),
    "_PipelineStageBase.backward_one_chunk": ("stage", "backward_one_chunk"),
    "_PipelineStageBase.backward_weight_one_chunk": ("stage", "backward_weight_one_chunk"),
    "_PipelineStageBase.get_fwd_send_ops": ("stage", "get_fwd_send_ops"),
    "_PipelineStageBase.get_fwd_recv_ops": ("stage", "get_fwd_recv_ops"),
    "_PipelineStageBase.get_bwd_send_ops": ("stage", "get_bwd_send_ops"),
    "_PipelineStageBase.get_bwd_recv_ops": ("stage", "get_bwd_recv_ops"),
    "_PipelineSchedule._compute_loss": ("schedule", "_compute_loss"),
    "schedules._batch_p2p": ("module", "_batch_p2p"),
    "schedules._wait_batch_p2p": ("module", "_wait_batch_p2p"),
}


TRACE_OWNERS = {"stage": _resolve(_torch_stage, "_PipelineStageBase", "torch.distributed.pipelining.stage"),
                "schedule": _resolve(_torch_schedules, "_PipelineSchedule", _WHERE), "module": _torch_schedules}


def missing_trace_api() -> list[str]:
    """The names of ``TRACE_TORCH_API`` this torch lacks (empty when recording can work)."""
    return [key for key, (owner, attr) in TRACE_TORCH_API.items()
            if not callable(getattr(TRACE_OWNERS[owner], attr, None))]


if missing_trace_api():
    raise ImportError(
        f"torch {torch.__version__} lacks {missing_trace_api()}, which lightning_pipe.trace wraps to record what a "
        f"pipeline step ran (checked on torch {CHECKED_TORCH}). Update TRACE_TORCH_API in "
        "lightning_pipe/_compat/torch.py and lightning_pipe/trace/recorder.py."
    )


# --------------------------------------------------------------------------- shape inference without side effects
# [Note: shape inference has no side effects] (engine.py). Torch's PipelineStage learns its P2P shapes by running
# the stage for real, in the module's current train/eval mode, and the schedule calls it whenever its "initialized"
# flags are down (first step, train/eval switch, reset_schedule_shapes). Two generations of that code exist:
# * torch >= 2.12 (METADATA_INFERENCE): ``_forward_metadata_inference`` (a forward on the first micro-batch's
#   inputs or on stand-ins made by ``_to_tensor``) and ``_backward_metadata_inference`` (the loss on the last stage
#   and input gradients); stand-ins are ``torch.empty``, which we zero.
# * torch 2.11: ``_shape_inference``, a forward only (under no_grad, on zero-filled stand-ins), run once per stage
#   while ``inputs_meta`` is unset; nothing re-runs it, so ``reset_schedule_shapes`` also clears what it set.
_STAGE_WHERE = "torch.distributed.pipelining.PipelineStage"
_PipelineStage = _resolve(importlib.import_module("torch.distributed.pipelining"), "PipelineStage",
                          "torch.distributed.pipelining")
METADATA_INFERENCE = hasattr(_PipelineStage, "_forward_metadata_inference")
# torch >= 2.15: the public ``register_forward_context`` runs a context around every stage forward, metadata
# inference included (``PipelineStageInfo.is_metadata_inference``): the forward guard needs no private override.
FORWARD_CONTEXT = callable(getattr(_PipelineStage, "register_forward_context", None))
_INFERENCE_NAMES = ((() if FORWARD_CONTEXT else ("_forward_metadata_inference",))
                    + ("_backward_metadata_inference", "_to_tensor") if METADATA_INFERENCE else ("_shape_inference",))
_STAGE_INFERENCE_API = {f"PipelineStage.{name}": _resolve(_PipelineStage, name, _STAGE_WHERE)
                        for name in _INFERENCE_NAMES}
_batchnorm = _module("torch.nn.modules.batchnorm")
BatchNormBase = _resolve(_batchnorm, "_BatchNorm", _batchnorm.__name__)
"""The base of every BatchNorm flavour (1d/2d/3d, lazy, SyncBatchNorm)."""
PRIVATE_TORCH_API.update({**_STAGE_INFERENCE_API, "_BatchNorm": BatchNormBase})

# torch 2.11 and 2.12 refuse to send "no gradient" for a received stage input that got none (an attention mask,
# position ids: "... has gradients None and is expecting to send gradients"); 2.13 sends zeros, which is the exact
# gradient of an input the stage's output does not depend on. Before 2.13 we send the zeros.
_ZERO_FILL_MISSING_INPUT_GRADS = TORCH_VERSION < (2, 13)
if _ZERO_FILL_MISSING_INPUT_GRADS:
    PRIVATE_TORCH_STATE += ("PipelineStage.bwd_cache", "PipelineStage.args_recv_info",
                            "PipelineStage.grad_send_info", "PipelineStage._create_grad_send_info")
    if METADATA_INFERENCE:
        PRIVATE_TORCH_STATE += ("PipelineStage._stage_meta.inputs",)
    _RecvInfo = _resolve(_torch_stage, "_RecvInfo", "torch.distributed.pipelining.stage")
    PRIVATE_TORCH_API["_RecvInfo"] = _RecvInfo
if not METADATA_INFERENCE:
    PRIVATE_TORCH_API.update({f"PipelineStage.{name}": _resolve(_PipelineStage, name, _STAGE_WHERE)
                              for name in ("_prepare_forward_infra", "_get_init_p2p_neighbors_ops")})

InferenceGuard = Callable[[torch.nn.Module, bool], contextlib.AbstractContextManager]
"""``guard(stage_module, forward)``: entered around each shape inference of a stage (``forward``: the forward one)."""


class GuardedPipelineStage(_PipelineStage):  # type: ignore[misc, valid-type]
    """torch's ``PipelineStage`` whose shape inference runs inside ``inference_guard`` and on zero-filled stand-ins.

    Torch (>= 2.12) makes a later stage's stand-in inputs with ``torch.empty``: garbage values (NaN, 1e34,
    out-of-range indices for integer inputs such as position ids) that can crash a layer. Zeros have the same shapes
    and dtypes (torch 2.11 already uses zeros).
    """

    def __init__(self, *args: Any, inference_guard: InferenceGuard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._inference_guard = inference_guard
        if FORWARD_CONTEXT:
            self.register_forward_context(self._forward_context)

    def _forward_context(self, info: Any) -> contextlib.AbstractContextManager:
        """torch >= 2.15: entered around every forward of this stage; guards the metadata-inference one."""
        if info.is_metadata_inference:
            return self._inference_guard(self.submod, True)
        return contextlib.nullcontext()

    if METADATA_INFERENCE and not FORWARD_CONTEXT:
        def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
            with self._inference_guard(self.submod, True):
                return super()._forward_metadata_inference(*args, **kwargs)

    if METADATA_INFERENCE:
        def _backward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
            with self._inference_guard(self.submod, False):
                return super()._backward_metadata_inference(*args, **kwargs)

        def _to_tensor(self, arg: Any) -> torch.Tensor:
            tensor = super()._to_tensor(arg)
            if not isinstance(arg, torch.Tensor) and type(tensor) in (torch.Tensor, torch.nn.Parameter):
                with torch.no_grad():
                    tensor.zero_()
            return tensor
    else:
        def _shape_inference(self, *args: Any, **kwargs: Any) -> Any:
            with self._inference_guard(self.submod, True):
                return super()._shape_inference(*args, **kwargs)

        def _prepare_forward_infra(self, num_microbatches: int, *args: Any, **kwargs: Any) -> Any:
            # torch 2.11 marks every receive buffer requires_grad, integer ones (position ids, masks) included,
            # which torch refuses; later releases mark floating-point buffers only. So do we.
            has_backward, self.has_backward = self.has_backward, False  # type: ignore[has-type]
            try:
                out = super()._prepare_forward_infra(num_microbatches, *args, **kwargs)
            finally:
                self.has_backward = has_backward
            if has_backward:
                for infos in self.args_recv_info.values():
                    for info in infos:
                        if isinstance(info, _RecvInfo) and info.buffer.is_floating_point():
                            info.buffer.requires_grad_(True)
            return out

        def _get_init_p2p_neighbors_ops(self) -> list[Any]:
            # torch 2.11 warms up P2P with each neighbouring stage, one held by this rank too (V placement, pipeline
            # size 1), and gloo cannot send to itself; a stage on the same rank needs no warm-up (both sides drop it).
            return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank]

    if _ZERO_FILL_MISSING_INPUT_GRADS:
        def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[Any]:
            if self.has_backward and not self.is_first and bwd_chunk_id in self.bwd_cache:
                if self.grad_send_info is None:  # type: ignore[has-type]  # torch creates it lazily, on the first send
                    self.grad_send_info = self._create_grad_send_info(self.args_recv_info[0])
                infos, sends = self.args_recv_info[bwd_chunk_id], list(self.grad_send_info or ())
                grads = list(self.bwd_cache[bwd_chunk_id])
                for i, (grad, dst, info) in enumerate(zip(grads, sends, infos, strict=True)):
                    if grad is None and dst is not None and isinstance(info, _RecvInfo):
                        if _receiver_has_buffer(self, i):
                            grads[i] = torch.zeros_like(info.buffer)
                        else:  # 2.12: the sender of an input that needs no gradient posts no receive for one
                            sends[i] = None
                self.bwd_cache[bwd_chunk_id], self.grad_send_info = tuple(grads), sends
            return super().get_bwd_send_ops(bwd_chunk_id)


def _receiver_has_buffer(stage: Any, index: int) -> bool:
    """Whether the stage that sent input ``index`` posts a receive for its gradient: torch 2.11 always does; 2.12
    only for an output that requires grad (as recorded in the metadata this stage received)."""
    if not METADATA_INFERENCE:
        return True
    metas = stage._stage_meta.inputs
    return metas is None or index >= len(metas) or metas[index] is None or bool(metas[index].requires_grad)


def _forget_inferred_shapes(stage: Any) -> None:
    """torch 2.11: clear what ``_shape_inference`` / ``_prepare_*_infra`` set, so the next step infers again."""
    stage.inputs_meta = None
    stage._outputs_meta = None
    stage.args_recv_info.clear()
    stage.act_send_info.clear()
    stage.grad_recv_info.clear()
    stage.grad_send_info = None


if not METADATA_INFERENCE:
    PRIVATE_TORCH_STATE += tuple(f"PipelineStage.{n}" for n in (
        "inputs_meta", "_outputs_meta", "args_recv_info", "act_send_info", "grad_recv_info", "grad_send_info"))
    PRIVATE_TORCH_STATE += ("PipelineScheduleSingle._stage", "PipelineScheduleMulti._stages")  # _schedule_stages


# --------------------------------------------------------------------------- failure propagation (watchdog.py)
# The default process group's store (the rendezvous TCPStore every rank already shares) carries the first failure
# of a run to the other ranks; torch has no public accessor for it.
_c10d = _module("torch.distributed.distributed_c10d")
default_store = _resolve(_c10d, "_get_default_store", _c10d.__name__)
"""``default_store()``: the store of the default process group (needs an initialised process group)."""
PRIVATE_TORCH_API["_get_default_store"] = default_store


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
        except (TypeError, ValueError, AttributeError):  # a step inspect cannot read: called as before
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


# ------------------------------------------------------------------ the trace recorder's swaps (TRACE_TORCH_API)
# [Note: how the trace is recorded] (lightning_pipe/trace/recorder.py). The recorder replaces, for one recorded step,
# torch's module-level P2P functions and a schedule's loss method; both are private, so the swaps live here and the
# recorder names neither. Each swap is undone when its context exits, even on an error.
_P2P_BATCH, _P2P_WAIT = TRACE_TORCH_API["schedules._batch_p2p"][1], TRACE_TORCH_API["schedules._wait_batch_p2p"][1]
_LOSS = TRACE_TORCH_API["_PipelineSchedule._compute_loss"][1]


@contextlib.contextmanager
def swapped_p2p(wrap_batch: Callable[[Callable[..., Any]], Callable[..., Any]],
                wrap_wait: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """Within the context torch's ``_batch_p2p`` and ``_wait_batch_p2p`` are ``wrap_batch(original)`` and
    ``wrap_wait(original)``; the originals are put back on exit. Torch >= 2.14's ``_batch_p2p`` calls itself through
    the module's name (once per process group), so the wrapper also sees those nested calls."""
    module = TRACE_OWNERS["module"]
    original_batch, original_wait = getattr(module, _P2P_BATCH), getattr(module, _P2P_WAIT)
    setattr(module, _P2P_BATCH, wrap_batch(original_batch))
    setattr(module, _P2P_WAIT, wrap_wait(original_wait))
    try:
        yield
    finally:
        setattr(module, _P2P_BATCH, original_batch)
        setattr(module, _P2P_WAIT, original_wait)


@contextlib.contextmanager
def swapped_compute_loss(schedule: Any, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """Within the context ``schedule``'s ``_compute_loss`` is ``wrap(original)``, set on the instance only; on exit
    the instance is as before (the attribute removed again when the instance had none of its own)."""
    had = _LOSS in vars(schedule)
    old = vars(schedule).get(_LOSS)
    setattr(schedule, _LOSS, wrap(getattr(schedule, _LOSS)))
    try:
        yield
    finally:
        if had:
            setattr(schedule, _LOSS, old)
        else:
            delattr(schedule, _LOSS)
