"""Start a benchmark's worker on N local CPU ranks (torchrun, 1 thread per rank) and collect rank 0's JSON result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def run_ranks(script: str, nproc: int, args: list[str], timeout: float = 1800) -> Any:
    """Run ``script --worker --out FILE ARGS`` on ``nproc`` ranks; rank 0 writes FILE (JSON); return its content."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
               "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               script, "--worker", "--out", str(out), *args]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            # the whole output kept: a rank's native abort message is often far above the last lines
            log = Path(tempfile.mkstemp(prefix=f"{Path(script).stem}-failed-", suffix=".log")[1])
            log.write_text(proc.stdout + proc.stderr)
            raise SystemExit(f"{Path(script).name} workers failed ({proc.returncode}; every rank's output: {log}):\n"
                             f"{proc.stderr[-4000:]}")
        return json.loads(out.read_text())
