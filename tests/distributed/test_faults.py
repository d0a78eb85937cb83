"""No hangs (issue 14, items 4 and 5), on real processes started the way users start them (popen: the script is
re-run for rank 1): a rank that fails and stays alive, SIGTERM to the main process mid-step, kill -9 of a rank;
issue 23: a rank that fails and ends is named on every rank, a tensor-parallel hook failing on one rank.
``python -m bench sigterm`` runs the SIGTERM case 20 times and times every exit."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.distributed import fault_script as fs
from tests.distributed.launcher import RanksFailed, launch
from tests.distributed.scenarios import TrainingCase

pytestmark = [pytest.mark.distributed]

STARTUP_S = 180.0  # two Python processes importing Lightning on a busy 2-core machine


def wait_for_file(path: Path, proc: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path.name} never appeared:\n{fs.log_tail(path.parent)}")
        time.sleep(0.05)


@pytest.mark.timeout(300)
def test_a_rank_that_fails_and_stays_alive_stops_every_rank(tmp_path: Path) -> None:
    proc = fs.start(tmp_path, "fail", fail_rank=1, fail_at=9)
    try:
        wait_for_file(tmp_path / "caught1", proc, STARTUP_S)  # rank 1 raised, caught it, and sleeps 90 s
        seconds, codes = fs.time_to_exit(tmp_path, proc, time.monotonic(), 60)
    finally:
        fs.cleanup(proc)
    log = fs.log_tail(tmp_path, 60)
    assert seconds < 60, f"ranks still running 60 s after rank 1 failed:\n{log}"
    assert codes[0] == 1, log  # rank 0 stopped itself (and ended rank 1, which it launched)
    assert ("lightning_pipe: rank 0 stops because another rank failed: rank 1: RuntimeError: injected failure in "
            "a layer's forward (call 9)") in log, log


@pytest.mark.timeout(420)
def test_sigterm_mid_step_stops_every_rank_together_and_last_checkpoint_resumes(tmp_path: Path) -> None:
    rng = random.Random(14)
    stopped = []
    for trial in range(2):
        out = tmp_path / f"trial{trial}"
        proc = fs.start(out, "train", ckpt=True, busy=True)  # compute-bound steps, as real ones
        try:
            fs.wait_for_step(out, proc, 3 + 2 * trial, timeout=STARTUP_S)
            time.sleep(rng.uniform(0.0, 0.4))  # somewhere inside a step (about 0.2-0.4 s here)
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            seconds, codes = fs.time_to_exit(out, proc, sent, 30)
        finally:
            fs.cleanup(proc)
        log = fs.log_tail(out, 60)
        assert seconds < 30, f"trial {trial}: ranks still running 30 s after SIGTERM:\n{log}"
        assert codes[0] == 0, log  # Lightning's SIGTERMException: a clean stop
        step = fs.read_int(out / "step0")
        assert step is not None and step == fs.read_int(out / "step1"), log  # the same step on both ranks
        assert f"saved {out / 'ckpt' / 'last.ckpt'} at global step {step} after SIGTERM" in log, log
        assert fs.last_checkpoint_step(out) == step, log
        stopped.append(step)

    # The last complete checkpoint loads and training continues from it.
    out = tmp_path / "trial0"
    proc = fs.start(out, "resume", ckpt=True, max_steps=stopped[0] + 2)
    try:
        code = proc.wait(timeout=STARTUP_S)
    finally:
        fs.cleanup(proc)
    assert code == 0, fs.log_tail(out)
    for rank in (0, 1):
        assert fs.read_int(out / f"start{rank}") == stopped[0], fs.log_tail(out)
        assert fs.read_int(out / f"resumed{rank}") == stopped[0] + 2, fs.log_tail(out)


@pytest.mark.timeout(300)
def test_kill_9_of_the_main_process_still_ends_every_process(tmp_path: Path) -> None:
    """Rank 0 also hosts the store: rank 1 still ends (its transfers fail on closed sockets); its watch takes the
    lost store quietly, neither hanging nor reporting a failure of its own."""
    victim = 0
    proc = fs.start(tmp_path, "train")
    try:
        fs.wait_for_step(tmp_path, proc, 3, timeout=STARTUP_S)
        pid = fs.read_int(tmp_path / f"pid{victim}")
        assert pid is not None
        sent = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        seconds, _ = fs.time_to_exit(tmp_path, proc, sent, 30)
    finally:
        fs.cleanup(proc)
    assert seconds < 30, f"ranks still running 30 s after kill -9 of rank {victim}:\n{fs.log_tail(tmp_path)}"


# ---------------------------------------------------------------------------------------------------- issue 23
@pytest.mark.timeout(300)
def test_a_failing_rank_is_named_on_every_rank_whether_it_ends_or_blocks_a_tensor_parallel_split(
        tmp_path: Path) -> None:
    """Three runs side by side (one launch's worth of suite time):

    * the failing process *ends* (its sockets close): the other rank's transfer fails at once with gloo's
      "Connection closed by peer", and that rank must still print the cause: rank 1 fails in
      ``configure_optimizers`` (setup), or rank 0 (the store's process) in a checkpoint save (a read-only disk);
    * tensor rank 1's ``parallelize_layer`` raises at layer 0 while tensor rank 0 goes on to layer 1's broadcast
      and its hook's collectives (a hang until the process-group timeout before): rank 0 stops, naming rank 1's
      error, and rank 1 raises its own error, not the lost connection.
    """
    runs = {"setup": (1, dict(fail_rank=1, fail_in="configure_optimizers")),
            "save": (0, dict(fail_rank=0, fail_in="save", ckpt=True, ckpt_every=2)),
            "forward": (1, dict(fail_rank=1, fail_in="forward", fail_at=6, on_exception_ckpt=True))}
    procs = {name: fs.start(tmp_path / name, "crash", **opts) for name, (_, opts) in runs.items()}
    try:
        split = tmp_path / "split"
        case = TrainingCase(model="tp_hook_fails", tp=2, steps=1, validate=False, expect_error=True)
        with pytest.raises(RanksFailed) as failed:
            launch("training", 2, [case], split, timeout=200)
        codes = {name: proc.wait(timeout=STARTUP_S) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            fs.cleanup(proc)
    for name, (failing, _) in runs.items():
        log = fs.log_tail(tmp_path / name, 400)
        other = 1 - failing
        assert codes[name] != 0, log
        cause = {"setup": "ValueError: injected failure in configure_optimizers on rank 1",
                 "save": "OSError: [Errno 30] Read-only file system",
                 "forward": "RuntimeError: injected failure in a layer's forward (call 6)"}[name]
        if "Connection closed by peer" in log:  # the failing process ended first: the other rank's own error
            note = (f"lightning_pipe: rank {other} lost its connection because another rank failed first: "
                    f"rank {failing}: ")
            assert note + cause in log, log
            assert f"[rank{other}]: {note}{cause}" in log, log  # also in its traceback (a note on its exception)
        else:  # on a loaded machine the failing process can outlive the watchdog's grace: it stops the other rank
            assert f"lightning_pipe: rank {other} stops because another rank failed: rank {failing}: {cause}" in log, log
        if name == "forward":  # OnExceptionCheckpoint after a failure: said, not attempted (a collective save)
            whole = (tmp_path / name / "log").read_text(errors="replace")  # (warnings are off in the test ranks)
            assert not (tmp_path / name / "on_exception").exists()
            assert "in on_exception" not in whole and "in save_checkpoint" not in whole, whole[-6000:]
    rank0 = (split / "rank0.log").read_text(errors="replace")
    assert ("lightning_pipe: rank 0 stops because another rank failed: rank 1: ValueError: injected failure in "
            "parallelize_layer on tensor rank 1 at layer 0") in rank0, failed.value
    rank1 = torch.load(split / "result1.pt", weights_only=False)
    assert rank1 == [{"ok": False, "error": "ValueError: injected failure in parallelize_layer on tensor rank 1 at "
                                            "layer 0"}], rank1
