"""One rank of a multi-host test, started by ``torchrun`` on a test host (tests/multihost/test_hosts.py).

Trains the toy regressor with ``PipelineStrategy`` under Lightning; the case (a JSON object in ``LP_CASE``) sets the
steps, the heartbeat timeout, pauses, checkpoints and the resume. Each rank writes its progress after every step
(``progress_rank<R>``) and, at the end, its parameters and what it saw (``result_rank<R>_attempt<A>.pt``).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_pipe import PipelineStrategy
from tests.models import ToyRegressor, loader, regression_data

ROWS = 64
BATCH = 8


class Progress(pl.Callback):
    """Marks each finished step in a file; pauses a rank where the case says (a slow but live rank), or holds a
    world at a step until SIGTERM (a host joining: torchrun restarts every worker); keeps a copy
    of the checkpoint a run resumed from (``resumed_w<world>_step<S>.ckpt``: ``last`` is overwritten later)."""

    def __init__(self, out: Path, case: dict[str, Any]) -> None:
        self.out, self.case = out, case

    def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_rank == 0 and trainer.ckpt_path:
            shutil.copytree(trainer.ckpt_path, self.out / f"resumed_w{trainer.world_size}_step{trainer.global_step}"
                            ".ckpt", dirs_exist_ok=True)

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        faults = getattr(trainer.strategy, "_faults", None)
        beat = faults.watch.heartbeat if faults is not None else None
        if beat is not None:  # how long this rank's beats were apart at most (bench/lost_host.py reports it)
            print(f"longest_heartbeat_gap_s={beat.longest_gap:.2f}", flush=True)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        rank = trainer.global_rank
        (self.out / f"progress_rank{rank}").write_text(str(trainer.global_step))
        stall = self.case.get("stall")
        if stall and stall["rank"] == rank and stall["step"] == trainer.global_step:
            time.sleep(stall["seconds"])
        hold = self.case.get("hold")
        if hold and hold["world"] == trainer.world_size and hold["step"] == trainer.global_step:
            while not trainer.received_sigterm:  # until torchrun stops this worker (a host joined)
                time.sleep(0.1)
        time.sleep(self.case.get("step_sleep", 0.0))


def make_model() -> ToyRegressor:
    return ToyRegressor(n_layers=6, seed=0)


def train_loader() -> Any:
    return loader(regression_data(ROWS), BATCH)


def main() -> None:
    case = json.loads(os.environ["LP_CASE"])
    out = Path(case["out"])
    strategy = PipelineStrategy(schedule="1f1b", microbatches=4, heartbeat_timeout=case.get("heartbeat_timeout", 30))
    callbacks: list[pl.Callback] = [Progress(out, case)]
    if case.get("checkpoint_every"):
        callbacks.append(ModelCheckpoint(dirpath=out / "checkpoints", filename="{step}", save_top_k=-1,
                                         every_n_train_steps=case["checkpoint_every"], save_last=True))
    trainer = pl.Trainer(accelerator="cpu", devices=1, num_nodes=case.get("nodes", 2), strategy=strategy,
                         max_steps=case["steps"], logger=False, enable_checkpointing=bool(case.get("checkpoint_every")),
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                         callbacks=callbacks)
    model = make_model()
    trainer.fit(model, train_loader(), ckpt_path=case.get("resume"))
    topo = strategy.topology
    assert topo is not None
    torch.save({"world_size": trainer.world_size, "pipeline_size": topo.pipeline_size, "step": trainer.global_step,
                "params": {n: p.detach().clone() for n, p in model.named_parameters() if p.numel()}},
               out / f"result_w{trainer.world_size}_rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
