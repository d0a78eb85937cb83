"""The failure watch on plain data: ranks are FailureWatch objects sharing an in-process store; exits are recorded."""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from lightning_pipe.runtime.watchdog import FailureWatch, describe_failure


class Ranks:
    """``n`` watches on one store, each with its exit recorded instead of performed."""

    def __init__(self, n: int, grace: float = 0.3) -> None:
        self.store = dist.PrefixStore("run/", dist.HashStore())
        self.exits: dict[int, int] = {}
        self.before: list[int] = []
        self.watches = [self._watch(rank, grace) for rank in range(n)]

    def _watch(self, rank: int, grace: float) -> FailureWatch:
        watch = FailureWatch(self.store, rank, interval=0.02, grace=grace, before_exit=lambda: self.before.append(rank))
        watch._exit = lambda code: self.exits.__setitem__(rank, code)  # type: ignore[method-assign]
        return watch.start()

    def wait_exits(self, count: int, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.exits) < count and time.monotonic() < deadline:
            time.sleep(0.01)

    def stop(self) -> None:
        for watch in self.watches:
            watch.stop()


def test_a_failure_stops_the_other_ranks_naming_the_rank_and_error(capsys: Any) -> None:
    ranks = Ranks(3)
    try:
        ranks.watches[1].report(ValueError("bad batch"))
        ranks.wait_exits(2)
        assert ranks.exits == {0: 1, 2: 1}  # the failing rank keeps running: its exception is its user's
        assert sorted(ranks.before) == [0, 2]
        err = capsys.readouterr().err
        assert "rank 0 stops because another rank failed: rank 1: ValueError: bad batch" in err
        assert "rank 2 stops because another rank failed: rank 1: ValueError: bad batch" in err
    finally:
        ranks.stop()


def test_the_first_failure_wins_and_ranks_failing_within_grace_are_not_stopped() -> None:
    ranks = Ranks(2, grace=0.5)
    try:
        assert ranks.watches[0].report(RuntimeError("root cause")) == "rank 0: RuntimeError: root cause"
        time.sleep(0.1)
        # rank 1 fails on its own shortly after (say, the same configuration error): the store keeps rank 0's
        assert ranks.watches[1].report(RuntimeError("Connection closed")) == "rank 0: RuntimeError: root cause"
        time.sleep(1.0)
        assert ranks.exits == {}
    finally:
        ranks.stop()


def test_a_stopped_watch_does_nothing() -> None:
    ranks = Ranks(2)
    ranks.watches[0].stop()
    ranks.watches[1].report(RuntimeError("x"))
    time.sleep(0.6)
    assert ranks.exits == {}
    ranks.stop()


def test_deadline_ends_the_process_unless_cleared(capsys: Any) -> None:
    ranks = Ranks(2)
    try:
        ranks.watches[1].set_deadline(10.0, "never", 3)
        ranks.watches[1].clear_deadline()
        ranks.watches[0].set_deadline(0.1, "SIGTERM deadline passed", 143)
        ranks.wait_exits(1)
        time.sleep(0.2)
        assert ranks.exits == {0: 143}
        assert "SIGTERM deadline passed" in capsys.readouterr().err
    finally:
        ranks.stop()


class GoneStore:
    """A store whose process ended: every call raises, as a TCPStore client does then."""

    def __init__(self) -> None:
        self.calls = 0

    def check(self, keys: Any) -> bool:
        self.calls += 1
        raise RuntimeError("Connection reset by peer")

    def compare_set(self, *args: Any) -> bytes:
        raise RuntimeError("Broken pipe")


def test_a_gone_store_is_never_taken_for_a_failure() -> None:
    store = GoneStore()
    exits: list[int] = []
    watch = FailureWatch(store, 1, interval=0.02, grace=0.0)
    watch._exit = exits.append  # type: ignore[method-assign]
    watch.start()
    time.sleep(0.3)
    assert store.calls == 1 and exits == []  # one failed poll, then silence (rank 0 may simply have finished)
    assert watch.report(ValueError("x")) is None  # reporting to a gone store does not raise either
    watch.stop()


def test_describe_failure_names_the_innermost_cause_first() -> None:
    try:
        try:
            raise ValueError("injected\n  failure")
        except ValueError as inner:
            raise RuntimeError("[Stage 1] failed to run forward:\n args: ...") from inner
    except RuntimeError as err:
        text = describe_failure(1, err)
    assert text == ("rank 1: ValueError: injected failure (raised inside RuntimeError: [Stage 1] failed to run "
                    "forward: args: ...)")
    assert describe_failure(0, KeyboardInterrupt()) == "rank 0: KeyboardInterrupt: (no message)"
    long: str | None = describe_failure(0, ValueError("x" * 5000))
    assert long is not None and len(long) < 2100 and long.endswith(" ...")
