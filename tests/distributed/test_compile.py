"""Compiled layers (``compile=True``, issue 22 item 3): parity with one eager device, checkpoints across the switch.

One 2-rank launch runs every case (compiling dominates: the layers of all cases share Dynamo's cache and one
inductor cache directory): GPipe, 1F1B and interleaved 1F1B with accumulation and clipping, validation and predict,
recompute and offload on compiled layers, a refused split-backward schedule, and a checkpoint written compiled that
loads eager (and one written eager that loads compiled). The reference is the same module on one device, eager.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.distributed.launcher import launch_runs
from tests.distributed.parity import ATOL, assert_case_parity, assert_same
from tests.distributed.scenarios import CheckpointCase, TrainingCase

pytestmark = [pytest.mark.parity, pytest.mark.distributed]

STEP4 = "epoch=0-step=4.ckpt"
TINY = {"n_layers": 4, "steps": 3, "compile": True}
CASES = [
    TrainingCase(schedule="gpipe", acc=2, clip=0.05, optimizer="adamw", **TINY),
    TrainingCase(schedule="1f1b", acc=2, clip=0.05, predict=True, **TINY),
    TrainingCase(schedule="interleaved_1f1b", stages_per_rank=2, acc=2, clip=0.05, validate=False, **TINY),
    # recompute every layer, offload layer 1's saved tensors: both wrap the compiled call
    TrainingCase(schedule="1f1b", recompute="all", offload=[1], validate=False, **TINY),
]
REFUSED = TrainingCase(schedule="zbv", stages_per_rank=2, expect_error=True, **TINY)


@pytest.mark.timeout(900)
def test_compiled_layers_match_eager_single_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # per test: nothing from other runs
    compiled, eager = tmp_path / "compiled", tmp_path / "eager"
    ckpt = {"n_layers": 4, "steps": 8}
    runs: list[tuple[str, Any]] = [("training", c) for c in (*CASES, REFUSED)]
    runs += [("ckpt_train", CheckpointCase(compile=True, dir=str(compiled), **ckpt)),
             ("ckpt_resume", CheckpointCase(compile=False, resume_from=str(compiled / STEP4), **ckpt)),
             ("ckpt_train", CheckpointCase(compile=False, dir=str(eager), **ckpt)),
             ("ckpt_resume", CheckpointCase(compile=True, resume_from=str(eager / STEP4), **ckpt))]
    results = launch_runs(2, runs, tmp_path / "out", timeout=840)
    for i, case in enumerate(CASES):
        assert_case_parity(results, i, case)
        assert all(rank[i]["compiled_graphs"] > 0 for rank in results), "the layers ran compiled"
    refused = [rank[len(CASES)] for rank in results]
    for r in refused:
        assert not r["ok"] and "strategy.compile" in r["error"] and "'zbv'" in r["error"], r
    first = len(CASES) + 1
    for rank in results:
        trained_compiled, eager_loaded, trained_eager, compiled_loaded = (rank[first + k] for k in range(4))
        # the names are the module's own (no `_orig_mod.`), so each side loads the other's checkpoint ...
        assert not [n for n in trained_compiled["full"]["params"] if "_orig_mod" in n]
        assert sorted(eager_loaded["start_params"]) == sorted(trained_compiled["full"]["params"])
        # ... and continues from it as the other side would: same 4 steps from the same state
        assert eager_loaded["global_step"] == compiled_loaded["global_step"] == 8
        assert_same(eager_loaded["params"], trained_compiled["full"]["params"], ATOL, "compiled ckpt -> eager")
        assert_same(compiled_loaded["params"], trained_eager["full"]["params"], ATOL, "eager ckpt -> compiled")
