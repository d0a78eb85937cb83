"""The failure watch on plain data: ranks are FailureWatch objects sharing an in-process store; exits are recorded."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import torch.distributed as dist

from lightning_pipe.runtime.watchdog import FailureWatch, describe_failure, is_peer_connection_error, report_now


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


# ------------------------------------------------------------------ issue 23: the cause, not gloo's "peer closed"
GLOO_CLOSED = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:47830. This is "
                           "typically caused by a remote worker crashing.")


class ClosableStore:
    """An in-process store that can 'end with its process' (rank 0's TCPStore): then every call raises."""

    def __init__(self) -> None:
        self.inner = dist.PrefixStore("run/", dist.HashStore())
        self.closed = False

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)

        def call(*args: Any) -> Any:
            if self.closed:
                raise RuntimeError("Connection reset by peer")
            return method(*args)

        return call


def test_peer_connection_errors_are_recognised_through_their_chain() -> None:
    assert is_peer_connection_error(GLOO_CLOSED)
    assert is_peer_connection_error(RuntimeError("NCCL error: remote process exited or there was a network error"))
    try:
        try:
            raise GLOO_CLOSED
        except RuntimeError as err:
            raise RuntimeError("[Stage 0] failed to run forward") from err
    except RuntimeError as wrapped:
        assert is_peer_connection_error(wrapped)
    assert not is_peer_connection_error(ValueError("bad batch"))


def test_a_lost_connection_names_the_first_failure_even_after_the_store_is_gone() -> None:
    """Rank 0 (the store's process) fails and ends; rank 1 then loses its connection: its error names rank 0's."""
    store = ClosableStore()
    exits: dict[int, int] = {}
    watches = [FailureWatch(store, rank, world_size=2, interval=0.02, grace=5.0) for rank in range(2)]
    for watch in watches:
        watch._exit = lambda code, w=watch: exits.__setitem__(w.rank, code)  # type: ignore[misc]
        watch.start()
    try:
        watches[0].report(ValueError("Read-only file system"))
        assert watches[0].wait_seen(timeout=5.0)  # both threads read it (rank 0 may end now)
        assert watches[1].seen == "rank 0: ValueError: Read-only file system"
        store.closed = True
        assert watches[1].report(GLOO_CLOSED) == "rank 0: ValueError: Read-only file system"
        assert watches[1].cause_of(GLOO_CLOSED) == "rank 0: ValueError: Read-only file system"
        assert watches[1].cause_of(ValueError("its own bug")) is None  # not a lost connection: its own error
        assert watches[0].cause_of(GLOO_CLOSED) is None  # the first failure is rank 0's own
        assert not watches[0].wait_seen(timeout=0.1)  # a gone store ends the wait at once
        assert exits == {}
    finally:
        for watch in watches:
            watch.stop()


def test_the_pipeline_faults_add_the_cause_to_a_lost_connection_and_print_it(capsys: Any) -> None:
    from lightning_pipe.lightning.faults import PipelineFaults

    ranks = Ranks(2)
    try:
        ranks.watches[1].report(ValueError("injected failure in configure_optimizers on rank 1"))
        faults = PipelineFaults(SimpleNamespace(global_rank=0), SimpleNamespace(), ranks.watches[0])
        error = RuntimeError(str(GLOO_CLOSED))
        faults.report(error)
        note = ("lightning_pipe: rank 0 lost its connection because another rank failed first: rank 1: ValueError: "
                "injected failure in configure_optimizers on rank 1")
        assert note in error.__notes__[0]
        assert note in capsys.readouterr().err
        time.sleep(0.5)
        assert ranks.exits == {}  # rank 0 failed itself: its own (annotated) exception ends it
    finally:
        ranks.stop()


def test_report_now_reaches_the_watch_running_in_this_process() -> None:
    ranks = Ranks(2)
    try:
        report_now(ValueError("hook failed on tensor rank 1"))  # the last watch started is rank 1's
        assert ranks.watches[0].first_failure() == "rank 1: ValueError: hook failed on tensor rank 1"
        assert ranks.watches[1].failed_here
    finally:
        ranks.stop()
    report_now(ValueError("no watch runs: nothing happens"))
