"""The GPT recipe on a real SLURM: Debian's slurm-wlm started on this machine by a fixture (tests/distributed/slurm.py),
jobs submitted with the recipe's own batch script (recipes/gpt/slurm/train.sbatch), two srun tasks = two pipeline
stages under Lightning's SLURMEnvironment.

* a job trains to the parameters and val_loss of the same run launched without SLURM;
* SIGUSR1 (``scancel --signal=USR1``, what ``--signal=USR1@90`` sends before the time limit) saves Lightning's
  ``hpc_ckpt_1.ckpt`` at a step boundary and requeues the job; the requeued job resumes from it and ends with the
  parameters of an uninterrupted run;
* ``scancel`` ends every task at the next step boundary, leaving no process.

The cluster starts once for the module; a machine without root or without slurm-wlm/munge skips with the reason.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lightning_pipe.checkpoint import consolidated
from tests.distributed.launcher import REPO, _free_port, child_env
from tests.distributed.slurm import REQUEUE_WAIT_S, SlurmCluster, slurm_cluster, unavailable

UNAVAILABLE = unavailable()
pytestmark = [pytest.mark.slurm, pytest.mark.distributed,
              pytest.mark.skipif(UNAVAILABLE is not None, reason=f"private SLURM cluster: {UNAVAILABLE}")]

SBATCH = REPO / "recipes" / "gpt" / "slurm" / "train.sbatch"
STEPS = 24
RECIPE = [
    f"trainer.max_steps={STEPS}", "trainer.val_check_interval=6", "trainer.limit_val_batches=2",
    "data.max_bytes=200000", "data.batch_size=4", "schedule.microbatches=2", "model.block_size=32",
    "model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.warmup_steps=2", "logger=csv",
    "trainer.enable_progress_bar=false",
]
PAUSE = "+callbacks.pause._target_=tests.distributed.slurm_pause.PauseForSignal"
JOB_TIMEOUT_S = 120.0


@dataclass
class Run:
    directory: Path
    log: str

    def parameters(self) -> dict[str, torch.Tensor]:
        last = consolidated(self.directory / "checkpoints" / "last.ckpt")
        assert last["global_step"] == STEPS, f"last.ckpt is at step {last['global_step']}"
        return last["state_dict"]

    def val_loss(self) -> float:
        found = re.findall(r"\[train\] corpus \d+ bytes \| val_loss (\d+\.\d+)", self.log)
        assert found, f"no final val_loss in the log:\n{self.log[-3000:]}"
        return float(found[-1])


@pytest.fixture(scope="module")
def started_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as started:
        yield started


@pytest.fixture
def cluster(started_cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    """The module's cluster, its queue emptied after the test (a failed test's job must not hold the node)."""
    yield started_cluster
    started_cluster.cancel_all()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The same training launched without SLURM (Lightning's launcher starts rank 1)."""
    directory = tmp_path_factory.mktemp("reference") / "run"
    proc = subprocess.run([sys.executable, str(REPO / "recipes" / "gpt" / "train.py"), "trainer=cpu_2", *RECIPE,
                           f"run_dir={directory}"], cwd=REPO, env=child_env(), capture_output=True, text=True,
                          timeout=JOB_TIMEOUT_S)
    assert proc.returncode == 0, f"reference run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "cluster environment LightningEnvironment" in proc.stdout
    return Run(directory, proc.stdout)


def submit(cluster: SlurmCluster, tmp_path: Path, *overrides: str) -> tuple[int, Path, Path]:
    """The recipe's batch script with the test's settings; (job id, run directory, job log)."""
    run_dir, log = tmp_path / "run", tmp_path / "job.log"
    env = child_env(PYTHON=sys.executable, RUN_DIR=str(run_dir), MASTER_PORT=str(_free_port()))
    job = cluster.sbatch(SBATCH, *RECIPE, *overrides, options=(f"--output={log}", f"--chdir={REPO}"), env=env)
    return job, run_dir, log


def wait_for_files(paths: list[Path], cluster: SlurmCluster, job: int, timeout: float = JOB_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        state = cluster.job(job).get("JobState")
        assert state in ("PENDING", "RUNNING"), f"job {job} is {state} before {[p.name for p in paths]} appeared"
        assert time.monotonic() < deadline, f"{[p.name for p in paths]} not written within {timeout:.0f} s"
        time.sleep(0.1)


def assert_same_parameters(got: Run, want: Run) -> float:
    """Every parameter equal (fp32); the largest absolute difference."""
    mine, theirs = got.parameters(), want.parameters()
    assert sorted(mine) == sorted(theirs) and mine
    diffs = {name: float((mine[name] - value).abs().max()) for name, value in theirs.items()}
    for name, value in theirs.items():
        torch.testing.assert_close(mine[name], value, rtol=0, atol=1e-6, msg=f"{name}; all differences: {diffs}")
    return max(diffs.values())


@pytest.mark.timeout(300)
def test_sbatch_runs_the_recipe_under_slurm_environment_like_a_plain_launch(
        cluster: SlurmCluster, reference: Run, tmp_path: Path) -> None:
    job, run_dir, log = submit(cluster, tmp_path)
    fields = cluster.wait_job(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, JOB_TIMEOUT_S)
    text = log.read_text()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), text[-3000:]
    # Rank 0 names the cluster environment Lightning picked; every rank armed the requeue handler.
    assert "[train] processes: 2, cluster environment SLURMEnvironment (auto_requeue=True)" in text
    assert text.count("SLURM auto-requeueing enabled") >= 2
    run = Run(run_dir, text)
    assert run.val_loss() == reference.val_loss()
    diff = assert_same_parameters(run, reference)
    print(f"sbatch vs plain launch: val_loss {run.val_loss()} both, largest parameter difference {diff:.1e}")


