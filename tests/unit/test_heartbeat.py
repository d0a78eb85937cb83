"""Heartbeats on plain data ([Note: heartbeats]): ranks share an in-process store, time is a counter."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch.distributed as dist

from lightning_pipe.config import PipelineConfigError
from lightning_pipe.lightning.liveness import resolve_heartbeat_timeout
from lightning_pipe.runtime.heartbeat import Heartbeat, HostIdentity, ranks_text, watched_peers
from lightning_pipe.runtime.watchdog import FailureWatch

IDS = [HostIdentity(0, "10.0.0.1", "a"), HostIdentity(0, "10.0.0.1", "a"), HostIdentity(1, "10.0.0.2", "b")]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _ranks(clock: Clock, timeout: float = 10.0) -> tuple[Any, list[Heartbeat]]:
    store = dist.PrefixStore("run/", dist.HashStore())
    return store, [Heartbeat(r, 3, timeout, IDS, "10.0.0.1:29500", clock=clock) for r in range(3)]


def _beat(store: Any, beats: list[Heartbeat], ranks: list[int]) -> None:
    for r in ranks:
        beats[r].beat(store)


def test_a_rank_that_stops_beating_is_named_with_its_host_and_last_status() -> None:
    clock = Clock()
    store, beats = _ranks(clock)
    beats[2].status = "in training batch 7"
    for _ in range(3):
        clock.now += 1
        _beat(store, beats, [0, 1, 2])
    for _ in range(10):  # rank 2 falls silent; 0 and 1 go on (rank 0 read rank 2's last value one beat late)
        clock.now += 1
        _beat(store, beats, [0, 1])
    assert beats[0].silence() is None  # 9 s
    clock.now += 1
    _beat(store, beats, [0, 1])
    silence = beats[0].silence()
    assert silence is not None and silence.ranks == (2,) and silence.seconds == 10
    text = beats[0].describe_silence(silence)
    assert text.startswith("rank(s) 2 on node 1 (10.0.0.2, hostname 'b') not heard from for 10 s")
    assert "last seen: rank 2: in training batch 7" in text
    assert beats[1].silence() is not None and beats[2].silence() is None


def test_peers_cut_off_together_are_named_together() -> None:
    """One cut silences several hosts, their last beats a beat apart: the first past the timeout names them all."""
    clock = Clock()
    store, beats = _ranks(clock)
    for _ in range(3):
        clock.now += 1
        _beat(store, beats, [0, 1, 2])
    clock.now += 1
    _beat(store, beats, [0, 1])  # rank 2's last beat came one beat before rank 1's
    for _ in range(9):
        clock.now += 1
        _beat(store, beats, [0])
    assert beats[0].silence() is None
    clock.now += 1
    _beat(store, beats, [0])
    silence = beats[0].silence()  # rank 2 passed the timeout; rank 1, a beat behind it, is named with it
    assert silence is not None and silence.ranks == (1, 2) and silence.seconds == 10
    assert beats[0].describe_silence(silence).startswith("rank(s) 1 on node 0 (10.0.0.1, hostname 'a'); rank(s) 2")


def test_silence_is_counted_only_while_the_store_answers_here() -> None:
    """Cut off from the store, a rank learns nothing of its peers: the store falls silent, not the peers."""
    clock = Clock()
    store, beats = _ranks(clock)
    clock.now += 1
    _beat(store, beats, [0, 1, 2])
    clock.now += 30  # rank 0's beats no longer complete
    assert beats[0].silence() is None
    assert beats[0].store_silence() == 30
    text = beats[0].describe_store_silence(30)
    assert "the rendezvous store at 10.0.0.1:29500, the host of rank(s) 0-1 on node 0 (10.0.0.1" in text


def test_a_rank_that_ends_normally_is_no_longer_watched() -> None:
    clock = Clock()
    store, beats = _ranks(clock)
    clock.now += 1
    _beat(store, beats, [0, 1, 2])
    beats[2].finish(store)
    clock.now += 1
    _beat(store, beats, [0])
    clock.now += 50
    _beat(store, beats, [0])
    silence = beats[0].silence()
    assert silence is not None and silence.ranks == (1,)


def test_a_rank_never_heard_from_is_lost_after_the_timeout() -> None:
    clock = Clock()
    store, beats = _ranks(clock)
    clock.now += 10
    _beat(store, beats, [1, 0])
    silence = beats[0].silence()
    assert silence is not None and silence.ranks == (2,)
    assert "never heard from since the watch started" in beats[0].describe_silence(silence)


def test_watched_peers_and_rank_ranges() -> None:
    assert watched_peers(1, 4) == [2, 3, 0]
    assert len(watched_peers(0, 1000)) == 64 and watched_peers(999, 1000)[:2] == [0, 1]
    assert ranks_text([5, 0, 1, 2, 7, 8]) == "0-2, 5, 7-8"


def test_the_guard_stops_a_rank_whose_peer_is_silent_and_tells_the_others(capsys: Any) -> None:
    """With the real threads: rank 2 never beats; ranks 0 and 1 name it and end with code 1."""
    store = dist.PrefixStore("run/", dist.HashStore())
    exits: dict[int, int] = {}
    watches = []
    for rank in (0, 1):
        beat = Heartbeat(rank, 3, 2.0, IDS, "10.0.0.1:29500")
        watch = FailureWatch(store, rank, world_size=3, interval=0.05, heartbeat=beat,
                             on_lost=lambda: "\nrestart note")
        watch._exit = lambda code, r=rank: exits.__setitem__(r, code)  # type: ignore[method-assign]
        watches.append(watch.start())
    try:
        deadline = time.monotonic() + 10
        while len(exits) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert exits == {0: 1, 1: 1}
        err = capsys.readouterr().err
        assert "rank 0 stops: rank(s) 2 on node 1 (10.0.0.2, hostname 'b') not heard from for 2 s" in err
        assert "restart note" in err
        assert store.get("first_failure").decode().startswith("rank ")
        assert "lost contact with rank(s) 2 on node 1" in store.get("first_failure").decode()
    finally:
        for watch in watches:
            watch.stop()


@pytest.mark.parametrize("value", [1, -3, "30", True])
def test_heartbeat_timeout_is_checked(value: Any) -> None:
    with pytest.raises(PipelineConfigError, match=r"at least 2 seconds.*heartbeat_timeout"):
        resolve_heartbeat_timeout(value)


def test_heartbeat_timeout_off_and_default() -> None:
    assert resolve_heartbeat_timeout(None) is None and resolve_heartbeat_timeout(0) is None
    assert resolve_heartbeat_timeout(30) == 30.0
