"""The Llama-style recipe from the shell, as a user runs it: 2 pipeline stages on 2 CPU processes through the GPT
recipe's Hydra entry point (``experiment=llama_tiny_cpu``); its validation loss must beat the unigram baseline."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.recipes.test_gpt_recipe import run_train


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_llama_tiny_trains_on_two_cpu_stages_and_beats_the_unigram_baseline(tmp_path: Path) -> None:
    proc = run_train(["experiment=llama_tiny_cpu", "trainer.max_steps=60", "trainer.val_check_interval=60",
                      "trainer.limit_val_batches=8", "data.max_bytes=1000000", "model.lr=3e-3",
                      "model.warmup_steps=10", "logger=csv", "trainer.enable_progress_bar=false",
                      f"hydra.run.dir={tmp_path / 'run'}"], 360)
    assert "schedule=1f1b" in proc.stdout + proc.stderr and "2 stages on 2 ranks" in proc.stdout + proc.stderr
    match = re.search(r"val_loss ([0-9.]+) nats/token beats the unigram baseline ([0-9.]+)", proc.stdout)
    assert match, proc.stdout[-2000:]
    val, baseline = float(match.group(1)), float(match.group(2))
    assert val < baseline - 0.3, (val, baseline)
