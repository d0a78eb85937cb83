"""The one collective at a training step's end (runtime/agreement.py): what every rank reads equals what the loss
broadcast, the replicas' count all-reduce and the flags' MAX all-reduce gave, checked on simulated ranks (the
all-reduce is replaced by the sum over them); the faults read the agreed flags instead of their own all-reduce."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_pipe.parallel.topology import Topology
from lightning_pipe.runtime import agreement


def _simulate(monkeypatch: pytest.MonkeyPatch, topologies: list[Topology], local: dict[int, torch.Tensor],
              last: set[int], flags: dict[int, list[bool]],
              extra: dict[int, torch.Tensor] | None = None) -> dict[int, Any]:
    sent: dict[int, torch.Tensor] = {}
    rank = {"now": 0}
    monkeypatch.setattr(agreement.dist, "all_reduce", lambda t: sent.__setitem__(rank["now"], t.clone()))
    for topo in topologies:  # pass 1: what each rank contributes
        rank["now"] = topo.global_rank
        agreement.agree_step(local[topo.global_rank], topo.global_rank in last, flags[topo.global_rank], topo,
                             extra=None if extra is None else extra[topo.global_rank].clone())
    total = torch.stack(list(sent.values())).sum(0)
    monkeypatch.setattr(agreement.dist, "all_reduce", lambda t: t.copy_(total))
    out = {}
    for topo in topologies:  # pass 2: what each rank reads
        out[topo.global_rank] = agreement.agree_step(local[topo.global_rank], topo.global_rank in last,
                                                     flags[topo.global_rank], topo,
                                                     extra=None if extra is None else extra[topo.global_rank])
    return out


@pytest.mark.parametrize("dp,fsdp,tp", [(1, 1, 1), (2, 1, 1), (2, 1, 2), (1, 2, 1)])
def test_each_rank_reads_its_pipelines_loss_the_replicas_count_and_any_flag(monkeypatch: pytest.MonkeyPatch, dp: int,
                                                                            fsdp: int, tp: int) -> None:
    pp = 2
    world = dp * fsdp * tp * pp
    topologies = [Topology.create(world, dp, r, fsdp, tp) for r in range(world)]
    last = {t.global_rank for t in topologies if t.pp_rank == pp - 1}
    # the last stage of pipeline (dp_rank d, tensor rank t) holds (loss, count); other ranks hold garbage
    local = {t.global_rank: (torch.tensor([1.0 + 0.1 * t.dp_rank + 0.01 * t.tp_rank, 10.0 + t.dp_rank], dtype=torch.float64)
                             if t.global_rank in last else torch.tensor([99.0, 99.0], dtype=torch.float64))
             for t in topologies}
    flags = {r: [r == world - 1, False, r == 0, True] for r in range(world)}
    out = _simulate(monkeypatch, topologies, local, last, flags)
    for topo in topologies:
        agreement_ = out[topo.global_rank]
        own, total, agreed = agreement_.pipeline, agreement_.replicas_count, agreement_.flags
        holder = next(r for r in last if topologies[r].dp_rank == topo.dp_rank and topologies[r].tp_rank == topo.tp_rank)
        assert torch.equal(own, local[holder])  # bit for bit what the broadcast from the last stage gave
        assert total.item() == sum(10.0 + d for d in range(topo.dp_degree))  # the count all-reduce over replicas
        assert agreed.tolist() == [True, False, True, True]  # the MAX over every rank


def test_a_mean_loss_keeps_its_marker(monkeypatch: pytest.MonkeyPatch) -> None:
    topologies = [Topology.create(2, 1, r) for r in range(2)]
    mean = torch.tensor([2.5, -1.0], dtype=torch.float64)
    out = _simulate(monkeypatch, topologies, {0: torch.zeros(2, dtype=torch.float64), 1: mean}, {1}, {0: [], 1: []})
    for own, agreed in ((a.pipeline, a.flags) for a in out.values()):
        assert torch.equal(own, mean) and agreed.numel() == 0


def test_an_extra_payload_is_summed_over_the_world_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: tie sums in the agreement]: the tied gradients ride along without touching the loss or the flags."""
    topologies = [Topology.create(2, 1, r) for r in range(2)]
    mean = torch.tensor([2.5, -1.0], dtype=torch.float64)
    extra = {r: torch.arange(5, dtype=torch.float64) * (r + 1) for r in range(2)}
    out = _simulate(monkeypatch, topologies, {0: torch.zeros(2, dtype=torch.float64), 1: mean}, {1},
                    {0: [True], 1: [False]}, extra)
    for r, (own, agreed) in ((r, (a.pipeline, a.flags)) for r, a in out.items()):
        assert torch.equal(own, mean) and agreed.tolist() == [True]
        assert torch.equal(extra[r], torch.arange(5, dtype=torch.float64) * 3)


@pytest.mark.parametrize("phase,folded", list(itertools.product(["train", "validate"], [True, False])))
def test_faults_read_the_flags_agreed_with_the_loss(monkeypatch: pytest.MonkeyPatch, phase: str, folded: bool) -> None:
    """In training the flags come with the step's loss (no all-reduce of their own); evaluation, or an engine that
    did not fold them (Chimera's own loss reduction), still runs the faults' all-reduce."""
    from lightning_pipe.lightning import faults as faults_module

    reduced: list[list[bool]] = []
    monkeypatch.setattr(faults_module, "any_rank", lambda flags, device, group=None: reduced.append(list(flags)) or list(flags))
    agreed = [False, False, False, True] if folded else None
    engine = SimpleNamespace(take_agreed_flags=lambda: agreed)
    progress = SimpleNamespace(is_last_batch=False)
    loops = SimpleNamespace(batch_progress=progress)
    trainer = SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress,
                                                                                  val_loop=loops)),
                              state=SimpleNamespace(fn="fit"))
    strategy = SimpleNamespace(root_device="cpu", global_rank=0, launcher=None, engine=engine)
    faults = faults_module.PipelineFaults(strategy, trainer, SimpleNamespace())  # type: ignore[arg-type]
    assert faults.train_flags() == [False, False, False, True]
    faults.after_step(phase, 0)
    assert reduced == ([] if phase == "train" and folded else [[False, False, False, True]])
