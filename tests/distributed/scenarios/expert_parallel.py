"""The Llama recipe with routed experts under expert parallelism (tests/distributed/test_expert_parallel.py) and its one-device
reference.

The pipeline side shards every MoE layer's experts over the data-parallel replicas (``expert_parallel_size``); the
reference is the same module on one process, SGD, every (replica, micro-batch) chunk of each global batch run as
its own forward with gradient accumulation (``compute_loss`` per chunk, divided by their number): exactly what the
pipeline's micro-batches and replicas compute, router balance terms included (each is a per-chunk mean).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, TypedDict

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_pipe import PipelineStrategy
from tests.distributed.scenarios.training import token_data
from tests.models import reference_train_loader

LR, BATCH, MICROBATCHES, N_DATA = 0.5, 4, 4, 64  # BATCH: per replica


@dataclass(frozen=True)
class ExpertCase:
    schedule: str = "1f1b"
    stages_per_rank: int | None = None
    dp: int = 2
    ep: int = 2
    steps: int = 3
    aux_coef: float = 0.0
    shared_expert: bool = False
    save: str | None = None  # after fit: trainer.save_checkpoint(save)
    resume: str | None = None  # fit(ckpt_path=resume); the params loaded are returned as start_params
    expect_error: bool = False
    experts: int = 4  # routed experts per block; 0: a dense Llama (nothing for expert_parallel_size to shard)


class ExpertResult(TypedDict):
    params: dict[str, torch.Tensor]  # this rank's parameters, global names
    start_params: dict[str, torch.Tensor]
    losses: list[float]
    load_max: list[float]  # the logged moe_load_max per step


def moe_llama(case: ExpertCase) -> L.LightningModule:
    """4 blocks of 4 routed experts (top-2) between the embedding and the head: 7 layers."""
    from recipes.llama.model import Llama

    class SgdLlama(Llama):
        def configure_optimizers(self) -> Any:
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=LR)

    return SgdLlama(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_kv_head=2, n_embd=32, multiple_of=16,
                    moe_experts=case.experts, moe_top_k=2, moe_shared_expert=case.shared_expert, moe_aux_coef=case.aux_coef)


class _Record(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.load_max: list[float] = []
        self.start: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.start = {n: p.detach().clone() for n, p in module.named_parameters()}

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))
        self.load_max.append(float(trainer.callback_metrics["moe_load_max"]))


def run_expert_parallel(case: ExpertCase) -> ExpertResult:
    """The scenario a launched rank runs."""
    module = moe_llama(case)
    record = _Record()
    strategy = PipelineStrategy(schedule=case.schedule, microbatches=MICROBATCHES, stages_per_rank=case.stages_per_rank,
                                data_parallel_size=case.dp, expert_parallel_size=case.ep)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=int(os.environ["TEST_WORLD_SIZE"]),
                        max_steps=case.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[record])
    trainer.fit(module, DataLoader(token_data(N_DATA), batch_size=BATCH, shuffle=True, drop_last=True),
                ckpt_path=case.resume)
    if case.save is not None:
        trainer.save_checkpoint(case.save)
    return ExpertResult(params={n: p.detach().clone() for n, p in module.named_parameters()},
                     start_params=record.start, losses=record.losses, load_max=record.load_max)


def run_reference(case: ExpertCase) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process: each global batch (all replicas' rows) cut into the pipeline's (replica, micro-batch) chunks."""
    module = moe_llama(case)
    module.configure_model()
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    losses: list[float] = []
    chunks = case.dp * MICROBATCHES
    for _, (x, y) in zip(range(case.steps), reference_train_loader(token_data(N_DATA), BATCH * case.dp)):
        optimizer.zero_grad()
        total = 0.0
        for r in range(case.dp):  # DistributedSampler: replica r reads rows r, r + dp, ...
            xr, yr = x[r::case.dp], y[r::case.dp]
            for xm, ym in zip(xr.chunk(MICROBATCHES), yr.chunk(MICROBATCHES)):
                loss = module.compute_loss((xm, ym)) / chunks
                loss.backward()
                total += float(loss.detach())
        optimizer.step()
        losses.append(total)
    return {n: p.detach().clone() for n, p in module.named_parameters()}, losses
