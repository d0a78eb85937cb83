"""Recording what really ran in a pipeline step, per rank (records: :mod:`lightning_pipe.trace.records`).

[Note: how the trace is recorded]
While a step is recorded, :class:`StepRecorder` wraps, *on this rank's own objects only*, the methods every torch
schedule (``PipelineScheduleSingle`` and the ``_PipelineScheduleRuntime`` family alike) calls to do work (the
stage's through its call hooks, outermost: [Note: stage call hooks] in runtime/stage.py):

- compute: ``stage.forward_one_chunk`` (F), ``stage.backward_one_chunk`` (B, or I when ``full_backward=False``),
  ``stage.backward_weight_one_chunk`` (W) and the schedule's ``_compute_loss`` (L, on the last stage);
- communication: ``stage.get_{fwd,bwd}_{send,recv}_ops`` only *tag* the P2P ops they return (which stage and
  micro-batch they carry); torch's module-level ``_batch_p2p`` (posting the ops) and ``_wait_batch_p2p`` (blocking
  until they complete) are timed and labelled from those tags ("post" and "wait" slices).

Everything is restored when the step ends, so a step that is not recorded runs torch's code untouched. Times come
from ``time.perf_counter_ns`` on CPU (CLOCK_MONOTONIC: one clock for every process of a machine) and from CUDA
events on GPU (the step start is anchored to the host clock after one ``synchronize``; events are read once, when
the record is first used). Records of different ranks are put on one axis through the wall clock
(``time.time_ns``) read next to the monotonic clock when the recorder was made: exact between processes of one
machine, as good as NTP between machines.

The torch names wrapped here are listed in :mod:`lightning_pipe._compat.trace_api` (``TRACE_TORCH_API``) and resolved
at import: if torch renames one, `import lightning_pipe` fails naming it instead of silently tracing nothing. The
private ones are swapped there too (``swapped_p2p``, ``swapped_compute_loss``): this module names none itself.

Command line, on records saved by :class:`~lightning_pipe.PipelineTimeline` (``records.json``)::

    python -m lightning_pipe.trace plot records.json timeline.png [--steps 2]
    python -m lightning_pipe.trace chrome records.json trace.json
    python -m lightning_pipe.trace summary records.json
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from lightning_pipe._compat import torch as _compat
from lightning_pipe.trace.records import Slice, StepRecord
from lightning_pipe.trace.spans import listening


# ---------------------------------------------------------------------------------------------------------- clocks
class _CpuClock:
    """Host monotonic clock; ``mark()`` returns nanoseconds directly."""

    def begin(self) -> int:
        return time.perf_counter_ns()

    def mark(self) -> Any:
        return time.perf_counter_ns()

    def resolve(self, start_host_ns: int, marks: list[Any]) -> list[int]:
        return list(marks)


class _CudaClock:
    """CUDA events on the current stream: what the device executed, not when the host enqueued it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._start: Any = None

    def begin(self) -> int:
        torch.cuda.synchronize(self.device)  # anchor the first event to the host clock (recorded steps only)
        host = time.perf_counter_ns()
        self._start = torch.cuda.Event(enable_timing=True)
        self._start.record()
        return host

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def resolve(self, start_host_ns: int, marks: list[Any]) -> list[int]:
        if marks:
            marks[-1].synchronize()
        return [start_host_ns + int(self._start.elapsed_time(e) * 1e6) for e in marks]


