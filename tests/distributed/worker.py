"""Entry point of one launched rank: ``python -m tests.distributed.worker OUT_DIR``.

Runs every (scenario, case) of ``OUT_DIR/runs.json``, in order, in this one process (one launch, many cases: process start-up and
imports dominate on 2 cores) and saves ``OUT_DIR/result<rank>.pt``. A case that raises records the error instead
of a result, so tests can assert on the messages of expected failures.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import lightning_pipe  # noqa: F401  (registers strategy="pipeline")
from tests.distributed.scenarios import SCENARIOS, Failure


def main() -> None:
    faulthandler.enable()  # a crash in C++ (SIGSEGV, SIGABRT) prints every thread's Python stack to the rank's log
    out_dir = Path(sys.argv[1])
    runs = json.loads((out_dir / "runs.json").read_text())
    rank = int(os.environ["RANK"])
    results: list[dict[str, Any]] = []
    for run in runs:
        scenario = SCENARIOS[run["scenario"]]
        case = scenario.case_type(**run["case"])  # an unknown or misspelt field fails here, not silently later
        try:
            results.append({"ok": True, **scenario.run(case)})
        except Exception as err:
            if not case.expect_error:
                traceback.print_exc()
                raise
            results.append(dict(Failure(ok=False, error=f"{type(err).__name__}: {err}")))
    torch.save(results, out_dir / f"result{rank}.pt")
    if dist.is_initialized():
        # Tear down in step: a rank exiting while peers still hold gloo pairs can abort them at exit.
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
