"""Frozen layers and stages with nothing to train (issue 23): a LoRA Llama through ``HFCausalLM``, PEFT-style.

The model: a tiny transformers Llama (3 decoder layers: 6 pipeline layers ``[embed, d0, d1, d2, norm, head]``), the
whole base frozen, hand-written LoRA adapters (``lora_a``, ``lora_b``) on the attention's q and v projections of
the decoder layers ``case.lora_layers``, and the optimizer built over ``requires_grad`` parameters only, so a stage
holding only frozen layers (the norm and head, the embedding, adapter-less decoder layers) has nothing to train.
The reference is the same LightningModule on one process with Lightning's own loop, the global batch in the order
Lightning's DistributedSampler gives the replicas.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, TypedDict

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader
from typing_extensions import NotRequired

from lightning_pipe import HFCausalLM, PipelinePrecision, PipelineStrategy
from tests.distributed.scenarios.hf import COMMON, SEED, padded_data
from tests.distributed.scenarios.training import full_tensor
from tests.models import SameOrderAsDistributedSampler

RANK = 4


class LoRALinear(nn.Linear):
    """``nn.Linear`` plus a low-rank update ``x A^T B^T`` (scaled), under the linear's own names (``q_proj.weight``
    stays; ``q_proj.lora_a`` / ``q_proj.lora_b`` are added): the class of an existing linear is switched in place."""

    lora_a: nn.Parameter
    lora_b: nn.Parameter

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) + (x @ self.lora_a.t()) @ self.lora_b.t() * 2.0

    @classmethod
    def adapt(cls, linear: nn.Linear, generator: torch.Generator) -> None:
        linear.__class__ = cls
        # lora_b non-zero from the start (PEFT zeroes it), so every adapter weight gets a gradient at step 1
        linear.lora_a = nn.Parameter(torch.randn(RANK, linear.in_features, generator=generator) * 0.1)
        linear.lora_b = nn.Parameter(torch.randn(linear.out_features, RANK, generator=generator) * 0.1)


@dataclass(frozen=True)
class FrozenCase:
    schedule: str = "gpipe"
    dp: int = 1
    fsdp: int = 1
    stages_per_rank: int | None = None
    partition: list[int] | str = field(default_factory=lambda: [2, 1, 1, 2])
    lora_layers: tuple[int, ...] = (0, 1, 2)  # decoder layers with adapters
    # "trainable": AdamW over requires_grad params; "all": AdamW over every parameter; "groups": two param groups
    # (adapters of decoder 0, the other adapters) with their own lr, empty on the ranks without such layers;
    # "sgd": SGD over requires_grad params (it moves by the clipped gradient itself: clipping shows);
    # "none_if_empty": like "trainable", but None (no optimizer, no scheduler) where the list would be empty
    optimizer: str = "trainable"
    scheduler: bool = False  # a StepLR halving the lr every optimizer step
    clip: float | None = None
    clip_algo: str = "norm"
    precision: str = "32-true"
    microbatches: int = 4
    acc: int = 1  # accumulate_grad_batches
    steps: int = 3
    batch: int = 8
    n_data: int = 32
    lr: float = 1e-2
    # checkpoints: ``save`` writes ``<ckpt>/end.ckpt`` (a sharded directory) after the last step; ``resume`` fits from
    # it (a ModelCheckpoint save after the last batch resumes exactly in Lightning; trainer.save_checkpoint after
    # fit replays the epoch's data from its start, on one device too)
    ckpt: str | None = None
    save: bool = False
    resume: bool = False
    tail: bool = False  # a parameter-free last layer (logits x 0.5): partition it alone and a stage holds nothing
    # rebalancing: the head sleeps this long per call, so layers move towards the first stage
    slow_head_s: float = 0.0
    rebalance_every: int | None = None
    expect_error: bool = False


class FrozenResult(TypedDict):
    params: dict[str, Tensor]  # this rank's parameters under the module's names
    frozen_changed: list[str]  # frozen parameters whose value moved (must stay empty)
    trainable: int  # trainable parameters on this rank
    losses: list[float]
    lrs: list[float]
    topology: NotRequired[tuple[int, int]]
    moves: NotRequired[list[tuple[int, int, int]]]  # rebalancing: (layer, from stage, to stage)


class LoRALlama(HFCausalLM):
    def __init__(self, case: FrozenCase) -> None:
        from transformers import AutoModelForCausalLM, LlamaConfig

        torch.manual_seed(SEED)
        config = LlamaConfig(**{**COMMON, "num_hidden_layers": 3})
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        super().__init__(model)
        self.case = case
        self.requires_grad_(False)
        g = torch.Generator().manual_seed(SEED + 1)
        for i in case.lora_layers:
            attn = self.layers[1 + i].block.self_attn
            for name in ("q_proj", "v_proj"):
                LoRALinear.adapt(getattr(attn, name), g)
        if case.tail:
            self.layers.append(_Halve())
        if case.slow_head_s:
            self.layers[-1].register_forward_pre_hook(_Sleep(case.slow_head_s))

    def configure_optimizers(self) -> Any:
        case = self.case
        if case.optimizer == "trainable":
            optimizer = torch.optim.AdamW((p for p in self.parameters() if p.requires_grad), lr=case.lr)
        elif case.optimizer == "all":
            optimizer = torch.optim.AdamW(self.parameters(), lr=case.lr)
        elif case.optimizer == "groups":
            first = [p for n, p in self.named_parameters() if "lora" in n and n.startswith("layers.1.")]
            rest = [p for n, p in self.named_parameters() if "lora" in n and not n.startswith("layers.1.")]
            optimizer = torch.optim.AdamW([{"params": first, "lr": case.lr / 2}, {"params": rest}], lr=case.lr)
        elif case.optimizer == "none_if_empty":
            params = [p for p in self.parameters() if p.requires_grad]
            if not params:
                return None
            optimizer = torch.optim.AdamW(params, lr=case.lr)
        elif case.optimizer == "sgd":
            optimizer = torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=case.lr)
        else:
            raise ValueError(case.optimizer)
        if not case.scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class _Halve(nn.Module):
    def forward(self, logits: Tensor) -> Tensor:
        return logits * 0.5


class _Sleep:
    """A forward pre-hook that pauses (picklable: a layer with it can move between ranks)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, *args: Any) -> None:
        time.sleep(self.seconds)