# ---------------------------------------------------------------------------------------------------------- recorder
class StepRecorder:
    """Records the schedule steps of one :class:`~lightning_pipe.runtime.engine.PipelineEngine` while ``armed``.

    ``attach(engine)`` adds :meth:`step` to ``engine.step_contexts``; a step runs untouched unless ``armed`` is true
    (set it per step, e.g. from a callback). Finished steps are appended to ``records`` (oldest dropped past
    ``keep``). CUDA events time a CUDA engine, the host clock anything else.
    """

    def __init__(self, engine: Any, keep: int | None = 64) -> None:
        self.engine = engine
        self.armed = False
        self.step_index = 0
        self.keep = keep
        self.records: list[StepRecord] = []
        device = torch.device(getattr(engine, "device", "cpu"))
        self._clock: _CpuClock | _CudaClock = _CudaClock(device) if device.type == "cuda" else _CpuClock()
        # Offset from the monotonic clock to the wall clock, read once: puts every rank on one axis.
        self._wall_offset = time.time_ns() - time.perf_counter_ns()
        topo = getattr(getattr(engine, "groups", None), "topology", None)
        self.rank = getattr(topo, "global_rank", 0)
        self.pp_rank = getattr(topo, "pp_rank", 0)
        self.dp_rank = getattr(topo, "dp_rank", 0)
        self.stage_ids = [st.stage_index for st in engine.stages]
        self._attached = False

    # -- engine hook
    def attach(self) -> StepRecorder:
        if not self._attached:
            self.engine.step_contexts.append(self.step)
            self._attached = True
        return self

    def detach(self) -> None:
        if self._attached:
            with contextlib.suppress(ValueError):
                self.engine.step_contexts.remove(self.step)
            self._attached = False

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """The context ``engine.step_contexts`` enters around ``schedule.step``: records if armed."""
        if not self.armed:
            yield
            return
        run = _Run(self._clock)
        start_host = self._clock.begin()
        with run.patched(self.engine.stages, self.engine.schedule):
            try:
                yield
            finally:
                end_mark = self._clock.mark()
        record = run.finish(start_host, end_mark, self._wall_offset)
        record.rank, record.pp_rank, record.dp_rank = self.rank, self.pp_rank, self.dp_rank
        record.stages, record.step = list(self.stage_ids), self.step_index
        self.records.append(record)
        if self.keep is not None and len(self.records) > self.keep:
            del self.records[: len(self.records) - self.keep]


