"""The ``custom`` schedule: per-rank action lists, written inline in the config or read from a CSV file.

The lists use torch's compute-only schedule IR, one list per pipeline rank, in the order the rank runs them::

    schedule_options = {"actions": [["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"],   # rank 0
                                    ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3"]]}  # rank 1
    schedule_options = {"csv": "my_schedule.csv"}   # one row per rank, torch's ``_dump_csv`` compute-only format

An action is ``<stage><type><micro-batch>``: ``F`` forward, ``B`` full backward, or ``I`` then ``W`` (backward for
the input, then for the weights: zero-bubble style), and ``(0F3;3B1)OVERLAP_F_B`` for overlapped pairs. A row
may also be one comma-separated string; empty entries (and ``None``) are idle steps. Each rank holds the stages
its actions name ("as given"); ``placement: loop`` or ``v`` in the options additionally checks the lists against
that placement. The micro-batch count is read from the lists (it must match ``microbatches`` when that is set).

[Note: checking custom action lists]
Everything is checked as plain data on every rank, before any process group traffic, and an error names the rank,
the step (position in that rank's list, counting idle steps) and the action: unparsable or communication actions,
a stage on two ranks (or not on the rank the placement says), duplicate actions, a backward before its forward or
a weight-backward before its input-backward on the same rank, a forward without backward, and orders that
deadlock (replayed by :func:`lightning_pipe.schedules.simulate.simulate`). Torch's own ``_validate_schedule`` and send/recv
lowering then run on the same data as a second opinion. Torch sends and receives by itself at run time.
"""

from __future__ import annotations

import csv
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from lightning_pipe._compat import torch as _compat
from lightning_pipe.config import PipelineConfig, config_error
from lightning_pipe.runtime.spec import SchedulePlan, ScheduleSpec, placed_rank
from lightning_pipe.schedules.simulate import ScheduleDeadlock, flatten, simulate

KEY = "schedule_options"  # every error here is about the action lists (see config.SETTINGS)
OPTIONS = ("actions", "csv", "placement")


def load_actions(options: dict[str, Any]) -> list[list[Any]]:
    """The per-rank action lists of ``schedule_options`` as torch ``_Action`` objects (``None``: idle step).

    An option set to ``None`` is absent: the Hydra config ships ``csv: null`` next to ``actions``, so the shell can
    switch with ``schedule.options.csv=my.csv schedule.options.actions=null``.
    """
    options = {k: v for k, v in options.items() if v is not None}
    if ("actions" in options) == ("csv" in options):
        raise config_error("The custom schedule needs its per-rank action lists: exactly one of "
                           "schedule_options['actions'] (inline lists) or schedule_options['csv'] (a file path).",
                           f"schedule_options keys {sorted(options)}", KEY,
                           "in Hydra set the other one to null, e.g. schedule.options.actions=null")
    if "csv" in options:
        path = Path(str(options["csv"])).expanduser()
        if not path.is_file():
            where = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
            raise config_error("The custom schedule's CSV file must exist (one row of actions per rank).",
                               f"csv={str(path)!r}{where}", KEY)
        with open(path, newline="") as handle:
            rows: list[Any] = [row for row in csv.reader(handle)]
    else:
        given = options["actions"]
        rows = list(given) if isinstance(given, Sequence) and not isinstance(given, str) else []
        if not rows:
            raise config_error("schedule_options['actions'] is a list with one list of actions per rank.",
                               f"actions={options['actions']!r}", KEY)
    return [_parse_row(rank, row) for rank, row in enumerate(rows)]


def _parse_row(rank: int, row: Any) -> list[Any]:
    items: Sequence[Any] = row.split(",") if isinstance(row, str) else list(row)
    out: list[Any] = []
    for step, item in enumerate(items):
        if item is None or (isinstance(item, str) and item.strip() in ("", "None", "none")):
            out.append(None)
            continue
        if isinstance(item, _compat.Action):
            action = item
        else:
            try:
                action = _compat.parse_action(str(item))
            except Exception as err:
                raise config_error("Each action is <stage><F|B|I|W><micro-batch>, e.g. '0F0', '1B3', '2I1'.",
                                   f"rank {rank}, step {step}: {item!r} ({err})", KEY) from None
        for part in flatten(action):
            if part.computation_type.value not in ("F", "B", "I", "W"):
                raise config_error(
                    "Custom action lists are compute-only (F, B, I, W, OVERLAP_F_B of those): torch adds the sends, "
                    "receives and gradient reductions itself.",
                    f"rank {rank}, step {step}: action '{action}'", KEY)
            if part.microbatch_index is None:
                raise config_error("Every compute action names its micro-batch, e.g. '0F0'.",
                                   f"rank {rank}, step {step}: action '{action}'", KEY)
        out.append(action)
    return out


