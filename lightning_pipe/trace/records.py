"""Per-rank execution records of pipeline steps as plain data, the measured bubble, and their JSON files.

[Note: measured bubble]
For one rank and one step: ``bubble = 1 - busy / wall`` where ``wall`` is the time the rank spent inside the
schedule's ``step()`` and ``busy`` the summed duration of its compute slices (F, B, I, W and the loss), less the
expert dispatch inside them (MoE ``all_to_all``, its own ``dispatch`` slices). Waiting for
a peer, posting sends/receives and schedule bookkeeping count as idle. The pipeline's bubble is the mean over ranks.
Torch's theory, ``(p - 1) / (m + p - 1)`` for GPipe/1F1B, assumes equal stage times and free communication; the
measurement includes what the theory leaves out (the loss on the last stage, P2P latency, uneven stages).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

COMPUTE_KINDS = ("F", "B", "I", "W", "L")
COMM_KINDS = ("post", "wait")
DISPATCH_KINDS = ("dispatch",)
"""Collectives *inside* a compute slice (an MoE layer's token ``all_to_all``, marked by
:func:`lightning_pipe.trace.spans.span`): shown on their own and taken out of the busy time."""
KIND_NAMES = {"F": "forward", "B": "backward", "I": "backward (input grad)", "W": "backward (weight grad)",
              "L": "loss", "post": "post send/recv", "wait": "wait send/recv",
              "dispatch": "expert dispatch (all_to_all)"}
RECORDS_VERSION = 1


# ---------------------------------------------------------------------------------------------------------- records
@dataclass
class Slice:
    """One action on one rank. Times are nanoseconds on the shared axis (see [Note: how the trace is recorded])."""

    kind: str
    """F, B, I, W, L (compute) or post, wait (communication)."""
    stage: int | None
    mb: int | None
    start_ns: int
    end_ns: int
    label: str = ""
    """What a communication slice carried, e.g. ``send F1 + recv B0``."""

    @property
    def name(self) -> str:
        if self.kind in COMPUTE_KINDS:
            return f"{self.kind}{self.mb} s{self.stage}"
        return f"{self.kind} {self.label}".strip()

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "stage": self.stage, "mb": self.mb, "start_ns": self.start_ns,
                "end_ns": self.end_ns, "label": self.label}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Slice:
        return cls(d["kind"], d.get("stage"), d.get("mb"), int(d["start_ns"]), int(d["end_ns"]), d.get("label", ""))


@dataclass
class StepRecord:
    """Everything one rank did in one schedule step."""

    rank: int
    pp_rank: int
    dp_rank: int
    stages: list[int]
    step: int
    """Index of the recorded batch (the callback's batch counter; several per optimizer step with accumulation)."""
    start_ns: int
    end_ns: int
    slices: list[Slice] = field(default_factory=list)

    @property
    def wall_ns(self) -> int:
        return max(self.end_ns - self.start_ns, 1)

    def busy_ns(self) -> int:
        """Compute time, less the expert dispatch inside it (waiting on peers, as P2P waits are)."""
        return sum(s.end_ns - s.start_ns for s in self.slices if s.kind in COMPUTE_KINDS) - self.dispatch_ns()

    def dispatch_ns(self) -> int:
        return sum(s.end_ns - s.start_ns for s in self.slices if s.kind in DISPATCH_KINDS)

    def comm_ns(self) -> int:
        return sum(s.end_ns - s.start_ns for s in self.slices if s.kind in COMM_KINDS)

    def bubble(self) -> float:
        """``1 - busy / wall`` for this rank ([Note: measured bubble])."""
        return 1.0 - self.busy_ns() / self.wall_ns

    def compute_order(self) -> list[str]:
        """Compute actions in execution order, as torch writes them (``"1F0"``; the loss as ``"1L0"``)."""
        return [f"{s.stage}{s.kind}{s.mb}" for s in self.slices if s.kind in COMPUTE_KINDS]

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "pp_rank": self.pp_rank, "dp_rank": self.dp_rank, "stages": self.stages,
                "step": self.step, "start_ns": self.start_ns, "end_ns": self.end_ns,
                "bubble": self.bubble(), "slices": [s.to_dict() for s in self.slices]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepRecord:
        return cls(d["rank"], d["pp_rank"], d.get("dp_rank", 0), list(d.get("stages", [])), d["step"],
                   int(d["start_ns"]), int(d["end_ns"]), [Slice.from_dict(s) for s in d["slices"]])


def pipeline_bubble(records: Sequence[StepRecord]) -> float:
    """Mean of the ranks' bubbles (one record per rank of one step)."""
    return sum(r.bubble() for r in records) / len(records)


# ---------------------------------------------------------------------------------------------------------- files
def save_records(records: Sequence[StepRecord], path: str | Path, meta: dict[str, Any] | None = None) -> Path:
    """Write records (any ranks, any steps) as JSON; ``meta``: schedule name, p, v, m, theoretical bubble..."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": RECORDS_VERSION, "meta": meta or {},
                                "records": [r.to_dict() for r in records]}))
    return path


def load_records(path: str | Path) -> tuple[list[StepRecord], dict[str, Any]]:
    data = json.loads(Path(path).read_text())
    if data.get("version") != RECORDS_VERSION:
        raise ValueError(f"{path}: not a lightning_pipe trace records file (version {data.get('version')!r}, "
                         f"expected {RECORDS_VERSION})")
    return [StepRecord.from_dict(r) for r in data["records"]], data.get("meta", {})


def by_step(records: Sequence[StepRecord]) -> dict[int, list[StepRecord]]:
    """Step index -> that step's records, one per rank, in rank order."""
    out: dict[int, list[StepRecord]] = {}
    for r in records:
        out.setdefault(r.step, []).append(r)
    return {k: sorted(v, key=lambda r: r.rank) for k, v in sorted(out.items())}
