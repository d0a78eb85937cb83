"""A user's training script for fault tests, run the way users run it: ``python fault_script.py OUT MODE OPTIONS``.

Lightning's popen launcher re-runs this script for rank 1, so the main process is rank 0 — the process SLURM or
Kubernetes signals. Each rank writes ``pid<rank>`` at start and ``step<rank>`` (the global step) after every batch.
Modes:

* ``train``: train until stopped (SIGTERM tests), with ``ModelCheckpoint(save_last=True)`` when ``ckpt`` is set;
  ``resume`` continues from ``ckpt_path="last"`` up to ``max_steps`` and writes ``start<rank>`` / ``resumed<rank>``
  (the global step at the start and at the end);
* ``fail``: the layer of rank ``fail_rank`` raises at its forward call ``fail_at``; the script *catches* the error and
  sleeps 90 s, as a notebook or a script that handles errors would keep the process alive;
* ``save_one_rank``: the DDP habit ``if trainer.is_global_zero: trainer.save_checkpoint(...)`` (issue 45): after
  ``fit`` when ``then`` is ``"end"`` (the script ends there) or ``"test"`` (every rank goes on to ``trainer.test``),
  or from a callback during ``fit`` (``then="in_fit"``); each rank writes ``error<rank>`` with what it raised;
* ``crash``: rank ``fail_rank`` raises at ``fail_in`` (``"configure_optimizers"`` at setup, ``"save"``: its
  checkpoint write fails as on a read-only file system, ``"forward"``: its layer's forward call ``fail_at``) and its
  process *ends*, closing its sockets: the other rank's transfer fails with gloo's own error, to which it must add
  the cause. ``on_exception_ckpt``: an ``OnExceptionCheckpoint`` too (no rank may try its collective save).

Also the harness the tests and the sigterm benchmark (``bench/sigterm.py``) share: start the script, wait for a step, time every rank's exit.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve()


# --------------------------------------------------------------------------------------------- the training script
def main(out: Path, mode: str, opts: dict[str, Any]) -> None:
    import lightning.pytorch as L
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pipe import PipelineModule, PipelineStrategy

    if opts.get("without_faults"):  # the behaviour before lightning_pipe.lightning.faults, for comparison
        from lightning_pipe.lightning.faults import PipelineFaults
        PipelineFaults.start = classmethod(lambda cls, strategy: None)  # type: ignore[method-assign]
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    busy = bool(opts.get("busy"))
    crash_here = mode == "crash" and rank == opts.get("fail_rank")
    if crash_here and opts.get("fail_in") == "save":
        import errno

        from lightning_pipe.checkpoint import files

        def read_only(state: Any, tmp: Path, no_dist: bool = False) -> Any:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp))

        files.write_shards = read_only  # type: ignore[assignment]
    (out / f"pid{rank}").write_text(str(os.getpid()))

    class SlowLayer(nn.Module):
        """A layer that takes ``delay`` seconds per micro-batch (so a signal lands inside a step) and can fail."""

        def __init__(self, delay: float, fail_at: int | None) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 16)
            self.delay, self.fail_at, self.calls = delay, fail_at, 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.training:
                self.calls += 1
                if self.fail_at is not None and self.calls == self.fail_at:
                    raise RuntimeError(f"injected failure in a layer's forward (call {self.calls})")
            if busy:  # compute-bound like a real layer (time.sleep would let signal handlers run at once)
                end, w = time.perf_counter() + self.delay, torch.randn(64, 64)
                while time.perf_counter() < end:
                    w = torch.tanh(w @ w)
            else:
                time.sleep(self.delay)
            return torch.tanh(self.fc(x))

    class Model(PipelineModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            fails = mode == "fail" or (mode == "crash" and opts.get("fail_in") == "forward")
            fail_layer = {0: 0, 1: 3}.get(opts.get("fail_rank", -1)) if fails else None
            self.layers = nn.Sequential(*[SlowLayer(opts.get("delay", 0.01), opts.get("fail_at", 3)
                                                    if i == fail_layer else None) for i in range(4)])

        def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(output, target)

        def configure_optimizers(self) -> Any:
            if crash_here and opts.get("fail_in") == "configure_optimizers":
                raise ValueError(f"injected failure in configure_optimizers on rank {rank}")
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Progress(Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            (out / f"step{rank}").write_text(str(trainer.global_step))
            if mode == "save_one_rank" and opts.get("then") == "in_fit" and trainer.global_step == 3:
                if trainer.is_global_zero:
                    (out / "saving").write_text("")
                    trainer.save_checkpoint(out / "manual.ckpt")

        def on_train_start(self, trainer: Any, *args: Any) -> None:
            (out / f"start{rank}").write_text(str(trainer.global_step))

        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
            mark("stopping")  # wall-clock marks: where the time from signal to exit goes

    def mark(event: str) -> None:
        with open(out / f"times{rank}", "a") as f:
            f.write(f"{event} {time.time():.3f}\n")

    atexit.register(mark, "exit")

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 16, generator=g))
    loader = DataLoader(data, batch_size=8, drop_last=True)
    callbacks: list[Any] = [Progress()]
    if opts.get("ckpt"):
        callbacks.append(ModelCheckpoint(dirpath=out / "ckpt", save_last=True,
                                         every_n_train_steps=opts.get("ckpt_every", 10)))
    if opts.get("on_exception_ckpt"):
        callbacks.append(OnExceptionCheckpoint(dirpath=out / "on_exception"))
    max_steps = opts.get("max_steps", 100_000)
    trainer = L.Trainer(strategy=PipelineStrategy(microbatches=4), accelerator="cpu", devices=2, max_steps=max_steps,
                        callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        val_check_interval=opts.get("val_every", 7), limit_val_batches=3, num_sanity_val_steps=0)
    model = Model()
    if mode == "resume":
        trainer.fit(model, loader, loader, ckpt_path="last")  # Lightning finds ckpt/last.ckpt (a directory here)
        (out / f"resumed{rank}").write_text(str(trainer.global_step))
        return
    if mode == "save_one_rank":
        save_on_rank_zero_only(trainer, model, loader, out, rank, opts.get("then", "end"))
        return
    try:
        trainer.fit(model, loader, loader)
    except Exception as err:
        if mode != "fail":
            raise
        print(f"rank {rank}: caught {type(err).__name__}: {err}; staying alive", flush=True)
        (out / f"caught{rank}").write_text(repr(err))
        time.sleep(90)


def save_on_rank_zero_only(trainer: Any, model: Any, loader: Any, out: Path, rank: int, then: str) -> None:
    """``save_one_rank``: what each rank raised goes to ``error<rank>`` (and is raised again: the exit code says)."""
    try:
        trainer.fit(model, loader, loader)
        if trainer.is_global_zero:
            (out / "saving").write_text("")
            trainer.save_checkpoint(out / "manual.ckpt")
        if then == "test":
            trainer.test(model, loader)
    except Exception as err:
        (out / f"error{rank}").write_text(f"{type(err).__name__}: {err}")
        raise
    (out / f"done{rank}").write_text("")


# ---------------------------------------------------------------------------------------------------- the harness
def start(out: Path, mode: str, **opts: Any) -> subprocess.Popen:
    """Start the script (rank 0; it launches rank 1) in its own session; output in ``out/log``."""
    out.mkdir(parents=True, exist_ok=True)
    from tests.distributed.launcher import child_env

    env = child_env()
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        env.pop(key, None)  # the script is the main process: Lightning launches the other rank itself
    log = open(out / "log", "w")
    return subprocess.Popen([sys.executable, str(SCRIPT), str(out), mode, json.dumps(opts)], cwd=out, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def read_int(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def wait_for_step(out: Path, proc: subprocess.Popen, step: int, timeout: float = 120.0) -> None:
    """Until rank 0 finished global step ``step`` (fails with the log if the script ends or stalls first)."""
    deadline = time.monotonic() + timeout
    while (read_int(out / "step0") or 0) < step:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the script did not reach step {step} (exit {proc.poll()}):\n{log_tail(out)}")
        time.sleep(0.02)


def last_checkpoint_step(out: Path) -> int | None:
    """The global step stored in ``ckpt/last.ckpt`` (a sharded directory; present only once complete)."""
    import torch

    meta = out / "ckpt" / "last.ckpt" / "meta.pt"
    return int(torch.load(meta, weights_only=False)["global_step"]) if meta.exists() else None


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie — exited, not yet reaped — counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def time_to_exit(out: Path, proc: subprocess.Popen, since: float, timeout: float) -> tuple[float, dict[int, Any]]:
    """Seconds from ``since`` until both ranks ended (or ``timeout``: then inf); and each rank's exit code where known
    (rank 0's from here; rank 1 is the script's child, so only whether it ended)."""
    pids = {rank: read_int(out / f"pid{rank}") for rank in (0, 1)}
    while time.monotonic() - since < timeout:
        proc.poll()
        if proc.returncode is not None and not any(pid is not None and alive(pid) for pid in pids.values()):
            return time.monotonic() - since, {0: proc.returncode, 1: "ended"}
        time.sleep(0.02)
    return float("inf"), {0: proc.poll(), 1: "ended" if not alive(pids[1] or -1) else "running"}


def cleanup(proc: subprocess.Popen) -> None:
    """End whatever is left of the script's session (both ranks share it)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def log_tail(out: Path, lines: int = 40) -> str:
    path = out / "log"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]) if len(sys.argv) > 3 else {})