class _Record(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.lrs: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))
        self.lrs.append(float(trainer.optimizers[0].param_groups[-1]["lr"]))


def run_frozen(case: FrozenCase, pipeline: bool = True) -> FrozenResult:
    if not pipeline:  # the reference trains the case's steps straight through
        case = replace(case, ckpt=None, save=False, resume=False, slow_head_s=0.0, rebalance_every=None)
    module = LoRALlama(case)
    initial = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
    data = padded_data(case.n_data)
    record = _Record()
    precision: dict[str, Any] = {"precision": case.precision}
    if pipeline:
        strategy: Any = PipelineStrategy(schedule=case.schedule, microbatches=case.microbatches,
                                         data_parallel_size=case.dp, fsdp_size=case.fsdp, partition=case.partition,
                                         stages_per_rank=case.stages_per_rank,
                                         rebalance_every_n_steps=case.rebalance_every, rebalance_threshold=0.15)
        devices = int(os.environ["TEST_WORLD_SIZE"])
        train = DataLoader(data, batch_size=case.batch, shuffle=False, drop_last=True)
        if case.precision == "16-mixed":
            precision = {"plugins": [PipelinePrecision("16-mixed", device="cpu", init_scale=2.0**8)]}
    else:
        from lightning.pytorch.plugins.precision import MixedPrecision

        strategy, devices = "auto", 1
        batch = case.batch * case.dp * case.fsdp
        train = DataLoader(data, batch_size=batch, sampler=SameOrderAsDistributedSampler(len(data)), drop_last=True)
        if case.precision == "16-mixed":
            precision = {"plugins": [MixedPrecision("16-mixed", "cpu",
                                                    scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8))]}
    saver = [ModelCheckpoint(dirpath=case.ckpt, filename="end", every_n_train_steps=case.steps)] if case.save else []
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=case.steps, logger=False,
                        enable_checkpointing=case.save, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, accumulate_grad_batches=case.acc, gradient_clip_val=case.clip,
                        gradient_clip_algorithm=case.clip_algo, callbacks=[record, *saver], **precision)
    trainer.fit(module, train, ckpt_path=f"{case.ckpt}/end.ckpt" if case.resume else None)
    params = {n: full_tensor(p) for n, p in module.named_parameters()}
    changed = [n for n, p in params.items() if n in initial and not torch.equal(p, initial[n])]
    out = FrozenResult(params=params, frozen_changed=changed,
                       trainable=sum(p.requires_grad for p in module.parameters()),
                       losses=record.losses, lrs=record.lrs)
    if pipeline:
        topo = trainer.strategy.topology  # type: ignore[attr-defined]
        out["topology"] = (topo.dp_rank, topo.pp_rank)
        history = strategy.rebalancer.history if strategy.rebalancer is not None else []
        out["moves"] = [(m.layer, m.src, m.dst) for e in history for m in e.decision.moves]
    assert all(math.isfinite(x) for x in record.losses)
    return out
