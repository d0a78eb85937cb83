"""Train the bundled GPT through LightningCLI with the pipeline strategy (no Hydra).

    python examples/cli.py fit --config examples/cli_config.yaml
    python examples/cli.py fit --config examples/cli_config.yaml --trainer.strategy.schedule=zbv \
        --trainer.strategy.stages_per_rank=2
    python examples/cli.py fit --config examples/cli_config.yaml --trainer.strategy=pipeline   # the registered name

The YAML names the strategy by class (``class_path: lightning_pipe.PipelineStrategy`` with ``init_args``); every
``PipelineStrategy`` argument is then settable from the shell as ``--trainer.strategy.<argument>``. Each rank re-runs
this script with the same arguments (the default ``start_method="popen"``), so it parses the same configuration.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `recipes` imports from a checkout

import lightning_pipe  # noqa: F401  (registers strategy="pipeline" before the Trainer is built)
from recipes.gpt.data import ByteCorpusDataModule
from recipes.gpt.model import GPT


def main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    return LightningCLI(GPT, ByteCorpusDataModule, args=args, run=run, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