Located = list[tuple[int, int, Any, Any]]
"""Every compute part of the lists: (rank, step, the action, the part: itself, or one half of an OVERLAP_F_B)."""


def validate_actions(actions: list[list[Any]], pipeline_size: int, microbatches: int | None = None,
                     placement: str | None = None, stages_per_rank: int | None = None
                     ) -> tuple[tuple[int, ...], int]:
    """Check the lists (see [Note: checking custom action lists]); return (rank of each stage, micro-batches)."""
    if len(actions) != pipeline_size:
        raise config_error("The custom schedule gives one action list per pipeline rank.",
                           f"{len(actions)} action lists for pipeline size {pipeline_size}", KEY,
                           also=("devices", "data_parallel_size"))
    located = [(rank, step, action, part) for rank, row in enumerate(actions)
               for step, action in enumerate(row) if action is not None for part in flatten(action)]
    if not located:
        raise config_error("The custom schedule's action lists are empty.", "no actions", KEY)
    num_stages = 1 + max(part.stage_index for *_, part in located)
    m = microbatches if microbatches is not None else 1 + max(part.microbatch_index for *_, part in located)
    stage_ranks = _check_placement(located, pipeline_size, num_stages, m, placement, stages_per_rank)
    _check_order(located, num_stages, m, stage_ranks)
    _check_runs(actions, pipeline_size, num_stages, m)
    return stage_ranks, m


def _check_placement(located: Located, pipeline_size: int, num_stages: int, m: int, placement: str | None,
                     stages_per_rank: int | None) -> tuple[int, ...]:
    """Placement: as given (the first rank to name a stage holds it), optionally checked against loop / v; every
    stage on one rank, every rank with a stage. Returns the rank of each stage."""
    expected: Callable[[int], int] | None = None
    if placement not in (None, "given"):
        if placement in ("loop", "v"):
            expected = partial(placed_rank, placement, pipeline_size=pipeline_size)
        else:
            raise config_error("schedule_options['placement'] is 'loop', 'v' or omitted (as the lists give it).",
                               f"placement={placement!r}", KEY)
    owner: dict[int, tuple[int, int, Any]] = {}
    for rank, step, action, part in located:
        s = part.stage_index
        where = f"rank {rank}, step {step}: action '{action}'"
        if expected is not None and expected(s) != rank:
            raise config_error(f"With placement '{placement}' stage {s} lives on rank {expected(s)}; a rank can only "
                               "run its own stages.", where, KEY)
        if s in owner and owner[s][0] != rank:
            r0, st0, a0 = owner[s]
            raise config_error(f"A stage lives on one rank: stage {s} is already run by rank {r0} "
                               f"(step {st0}: '{a0}').", where, KEY)
        owner.setdefault(s, (rank, step, action))
        if not 0 <= part.microbatch_index < m:
            raise config_error(f"Micro-batch indices run from 0 to microbatches - 1 = {m - 1}.", where,
                               "microbatches", also=(KEY,))
    missing = [s for s in range(num_stages) if s not in owner]
    if missing:
        raise config_error("Stages are numbered 0..N-1 and each one appears in some rank's actions.",
                           f"stages {missing} of 0..{num_stages - 1} appear nowhere", KEY)
    idle = [r for r in range(pipeline_size) if not any(o[0] == r for o in owner.values())]
    if idle:
        raise config_error("Every pipeline rank runs at least one stage.", f"ranks {idle} have no actions", KEY)
    stage_ranks = tuple(owner[s][0] for s in range(num_stages))
    if stages_per_rank is not None:
        counts = [stage_ranks.count(r) for r in range(pipeline_size)]
        if any(c != stages_per_rank for c in counts):
            raise config_error("With stages_per_rank set, every rank's actions name exactly that many stages.",
                               f"stages_per_rank={stages_per_rank}, stages per rank in the lists {counts}",
                               "stages_per_rank", also=(KEY,))
    return stage_ranks


