"""``project --emit-config`` end to end, as a user runs it: the planner searches a layout for this machine's CPU
ranks (described as a 2-device cluster) and writes a Hydra experiment; ``recipes/gpt/train.py experiment=...``
trains it as written (only the run's length and output directory given on the command line)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CPU = {"gpus": 2, "gpus_per_node": 2, "peak_tflops": 0.02, "memory_gib": 4, "nvlink_gbps": 0.5,
       "network_gbps": 0.5, "precision": "fp32", "accelerator": "cpu", "name": "this-machine"}


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_emitted_layout_trains_on_cpu_ranks(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cluster = tmp_path / "cpu.json"
    cluster.write_text(json.dumps(CPU))
    target = tmp_path / "experiment" / "planned.yaml"
    plan = subprocess.run([sys.executable, "-m", "lightning_pipe.planner", "project", "--model",
                           "configs/model/gpt_tiny.yaml", "--cluster", str(cluster), "--global-batch", "16",
                           "--layout", "pp=2,mbs=2", "--top", "1", "--emit-config", str(target)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert f"--config-dir {tmp_path} experiment=planned" in plan.stdout, plan.stdout
    written = yaml.safe_load(target.read_text())
    assert written["trainer"]["accelerator"] == "cpu" and written["schedule"]["microbatches"] == 8
    run = subprocess.run([sys.executable, "recipes/gpt/train.py", "--config-dir", str(tmp_path), "experiment=planned",
                          "trainer.max_steps=3", "trainer.val_check_interval=3", "trainer.limit_val_batches=1",
                          "data.max_bytes=200000", "trainer.enable_progress_bar=false", "logger=none",
                          f"paths.output_dir={tmp_path / 'run'}"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=360)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    assert "[train] corpus 200000 bytes | val_loss" in run.stdout
    start = 0
    for stage, count in enumerate(written["strategy"]["partition"]):  # the strategy logged the planned split
        assert f"stage {stage}: layers {start}-{start + count - 1}" in run.stdout + run.stderr, run.stderr[-3000:]
        start += count
