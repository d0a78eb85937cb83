"""Entry point of one launched rank: ``python -m tests.distributed.worker SCENARIO OUT_DIR``.

Runs every case of ``OUT_DIR/cases.json`` in this one process (one launch, many cases: process start-up and
imports dominate on 2 cores) and saves ``OUT_DIR/result<rank>.pt``. A case that raises records the error instead
of a result, so tests can assert on the messages of expected failures.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import lightning_pipe  # noqa: F401  (registers strategy="pipeline")
from tests.distributed import scenarios

SCENARIOS = {
    "training": lambda case: scenarios.run_training(case, pipeline=True),
}

# checkpoint scenarios (tests/distributed/test_checkpoint.py)
SCENARIOS.update({
    "ckpt": scenarios.run_ckpt,
})

# timeline / measured bubble (tests/distributed/test_trace.py)
SCENARIOS.update({
    "trace": scenarios.run_trace,
})


def main() -> None:
    name, out_dir = sys.argv[1], Path(sys.argv[2])
    cases = json.loads((out_dir / "cases.json").read_text())
    rank = int(os.environ["RANK"])
    results = []
    for case in cases:
        expect_error = case.pop("expect_error", False)
        try:
            results.append({"ok": True, **SCENARIOS[name](case)})
        except Exception as err:  # noqa: BLE001
            if not expect_error:
                traceback.print_exc()
                raise
            results.append({"ok": False, "error": f"{type(err).__name__}: {err}"})
    torch.save(results, out_dir / f"result{rank}.pt")
    if dist.is_initialized():
        # Tear down in step: a rank exiting while peers still hold gloo pairs can abort them at exit.
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