def _check_order(located: Located, num_stages: int, m: int, stage_ranks: tuple[int, ...]) -> None:
    """Each (stage, micro-batch): one F, then one B or one I followed by one W, in that order on its rank."""
    seen: dict[tuple[int, str, int], tuple[int, int, Any]] = {}
    for rank, step, action, part in located:
        s, kind, mb = part.stage_index, part.computation_type.value, part.microbatch_index
        where = f"rank {rank}, step {step}: action '{action}'"
        if (s, kind, mb) in seen:
            r0, st0, _ = seen[(s, kind, mb)]
            raise config_error("Each action runs once per batch.", f"{where} repeats step {st0}", KEY)
        if kind in ("B", "I") and (s, "F", mb) not in seen:
            raise config_error("A backward runs after its forward on the same rank.",
                               f"{where} comes before '{s}F{mb}'", KEY)
        if kind == "W" and (s, "I", mb) not in seen:
            raise config_error("A weight-backward (W) follows its input-backward (I) on the same rank.",
                               f"{where} comes before '{s}I{mb}' (or it is missing)", KEY)
        if (kind == "B" and (s, "I", mb) in seen) or (kind == "I" and (s, "B", mb) in seen):
            raise config_error("A micro-batch's backward is either B, or I then W, not both.", where, KEY)
        seen[(s, kind, mb)] = (rank, step, action)
    for s in range(num_stages):
        for mb in range(m):
            if (s, "F", mb) not in seen:
                raise config_error(f"Every stage runs a forward for every micro-batch ({m}).",
                                   f"rank {stage_ranks[s]} has no action '{s}F{mb}'", KEY, also=("microbatches",))
            if (s, "B", mb) not in seen and (s, "I", mb) not in seen:
                rank, step, action = seen[(s, "F", mb)]
                raise config_error("Every forward needs its backward: B, or I then W.",
                                   f"rank {rank}, step {step}: action '{action}' has no '{s}B{mb}'", KEY)
            if (s, "I", mb) in seen and (s, "W", mb) not in seen:
                rank, step, action = seen[(s, "I", mb)]
                raise config_error("An input-backward (I) needs its weight-backward (W) in the same batch.",
                                   f"rank {rank}, step {step}: action '{action}' has no '{s}W{mb}'", KEY)


def _check_runs(actions: list[list[Any]], pipeline_size: int, num_stages: int, m: int) -> None:
    """The lists replayed (no deadlock), then torch's own validation as a second opinion."""
    order = {rank: list(row) for rank, row in enumerate(actions)}
    try:
        simulate(order, num_stages)
    except ScheduleDeadlock as err:
        raise config_error("The action lists deadlock: each of these ranks waits for an action that can only run "
                           "after its own next one.", str(err), KEY) from None
    try:
        _compat.torch_check_actions(order, pipeline_size, num_stages, m)
    except (AssertionError, ValueError) as err:
        raise config_error("torch.distributed.pipelining refuses the action lists.",
                           str(err).splitlines()[0], KEY) from None


def resolve(spec: ScheduleSpec, config: PipelineConfig, pipeline_size: int) -> SchedulePlan:
    options = dict(config.schedule_options)
    actions = load_actions(options)
    stage_ranks, m = validate_actions(actions, pipeline_size, config.microbatches, options.get("placement"),
                                      config.stages_per_rank)
    per_rank = max(stage_ranks.count(r) for r in range(pipeline_size))
    return SchedulePlan(spec, pipeline_size, per_rank, m, stage_ranks=stage_ranks,
                        actions=tuple(tuple(row) for row in actions))


def build(plan: SchedulePlan, stages: list[Any], loss_fn: Callable[..., Any]) -> Any:
    assert plan.actions is not None
    return _compat.action_list_schedule(stages, plan.microbatches, loss_fn,
                                        {rank: list(row) for rank, row in enumerate(plan.actions)})


CUSTOM = ScheduleSpec("custom", _compat.PipelineScheduleRuntime,
                      "per-rank action lists (inline or CSV) run by torch's schedule runtime",
                      multi_stage=True, placement="given", default_stages_per_rank=1, allowed_stages_per_rank=None,
                      min_microbatches="none", resolve=resolve, build=build, options=OPTIONS,
                      tensor_parallel=True, needs="lists checked before any rank starts (placement, order, deadlock)")
