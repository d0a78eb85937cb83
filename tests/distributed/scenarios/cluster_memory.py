"""What a rank holds, measured, for the cluster planner's memory model (tests/distributed/test_cluster_memory.py):
the GPT recipe's model trained by the strategy, fp32 on CPU; per rank its parameter bytes, its optimizer state bytes
after the steps, and the peak of what autograd kept for backward during a step (ActivationMeter)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TypedDict

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PipelineStrategy
from lightning_pipe.trace.memory import ActivationMeter


@dataclass(frozen=True)
class ClusterMemoryCase:
    schedule: str = "1f1b"
    stages_per_rank: int = 1
    microbatches: int = 4
    partition: tuple[int, ...] = ()
    recompute: str = "none"
    mb_rows: int = 2
    n_layer: int = 4
    n_embd: int = 64
    n_head: int = 4
    seq: int = 32
    vocab: int = 256
    steps: int = 2
    expect_error: bool = False


class ClusterMemoryResult(TypedDict):
    param_bytes: int
    optimizer_bytes: int
    activation_peak: int


class _Meter(Callback):
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.meter = ActivationMeter.attach(trainer.strategy.engine)  # type: ignore[attr-defined]

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        params = trainer.strategy.engine.parameters  # type: ignore[attr-defined]
        state = [t for opt in trainer.optimizers for s in opt.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor) and t.dim() > 0]  # the moments (a step count is a scalar)
        self.params = sum(p.numel() * p.element_size() for p in params)
        self.optimizer = sum(t.numel() * t.element_size() for t in state)


def run_cluster_memory(case: ClusterMemoryCase) -> ClusterMemoryResult:
    from recipes.gpt.model import GPT

    torch.manual_seed(0)
    model = GPT(vocab_size=case.vocab, block_size=case.seq, n_layer=case.n_layer, n_head=case.n_head,
                n_embd=case.n_embd, dropout=0.0, warmup_steps=1, max_steps=100)
    batch = case.microbatches * case.mb_rows
    tokens = torch.randint(0, case.vocab, (batch * case.steps, case.seq + 1), generator=torch.Generator().manual_seed(0))
    meter = _Meter()
    strategy = PipelineStrategy(schedule=case.schedule, microbatches=case.microbatches,
                                stages_per_rank=case.stages_per_rank, recompute=case.recompute,
                                partition=list(case.partition) or "uniform")
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=int(os.environ["TEST_WORLD_SIZE"]),
                        max_steps=case.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        use_distributed_sampler=False, callbacks=[meter])
    trainer.fit(model, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch, drop_last=True))
    return ClusterMemoryResult(param_bytes=meter.params, optimizer_bytes=meter.optimizer,
                               activation_peak=meter.meter.peak_bytes)
