"""The Llama-style recipe from the shell, as a user runs it: 2 pipeline stages on 2 CPU processes through the GPT
recipe's Hydra entry point (``experiment=llama_tiny_cpu``); its validation loss must beat the unigram baseline."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.recipes.test_gpt_recipe import metrics, run_train


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


@pytest.mark.distributed
@pytest.mark.timeout(700)
def test_llama_moe_trains_below_the_unigram_baseline_and_logs_expert_load(tmp_path: Path) -> None:
    """``experiment=llama_moe_tiny_cpu`` (routed experts top-2 + a shared one, the router balance loss), shortened:
    4 experts instead of 8 and 80 steps on 1 MB (the full experiment: docs/moe.md)."""
    proc = run_train(["experiment=llama_moe_tiny_cpu", "model.moe_experts=4", "trainer.max_steps=80",
                      "trainer.val_check_interval=80", "trainer.limit_val_batches=8", "data.max_bytes=1000000",
                      "model.lr=3e-3", "model.warmup_steps=10", "logger=csv", "trainer.enable_progress_bar=false",
                      f"hydra.run.dir={tmp_path / 'run'}"], 650)
    match = re.search(r"val_loss ([0-9.]+) nats/token beats the unigram baseline ([0-9.]+)", proc.stdout)
    assert match, proc.stdout[-2000:]
    val, baseline = float(match.group(1)), float(match.group(2))
    assert val < baseline, (val, baseline)
    rows = metrics(tmp_path / "run")
    loads = [float(r["moe_load_max"]) for r in rows if r.get("moe_load_max")]
    aux = [float(r["train_aux_loss"]) for r in rows if r.get("train_aux_loss")]
    assert loads and all(1.0 <= v <= 4.0 for v in loads), loads  # the busiest expert's share over the mean share
    assert aux and all(v > 0 for v in aux)
    assert {f"moe/layer{i}_expert{e}" for i in range(1, 5) for e in range(4)} <= set(rows[0])
