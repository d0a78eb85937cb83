"""The LightningCLI example: the strategy by class (``class_path`` + ``init_args`` in the YAML, an argument
overridden from the shell) and by its registered name; and a real run of the script training 2 pipeline stages on
CPU, where Lightning re-runs the script for rank 1 (``start_method="popen"``), which parses the same arguments."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys

import pytest

from tests.distributed.launcher import REPO, child_env

pytest.importorskip("jsonargparse")

SCRIPT, CONFIG = REPO / "examples" / "cli.py", REPO / "examples" / "cli_config.yaml"


def load_example():
    spec = importlib.util.spec_from_file_location("lightning_pipe_cli_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended")  # pytest's own argv is there
@pytest.mark.parametrize(("overrides", "schedule", "microbatches"), [
    ([], "1f1b", 4),  # the YAML's class_path + init_args
    (["--trainer.strategy.schedule=zbv", "--trainer.strategy.stages_per_rank=2"], "zbv", 4),  # + shell override
    (["--trainer.strategy=pipeline"], "1f1b", None),  # the registered name, defaults
])
def test_cli_builds_the_pipeline_strategy(overrides, schedule, microbatches, tmp_path) -> None:
    from lightning_pipe import PipelineStrategy

    cli = load_example().main(["--config", str(CONFIG), f"--trainer.default_root_dir={tmp_path}", *overrides],
                              run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, PipelineStrategy)
    assert (strategy.pipeline_config.schedule, strategy.pipeline_config.microbatches) == (schedule, microbatches)


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_cli_example_trains_two_stages(tmp_path) -> None:
    cmd = [sys.executable, str(SCRIPT), "fit", "--config", str(CONFIG), "--trainer.max_steps=4",
           "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false",
           "--data.max_bytes=200000", f"--trainer.default_root_dir={tmp_path}",
           "--trainer.strategy.schedule=zbv", "--trainer.strategy.stages_per_rank=2"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # rank 1 too: Lightning started it in our session
        output, _ = proc.communicate()
        pytest.fail(f"the CLI run hung:\n{output[-4000:]}")
    assert proc.returncode == 0, output[-4000:]
    assert "PipelineStrategy: schedule=zbv, microbatches=4, 4 stages on 2 ranks" in output, output[-4000:]
    assert "`Trainer.fit` stopped: `max_steps=4` reached." in output
    # the sharded checkpoint holds both ranks' shards
    shards = sorted(p.name for p in tmp_path.glob("lightning_logs/version_0/checkpoints/*.ckpt/*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"], shards
