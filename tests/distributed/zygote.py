"""Ranks forked from one process that has already imported what a rank imports: [Note: forked ranks].

[Note: forked ranks]
A launched rank spends most of its life importing: torch, Lightning and ``lightning_pipe`` cost ~3-4 s of CPU per
process, and the suite starts ~40 launches of 2-8 ranks on 2 cores (a 2-rank launch with nothing to run: 6 s wall,
4 ranks: 13 s). So ``launcher.launch_runs`` asks a multiprocessing *forkserver* for its ranks: one server process per
pytest session, started with ``child_env()``'s environment, imports this module (the lean-imports hook, then
``tests.distributed.worker`` and through it every scenario), and forks a fresh copy of itself for each rank. A rank
then differs from a ``python -m tests.distributed.worker`` process only in what was read at import time, so:

- the forked rank sets its own environment (``os.environ`` replaced by the launch's) and the one value read from
  the rank variables at import, ``rank_zero_only.rank`` (Lightning / torchmetrics); its stdout and stderr go to its
  log; it starts its own session (``killpg`` ends it and whatever it started), as ``start_new_session`` did;
- a launch whose environment differs from the server's in anything but the rank variables (a test that sets an
  environment variable for its ranks) starts plain ``python -m tests.distributed.worker`` processes;
- ``LIGHTNING_PIPE_TEST_SUBPROCESS_RANKS=1`` starts plain processes for every launch.

Everything a rank does after its imports (process group, Trainer, scenarios, exit codes, signals) is unchanged.
"""

from __future__ import annotations

import faulthandler
import os
import sys

from tests.lean_imports import skip_torchmetrics_extras

skip_torchmetrics_extras()  # before Lightning imports torchmetrics (the server may not have run sitecustomize)

import tests.distributed.worker  # noqa: E402  (the import this server exists to pay once)


def run_rank(env: dict[str, str], cwd: str, out_dir: str, log_path: str) -> None:
    """The body of one forked rank: what ``python -m tests.distributed.worker OUT_DIR`` would do in ``cwd``, with its
    output in ``log_path``. Runs in the forked process (multiprocessing's target). Of the variables in ``env``, only
    ``launcher.RANK_VARIABLES`` may differ from the server's; of those, nothing the server imported read any at
    import time but ``rank_zero_only.rank``, set again here."""
    os.setsid()
    os.chdir(cwd)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    faulthandler.enable()  # a crash in C++ (SIGSEGV, SIGABRT) prints every thread's Python stack to the log
    os.environ.clear()
    os.environ.update(env)
    _reset_rank_zero_only()
    sys.argv = [tests.distributed.worker.__file__, out_dir]
    tests.distributed.worker.main()


def _reset_rank_zero_only() -> None:
    """The rank Lightning's and torchmetrics' ``rank_zero_only`` read from the environment when first imported."""
    import torchmetrics.utilities.prints as torchmetrics_prints
    from lightning.fabric.utilities.rank_zero import _get_rank
    from lightning_utilities.core.rank_zero import rank_zero_only

    rank_zero_only.rank = _get_rank() or 0  # Lightning's (fabric's and pytorch's are this same function)
    torchmetrics_prints.rank_zero_only.rank = int(os.environ.get("LOCAL_RANK", 0))  # type: ignore[attr-defined]

