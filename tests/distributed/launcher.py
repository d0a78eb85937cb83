"""The one way multi-rank tests start processes: N ranks of ``tests.distributed.worker``, with a hard timeout.

Children run from the repo root with it on ``PYTHONPATH`` (``child_env``), so ``tests`` and ``recipes`` import there
as they do under pytest (``pythonpath = ["."]``). Ranks get the usual ``RANK/LOCAL_RANK/WORLD_SIZE/MASTER_*``
environment, so Lightning treats them as created externally (no re-run of pytest). A hang kills every rank and
fails the test with each rank's last output. Ranks are forked from one server process that has already imported
what a rank imports ([Note: forked ranks] in ``tests/distributed/zygote.py``).
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from tests.distributed.scenarios import Case

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RanksFailed(AssertionError):
    pass


Run = tuple[str, Case]  # (scenario name, case)


def child_env(**extra: str) -> dict[str, str]:
    """The environment of every process a test starts: the repo root importable (``tests``, ``recipes``), one thread,
    and ``tests/site`` (its ``sitecustomize``: [Note: lean test imports] in ``tests/lean_imports.py``)."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests" / "site"), env.get("PYTHONPATH", "")]),
               **extra)
    return env


RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TEST_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
"""Set per launch and rank: the only variables in which a forked rank's environment may differ from its server's."""


def _server_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in RANK_VARIABLES and k != "PYTEST_CURRENT_TEST"}


# The environment the rank server starts with: this session's, taken when the tests are collected (before any test
# sets a variable). A launch whose ranks would see another one starts plain processes.
_SESSION_ENV = _server_env(child_env())
_forkserver: Any = None


def _rank_server(env: dict[str, str]) -> Any:
    """The forkserver context for ranks with environment ``env``, or None: start plain processes."""
    global _forkserver
    if os.environ.get("LIGHTNING_PIPE_TEST_SUBPROCESS_RANKS") == "1" or _server_env(env) != _SESSION_ENV:
        return None
    if _forkserver is None:
        _forkserver = multiprocessing.get_context("forkserver")
        _forkserver.set_forkserver_preload(["tests.distributed.zygote"])
    # Started here (or again, if it died) with the session's environment: Process.start would start it with ours.
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(_SESSION_ENV)
    try:
        multiprocessing.forkserver.ensure_running()  # a no-op while it runs
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return _forkserver


class _ForkedRank:
    """A rank forked by the rank server, seen through the part of ``subprocess.Popen`` that ``launch_runs`` uses."""

    def __init__(self, context: Any, env: dict[str, str], out_dir: Path, log_path: Path) -> None:
        from tests.distributed.zygote import run_rank

        self.process = context.Process(target=run_rank, args=(env, str(REPO), str(out_dir), str(log_path)))
        self.process.start()
        self.pid: int = self.process.pid

    def poll(self) -> int | None:
        code: int | None = self.process.exitcode
        return code

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def wait(self) -> int | None:
        self.process.join()
        return self.poll()


def launch(scenario: str, world_size: int, cases: Sequence[Case], out_dir: Path,
           timeout: float = 240.0) -> list[list[dict[str, Any]]]:
    """Run ``scenario`` for every case on ``world_size`` ranks; return each rank's results (rank order)."""
    return launch_runs(world_size, [(scenario, case) for case in cases], out_dir, timeout)


def launch_runs(world_size: int, runs: Sequence[Run], out_dir: Path, timeout: float = 240.0
                ) -> list[list[dict[str, Any]]]:
    """Run each (scenario, case) in order, in the same ``world_size`` processes: a later case may read what an
    earlier one wrote. Per rank, one entry per run: the scenario's result plus ``ok: True``, or a ``Failure``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = [{"scenario": name, "case": asdict(case)} for name, case in runs]
    (out_dir / "runs.json").write_text(json.dumps(payload))
    scenario = ",".join(dict.fromkeys(name for name, _ in runs))  # for messages
    port = _free_port()
    envs = [child_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      TEST_WORLD_SIZE=str(world_size), NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            for rank in range(world_size)]
    server = _rank_server(envs[0])
    procs: list[Any] = []
    logs = []
    for rank, env in enumerate(envs):
        if server is not None:
            procs.append(_ForkedRank(server, env, out_dir, out_dir / f"rank{rank}.log"))
            continue
        log = open(out_dir / f"rank{rank}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tests.distributed.worker", str(out_dir)],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if now > deadline:
                if any(p.poll() not in (None, 0) for p in procs):
                    break  # report the failure (exit codes below), not a hang
                raise RanksFailed(f"{scenario}: ranks still running after {timeout:.0f}s (hang?)\n"
                                  + _tails(out_dir, world_size))
            if any(p.poll() not in (None, 0) for p in procs):
                # A rank failed: its peers should fail with their own clear error shortly; don't wait for a hang.
                deadline = min(deadline, now + 20)
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:  # a forked rank that has not started its session yet
                    os.kill(p.pid, signal.SIGKILL)
                p.wait()
        for log in logs:
            log.close()
    codes = [p.returncode for p in procs]  # -9: killed by us after a peer failed
    if any(codes):
        raise RanksFailed(f"{scenario}: exit codes {codes}\n" + _tails(out_dir, world_size))
    return [torch.load(out_dir / f"result{rank}.pt", weights_only=False) for rank in range(world_size)]


def _tails(out_dir: Path, world_size: int, lines: int = 25) -> str:
    parts = []
    for rank in range(world_size):
        path = out_dir / f"rank{rank}.log"
        text = path.read_text(errors="replace").splitlines() if path.exists() else []
        parts.append(f"--- rank {rank} ---\n" + "\n".join(text[-lines:]))
    return "\n".join(parts)
