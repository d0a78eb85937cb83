"""``probe``: what a launched rank sees before any Trainer (tests/distributed/test_launcher.py): the state a forked
rank must set itself ([Note: forked ranks] in tests/distributed/zygote.py), as a fresh interpreter would have it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TypedDict


@dataclass(frozen=True)
class ProbeCase:
    expect_error: bool = False


class Probe(TypedDict):
    rank: str
    lightning_rank_zero: int  # rank_zero_only.rank (Lightning, lightning_utilities)
    torchmetrics_rank_zero: int
    own_session: bool
    cwd: str
    world_size: str


def run_probe(case: ProbeCase) -> Probe:
    import torchmetrics.utilities.prints as torchmetrics_prints
    from lightning.pytorch.utilities import rank_zero_only

    return Probe(rank=os.environ["RANK"], lightning_rank_zero=rank_zero_only.rank,
                 torchmetrics_rank_zero=torchmetrics_prints.rank_zero_only.rank,  # type: ignore[attr-defined]
                 own_session=os.getsid(0) == os.getpid(), cwd=os.getcwd(), world_size=os.environ["WORLD_SIZE"])
