"""Run at start-up by every process whose ``PYTHONPATH`` holds this folder (``tests.distributed.launcher.child_env``):
[Note: lean test imports] in ``tests/lean_imports.py``."""

from tests.lean_imports import skip_torchmetrics_extras

skip_torchmetrics_extras()
