"""Test processes import Lightning without torchmetrics' optional extras: [Note: lean test imports].

[Note: lean test imports]
Every launched rank, recipe run and GPU-check child imports Lightning, which imports torchmetrics, which imports
at import time whatever optional package it finds installed: ``transformers`` (for BERTScore, through
``AutoModel``) and ``matplotlib.pyplot`` (for ``Metric.plot``). Measured under ``python -X importtime``: a third of
``import lightning_pipe`` (16 of 48 s on the loaded 2-core machine; 7.8 -> 6.3 s CPU per process with transformers
alone skipped), paid by each of the suite's ~120 processes. No test uses torchmetrics' text metrics or plots, so
torchmetrics' own availability checks (``RequirementCache`` objects, evaluated in its modules) answer "not installed"
for these packages in test processes. Everything else sees them as they are: Lightning's own checks, and
``lightning_pipe.hf`` / the tests, which import ``transformers`` directly.

Installed by ``tests/conftest.py`` (the pytest process) and ``tests/site/sitecustomize.py`` (every process started
with ``tests.distributed.launcher.child_env``'s ``PYTHONPATH``).
"""

from __future__ import annotations

import re
import sys
from typing import Any

EXTRAS = ("transformers", "matplotlib", "scienceplots")


def skip_torchmetrics_extras() -> None:
    """Make torchmetrics' module-level checks for ``EXTRAS`` false in this process (idempotent)."""
    from lightning_utilities.core.imports import RequirementCache

    if getattr(RequirementCache, "_lean_test_imports", False):
        return
    original = RequirementCache.__bool__

    def __bool__(self: Any) -> bool:
        name = re.split(r"[<>=!~;\[ ]", str(getattr(self, "requirement", "")), maxsplit=1)[0]
        if name in EXTRAS and sys._getframe(1).f_globals.get("__name__", "").startswith("torchmetrics"):
            return False
        return original(self)

    RequirementCache.__bool__ = __bool__  # type: ignore[method-assign]
    RequirementCache._lean_test_imports = True  # type: ignore[attr-defined]
