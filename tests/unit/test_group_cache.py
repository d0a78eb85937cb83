"""[Note: process groups are reused]: one group per (purpose, ranks) for the default group's lifetime, dropped on every
rank when any rank's run ended in an exception (a world of one here; tests/distributed/test_soak.py runs 2 ranks)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from lightning_pipe.lightning import world as exit_handler_module
from lightning_pipe.parallel import group_cache


def _start() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


@pytest.fixture
def world() -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    _start()
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        group_cache.agree_on_kept_groups(torch.device("cpu"))  # nothing initialised: clears the stale mark only


def test_a_group_is_kept_per_purpose_and_ranks(world: None) -> None:
    pipeline = group_cache.shared_group([0], "pipeline")
    assert group_cache.shared_group([0], "pipeline") is pipeline
    other = group_cache.shared_group([0], "chimera_up")  # the same ranks, another use: a group of its own
    assert other is not pipeline
    assert dist.get_process_group_ranks(other) == [0]


def test_a_failed_run_on_any_rank_makes_the_next_setup_start_afresh(world: None) -> None:
    kept = group_cache.shared_group([0], "pipeline")
    group_cache.agree_on_kept_groups(torch.device("cpu"))  # nothing failed: kept
    assert group_cache.shared_group([0], "pipeline") is kept
    group_cache.forget_groups()
    assert group_cache.shared_group([0], "pipeline") is kept  # only a setup's agreement drops them
    group_cache.agree_on_kept_groups(torch.device("cpu"))
    fresh = group_cache.shared_group([0], "pipeline")
    assert fresh is not kept
    group_cache.agree_on_kept_groups(torch.device("cpu"))  # the mark was consumed
    assert group_cache.shared_group([0], "pipeline") is fresh


def test_a_group_of_a_destroyed_world_is_never_handed_out(world: None) -> None:
    old = group_cache.shared_group([0], "pipeline")
    old_mesh = group_cache.shared_mesh("cpu", (1,), ("pipeline",))
    assert group_cache.shared_mesh("cpu", (1,), ("pipeline",)) is old_mesh
    dist.destroy_process_group()
    _start()
    new = group_cache.shared_group([0], "pipeline")
    assert new is not old and dist.get_process_group_ranks(new) == [0]
    assert group_cache.shared_mesh("cpu", (1,), ("pipeline",)) is not old_mesh


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
@pytest.mark.parametrize("started_by", ["user", "strategy"])
def test_the_exit_handler_ends_every_kept_groups_threads(started_by: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kept gloo group's worker threads outlive ``destroy_process_group`` while the cache holds it; alive during
    interpreter finalization they can abort a process after a good run. The exit handler destroys and drops them,
    and the default group too when the strategy started it (a user's own stays theirs)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    exit_handler_module._leave_process_group()  # what earlier tests kept
    before = _os_threads()
    _start()
    with_default = _os_threads()
    monkeypatch.setattr(exit_handler_module, "_started_here", started_by == "strategy")
    for purpose in ("pipeline", "replicas", "ties"):
        dist.all_reduce(torch.ones(1), group=group_cache.shared_group([0], purpose))
    group_cache.shared_mesh("cpu", (1,), ("pipeline",))
    assert _os_threads() > with_default
    exit_handler_module._leave_process_group()
    if started_by == "user":
        assert dist.is_initialized() and _os_threads() == with_default
        dist.destroy_process_group()
    assert not dist.is_initialized()
    assert _os_threads() == before
    exit_handler_module._leave_process_group()  # nothing left: still safe