class _Run:
    """The wrappers and raw marks of one recorded step."""

    def __init__(self, clock: _CpuClock | _CudaClock) -> None:
        self.clock = clock
        self.raw: list[tuple[str, int | None, int | None, str, Any, Any]] = []
        self._op_tags: dict[int, tuple[Any, str]] = {}  # id(P2POp) -> (op kept alive, "send F1")
        self._work_labels: dict[int, tuple[Any, str]] = {}  # id(list of Work) -> (list kept alive, label)
        self._last_forward: dict[int, int] = {}  # stage -> micro-batch of its latest forward (for the loss)
        self._inside: tuple[int | None, int | None] = (None, None)  # (stage, micro-batch) of the running action

    def _timed(self, kind: str, stage: int | None, mb: int | None, label: str, fn: Callable[[], Any]) -> Any:
        start = self.clock.mark()
        outer, self._inside = self._inside, (stage, mb)
        try:
            return fn()
        finally:
            self._inside = outer
            self.raw.append((kind, stage, mb, label, start, self.clock.mark()))

    @contextlib.contextmanager
    def _span(self, kind: str, label: str) -> Iterator[None]:
        """A span inside the current action (``trace.spans``: an MoE layer's all_to_all), under its stage and
        micro-batch; appended before its enclosing action, which ends later."""
        stage, mb = self._inside
        start = self.clock.mark()
        try:
            yield
        finally:
            self.raw.append((kind, stage, mb, label, start, self.clock.mark()))

    @contextlib.contextmanager
    def patched(self, stages: Sequence[Any], schedule: Any) -> Iterator[None]:
        undo: list[Callable[[], None]] = []  # removes our stage call hooks

        last = [st.stage_index for st in stages if st.is_last]

        def wrap_loss(original_loss: Callable[..., Any]) -> Callable[..., Any]:
            def compute_loss(*args: Any, **kwargs: Any) -> Any:
                stage = last[0] if last else None
                mb = self._last_forward.get(stage) if stage is not None else None
                return self._timed("L", stage, mb, "", lambda: original_loss(*args, **kwargs))

            return compute_loss

        depth = [0]  # torch >= 2.14 splits a batch by process group and calls _batch_p2p once per group

        def wrap_batch(original_batch: Callable[..., Any]) -> Callable[..., Any]:
            def batch_p2p(p2p_ops: list, *args: Any, **kwargs: Any) -> Any:
                if not p2p_ops or depth[0]:  # a nested call is part of the span its caller records
                    return original_batch(p2p_ops, *args, **kwargs)
                label = " + ".join(self._op_tags.get(id(op), (None, "p2p"))[1] for op in p2p_ops)
                depth[0] += 1
                try:
                    works = self._timed("post", None, None, label, lambda: original_batch(p2p_ops, *args, **kwargs))
                finally:
                    depth[0] -= 1
                self._work_labels[id(works)] = (works, label)
                return works

            return batch_p2p

        def wrap_wait(original_wait: Callable[..., Any]) -> Callable[..., Any]:
            def wait_batch_p2p(work: list, *args: Any, **kwargs: Any) -> Any:
                if not work:
                    return original_wait(work, *args, **kwargs)
                _, label = self._work_labels.pop(id(work), (None, "p2p"))
                return self._timed("wait", None, None, label, lambda: original_wait(work, *args, **kwargs))

            return wait_batch_p2p

        try:
            with contextlib.ExitStack() as swaps:
                for stage in stages:
                    undo.extend(self._hook_stage(stage))
                swaps.enter_context(_compat.swapped_compute_loss(schedule, wrap_loss))
                swaps.enter_context(_compat.swapped_p2p(wrap_batch, wrap_wait))
                swaps.enter_context(listening(self._span))
                yield
        finally:
            for fn in reversed(undo):
                fn()
            self._op_tags.clear()
            self._work_labels.clear()

    def _hook_stage(self, stage: Any) -> list[Callable[[], None]]:
        """Our call hooks on one stage ([Note: stage call hooks] in runtime/stage.py); returns their removers."""
        s = stage.stage_index

        def forward_one_chunk(run: Callable[[], Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            mb = args[0]
            self._last_forward[s] = mb
            return self._timed("F", s, mb, "", run)

        def backward_one_chunk(run: Callable[[], Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            full = kwargs.get("full_backward", args[2] if len(args) > 2 else True)
            return self._timed("B" if full else "I", s, args[0], "", run)

        def backward_weight_one_chunk(run: Callable[[], Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            return self._timed("W", s, args[0], "", run)

        removers = [stage.add_call_hook("forward_one_chunk", forward_one_chunk),
                    stage.add_call_hook("backward_one_chunk", backward_one_chunk),
                    stage.add_call_hook("backward_weight_one_chunk", backward_weight_one_chunk)]
        for name, tag in (("get_fwd_send_ops", "send F"), ("get_fwd_recv_ops", "recv F"),
                          ("get_bwd_send_ops", "send B"), ("get_bwd_recv_ops", "recv B")):
            removers.append(stage.add_call_hook(name, self._tagging(tag)))
        return removers

    def _tagging(self, tag: str) -> Callable[..., list]:
        def get_ops(run: Callable[[], list], args: tuple[Any, ...], kwargs: dict[str, Any]) -> list:
            ops = run()
            for op in ops:
                self._op_tags[id(op)] = (op, f"{tag}{args[0]}")
            return ops

        return get_ops

    def finish(self, start_host_ns: int, end_mark: Any, wall_offset: int) -> StepRecord:
        marks = [m for item in self.raw for m in item[4:6]] + [end_mark]
        ns = self.clock.resolve(start_host_ns, marks)
        slices = [Slice(kind, stage, mb, ns[2 * i] + wall_offset, ns[2 * i + 1] + wall_offset, label)
                  for i, (kind, stage, mb, label, _, _) in enumerate(self.raw)]
        return StepRecord(0, 0, 0, [], 0, start_host_ns + wall_offset, ns[-1] + wall_offset, slices)