@pytest.mark.timeout(300)
def test_usr1_requeues_and_the_requeued_job_resumes_exactly(
        cluster: SlurmCluster, reference: Run, tmp_path: Path) -> None:
    pause_step = 4
    job, run_dir, log = submit(cluster, tmp_path, PAUSE, f"+callbacks.pause.directory={tmp_path}",
                               f"+callbacks.pause.step={pause_step}")
    wait_for_files([tmp_path / "paused.0", tmp_path / "paused.1"], cluster, job)
    signalled = time.monotonic()
    cluster.command("scancel", "--signal=USR1", str(job))
    cluster.wait_job(job, {"PENDING"}, 60, poll=0.05)
    requeued = time.monotonic()
    cluster.wait_job(job, {"RUNNING", "COMPLETED", "FAILED"}, 60, poll=0.05)
    restarted = time.monotonic()
    while "Restored all states from the checkpoint" not in log.read_text() and time.monotonic() - restarted < 60:
        time.sleep(0.05)
    resumed = time.monotonic()
    fields = cluster.wait_job(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, JOB_TIMEOUT_S)
    text = log.read_text()
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "1"), text[-3000:]

    first, second = text.split(f"job {job} start 2", 1)
    assert "Handling auto-requeue signal" in first and f"requeing job {job}" in first
    # The requeue ends the first start with SIGTERM: every rank stopped together at a step boundary.
    assert "lightning_pipe: SIGTERM received: every rank stops together" in first
    hpc = run_dir / "hpc_ckpt_1.ckpt"
    assert f"Restoring states from the checkpoint path at {hpc}" in second
    saved_at = consolidated(hpc)["global_step"]
    assert saved_at == pause_step + 1 < STEPS  # the first step boundary after the signal, mid-run
    run = Run(run_dir, text)
    assert run.val_loss() == reference.val_loss()
    diff = assert_same_parameters(run, reference)
    print(f"USR1 -> first start ended, job pending: {requeued - signalled:.1f} s; -> running again: "
          f"{restarted - signalled:.1f} s (a requeued job waits cred_expire={REQUEUE_WAIT_S} s); -> state restored: "
          f"{resumed - signalled:.1f} s; hpc_ckpt_1 at step {saved_at}; largest parameter difference to an "
          f"uninterrupted run {diff:.1e}")


@pytest.mark.timeout(300)
def test_scancel_ends_every_task_at_a_step_boundary(cluster: SlurmCluster, tmp_path: Path) -> None:
    job, run_dir, log = submit(cluster, tmp_path, "trainer.max_steps=100000", PAUSE,
                               f"+callbacks.pause.directory={tmp_path}", "+callbacks.pause.step=3",
                               "+callbacks.pause.signal_name=SIGTERM")
    wait_for_files([tmp_path / "paused.0", tmp_path / "paused.1"], cluster, job)
    tasks = [cmd for cmd in cluster.leftovers().values() if "recipes/gpt/train.py" in cmd and "srun" not in cmd]
    assert len(tasks) == 2, tasks
    cancelled = time.monotonic()
    cluster.command("scancel", str(job))
    while cluster.leftovers() and time.monotonic() - cancelled < 60:
        time.sleep(0.1)
    gone = time.monotonic()
    assert not cluster.leftovers(), f"left after 60 s: {cluster.leftovers()}"
    fields = cluster.wait_job(job, {"CANCELLED"}, 10)
    text = log.read_text()
    assert "lightning_pipe: SIGTERM received: every rank stops together" in text, text[-3000:]
    assert re.search(r"saved \S+last\.ckpt at global step 4 after SIGTERM", text), text[-3000:]
    assert "Traceback" not in text, text[-5000:]
    assert cluster.task_ends(f"{job}.0") == {0: "exit code 0", 1: "exit code 0"}  # neither killed by SIGKILL
    print(f"scancel -> every process of job {job} gone after {gone - cancelled:.1f} s ({fields['JobState']}); "
          f"last.ckpt at step 4")
