"""[Note: lean test imports] in tests/lean_imports.py: torchmetrics' module-level checks for its optional extras
answer "not installed" in test processes; everyone else's checks are untouched."""

from __future__ import annotations

import importlib.util
import os

from lightning_utilities.core.imports import RequirementCache

from tests.distributed.launcher import REPO, child_env
from tests.lean_imports import EXTRAS, skip_torchmetrics_extras


def test_only_torchmetrics_modules_see_the_extras_missing() -> None:
    skip_torchmetrics_extras()
    skip_torchmetrics_extras()  # idempotent: one wrapper
    for name in EXTRAS:
        installed = importlib.util.find_spec(name) is not None
        check = RequirementCache(name)
        assert bool(check) == installed  # Lightning's, ours, the tests'
        assert eval("not check", {"__name__": "torchmetrics.utilities.plot", "check": check})
        assert eval("not check", {"__name__": "lightning.fabric", "check": check}) == (not installed)
    assert bool(RequirementCache("torch"))  # other packages: as installed, in torchmetrics too
    assert eval("bool(not check)", {"__name__": "torchmetrics.x", "check": RequirementCache("torch")}) is False


def test_launched_processes_install_it_at_start_up() -> None:
    paths = child_env()["PYTHONPATH"].split(os.pathsep)
    assert paths[:2] == [str(REPO), str(REPO / "tests" / "site")]
    assert (REPO / "tests" / "site" / "sitecustomize.py").read_text().count("skip_torchmetrics_extras()") == 1


def test_one_device_references_are_shared_only_between_equal_one_device_runs(monkeypatch) -> None:
    """[Note: one reference per one-device run] in tests/distributed/parity.py (no training: the run is stubbed)."""
    from tests.distributed import parity
    from tests.distributed.scenarios.training import TrainingCase

    runs: list[TrainingCase] = []
    monkeypatch.setattr(parity, "_REFERENCES", {})
    monkeypatch.setattr(parity, "run_training", lambda case, pipeline: runs.append(case) or {"case": case})
    base = TrainingCase(model="tp", acc=2, clip=0.05, optimizer="adamw")
    same = [base, TrainingCase(model="tp", acc=2, clip=0.05, optimizer="adamw", schedule="zbv", stages_per_rank=2,
                               tp=2, recompute="all", schedule_options={"x": 1}, check_grad_norms=False)]
    other = [TrainingCase(model="tp", acc=1, clip=0.05, optimizer="adamw"), TrainingCase(acc=2, clip=0.05,
             optimizer="adamw"), TrainingCase(model="tp", acc=2, clip=0.05, optimizer="adamw", batch=16)]
    for case in same + other:
        parity.reference(case)
    assert len(runs) == 1 + len(other) and runs[0].schedule == "1f1b" and runs[0].tp == 1
    # data parallel 2 x batch 8 is one device's batch 16: the same run as the last case
    assert parity.reference(TrainingCase(model="tp", acc=2, clip=0.05, optimizer="adamw", dp=2)) == {"case": runs[-1]}
    assert len(runs) == 1 + len(other)
