"""The GPT recipe end to end, as a user runs it: train.py (Hydra) in a subprocess, then sample.py.

Tiny settings (a 200 kB corpus slice, a few steps) keep each run to seconds; what is checked is the wiring —
config -> objects -> fit -> checkpoint/logs -> sampling — and, on the pipeline, that the loss falls.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from recipes.gpt import sample  # importable from the repo root: pyproject sets pythonpath = ["."]

REPO = Path(__file__).resolve().parents[2]

TRAIN = REPO / "recipes" / "gpt" / "train.py"
TINY = [
    "trainer.max_steps=4",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=2",
    "data.max_bytes=200000",
    "data.batch_size=4",
    "model.block_size=32",
    "model.n_layer=2",
    "model.n_embd=32",
    "model.n_head=2",
    "logger=csv",
    "trainer.enable_progress_bar=false",
    "trainer.log_every_n_steps=1",
]
SINGLE = ["strategy=single", "trainer=cpu_1"]


def run_train(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, str(TRAIN), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"train.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def metrics(run_dir: Path) -> list[dict[str, str]]:
    files = list(run_dir.glob("csv/version_*/metrics.csv"))
    assert len(files) == 1, files
    with files[0].open() as f:
        return list(csv.DictReader(f))


def test_single_device_multirun_then_sample(tmp_path: Path) -> None:
    """Two single-device jobs in one Hydra multirun, one per variable-length data option (dynamic padding, packed
    rows; the fixed windows train in the test below); each writes logs and a checkpoint that sample.py reads."""
    sweep = tmp_path / "sweep"
    proc = run_train(["-m", *SINGLE, *TINY, "data=dynamic_padding,packed", f"hydra.sweep.dir={sweep}"])
    assert proc.stdout.count("[train] corpus 200000 bytes | val_loss") == 2
    assert (sweep / "multirun.yaml").is_file()
    for job in ("0", "1"):
        run = sweep / job
        assert (run / "checkpoints" / "last.ckpt").is_file() and (run / ".hydra" / "config.yaml").is_file()
        logged = {k for row in metrics(run) for k, v in row.items() if v}
        assert {"train_loss", "val_loss", "tokens_per_s", "lr-AdamW/pg1", "step"} <= logged

    ckpt = sweep / "0" / "checkpoints" / "last.ckpt"
    text = sample.main(["--ckpt", str(ckpt), "--prompt", "def ", "--tokens", "20"])
    assert text.startswith("def ") and len(text.encode("utf-8", errors="replace")) >= 4


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_pipeline_two_cpu_stages(tmp_path: Path) -> None:
    """2 stages on 2 CPU processes through the Hydra entry point, with overrides: the loss falls, a (sharded)
    checkpoint is written, and it samples on one device."""
    run = tmp_path / "run"
    steps = ["trainer.max_steps=12", "model.lr=3e-3", "model.warmup_steps=2"]
    command = ["trainer=cpu_2", "strategy=pipeline", "schedule=gpipe", "schedule.microbatches=2", *TINY,
               f"hydra.run.dir={run}", "ckpt_path=last", "checkpoint_every_n_steps=5"]
    proc = run_train([*command, *steps], 300)
    assert "[train] corpus 200000 bytes | val_loss" in proc.stdout
    assert "Restored all states" not in proc.stdout + proc.stderr  # the first start: nothing to resume yet
    rows = metrics(run)
    logged = {k for row in rows for k, v in row.items() if v}
    assert {"train_loss", "val_loss", "tokens_per_s"} <= logged
    train = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    assert len(train) >= 10 and sum(train[-3:]) / 3 < sum(train[:3]) / 3 - 0.1, train  # the loss fell
    ckpt = run / "checkpoints" / "last.ckpt"
    assert ckpt.exists() and (ckpt.resolve() / "meta.pt").is_file()  # the sharded directory behind "last"

    # The pipeline's checkpoint (sharded across stages) samples on one device like a single-device one.
    text = sample.main(["--ckpt", str(ckpt), "--prompt", "def ", "--tokens", "10"])
    assert text.startswith("def ")

    # The same command (a longer run) resumes from last.ckpt: what a restarted job does.
    again = run_train([*command, "trainer.max_steps=14", "model.lr=3e-3", "model.warmup_steps=2"], 300)
    assert f"Restored all states from the checkpoint at {ckpt}" in again.stdout + again.stderr
