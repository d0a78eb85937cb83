"""The model and data of the feature scenarios (issue 45): a small classifier as a layer list, whose hooks do what
everyday Lightning code does (collectives, hand-written clipping, gradient-norm logging, a penalty, training
metrics, manual optimization), switched on by ``mode``. The same class trains on one device and under the pipeline.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

import lightning_pipe
from lightning_pipe import PipelineModule
from tests.models import Block, TiedHead

CLASSES = 4
WIDTH = 16


def classification_data(n: int, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    w = torch.randn(4, CLASSES, generator=torch.Generator().manual_seed(99))
    return TensorDataset(x, (x @ w + 0.3 * torch.randn(n, CLASSES, generator=g)).argmax(-1))


class Stream(IterableDataset):
    """An IterableDataset of ``n`` samples (its last batch is short when the batch does not divide ``n``)."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __iter__(self) -> Any:
        return iter(self.data)


class FeatureNet(PipelineModule):
    """Linear(4, 16), residual tanh blocks, a head of 4 classes (tied to the first layer's weight with ``tied``)."""

    def __init__(self, mode: str = "plain", n_layers: int = 6, lr: float = 0.1, tied: bool = False,
                 optimizer: str = "sgd", scheduler: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        first = nn.Linear(4, WIDTH)
        head: nn.Module = TiedHead(first.weight) if tied else nn.Linear(WIDTH, CLASSES)
        self.layers = nn.Sequential(first, *(Block(WIDTH) for _ in range(n_layers - 2)), head)
        self.mode, self.lr, self.optimizer_name, self.scheduler = mode, lr, optimizer, scheduler
        self.train_acc = torchmetrics.classification.MulticlassAccuracy(CLASSES, average="micro")
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(CLASSES, average="micro")
        self.record: dict[str, list[Any]] = {}
        self.val_rows = 0

    def remember(self, key: str, value: Any) -> None:
        self.record.setdefault(key, []).append(value.detach().cpu().clone() if isinstance(value, torch.Tensor)
                                               else value)

    def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target)

    def configure_optimizers(self) -> Any:
        opt: torch.optim.Optimizer
        if self.optimizer_name == "adamw":
            opt = torch.optim.AdamW(self.parameters(), lr=self.lr / 10, weight_decay=0.1)
        else:
            opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        if self.scheduler == "step":
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)}
        if self.scheduler == "onecycle":
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.lr, total_steps=50)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        if self.scheduler == "plateau":
            sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val_loss"}}
        return opt

    # ------------------------------------------------------------------ steps
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.mode == "train_metrics":  # item 3: the outputs with the loss, a train accuracy
            loss, logits = self.compute_loss(batch, return_outputs=True)
            self.train_acc(logits.argmax(-1), batch[1])
            self.log("train_acc", self.train_acc, on_step=True, on_epoch=False)
        else:
            loss = self.compute_loss(batch)
        self.log("train_loss", loss)
        self.log_aux_losses()
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        out = self.compute_output(batch)
        loss = self.loss_fn(out, batch[1])
        self.val_acc(out.argmax(-1), batch[1])
        self.val_rows += batch[1].shape[0]
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_acc", self.val_acc)
        self.log("val_rows", float(batch[1].shape[0]), reduce_fx="sum", sync_dist=True)
        return loss

    def on_validation_epoch_start(self) -> None:
        self.val_rows = 0

    def on_validation_epoch_end(self) -> None:
        if self.mode != "collectives":
            return
        rows = torch.tensor(float(self.val_rows))
        gathered = self.all_gather(rows)
        self.remember("all_gather_shape", tuple(gathered.shape))
        self.remember("all_gather_sum", gathered.sum())
        self.remember("reduce_sum", self.trainer.strategy.reduce(rows.clone(), reduce_op="sum"))
        self.remember("broadcast", self.trainer.strategy.broadcast(f"from rank {self.global_rank}", src=0))
        self.trainer.strategy.barrier("feature test")
        if torch.distributed.is_initialized():
            every = self.all_gather(rows, group=torch.distributed.group.WORLD)
            self.remember("world_gather_shape", tuple(every.shape))
        self.remember("head_norm", self.layer_value(len(self.layers) - 1, lambda layer: layer.weight.norm()))

    # ------------------------------------------------------------------ hooks of the gradient features (item 5)
    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:
        if self.mode == "clip_torch_norm":
            self.remember("torch_norm", torch.nn.utils.clip_grad_norm_(self.parameters(), 0.05))
        elif self.mode == "clip_torch_value":
            torch.nn.utils.clip_grad_value_(self.parameters(), 0.01)
        elif self.mode == "clip_self":
            self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        else:
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.mode == "grad_norm_lightning":
            self.log_dict(lightning_grad_norm(self, 2))
        elif self.mode == "grad_norm_ours":
            norms = lightning_pipe.grad_norm(self, 2)
            self.remember("grad_norm_total", norms["grad_2.0_norm_total"])
            self.log_dict(norms)


class PenaltyNet(FeatureNet):
    """An L2 penalty over every layer's parameters, added where each layer lives ([Note: a penalty over every
    stage's parameters])."""

    def layer_penalty(self, index: int, layer: nn.Module) -> torch.Tensor | None:
        return 1e-2 * sum(p.pow(2).sum() for p in layer.parameters())  # type: ignore[return-value]


class ManualNet(FeatureNet):
    """Manual optimization with two optimizers (issue 45, item 2): ``mode`` picks the pattern.

    - ``manual_gan``: a GAN-like step: the "generator" half (layers 0-2, SGD) and the "discriminator" half (layers
      3-5, Adam) each take their own loss in turn, the other half toggled off, clipped with ``self.clip_gradients``;
    - ``manual_alternate``: one of the two updates per batch, alternating;
    - ``manual_groups``: per-layer-group optimizers on one loss, clipped with torch's ``clip_grad_norm_``, an LR
      scheduler per optimizer;
    - ``manual_twice`` / ``manual_changed``: what cannot be pipelined (refused): a second ``compute_loss`` before
      ``manual_backward``, a changed loss given to ``manual_backward``.
    """

    def __init__(self, mode: str, **kwargs: Any) -> None:
        super().__init__(mode, **kwargs)
        self.automatic_optimization = False
        self.adversarial = False

    def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.adversarial:  # the "discriminator" learns another labelling of the same samples
            return 0.5 * F.cross_entropy(output, (target + 1) % CLASSES)
        return F.cross_entropy(output, target)

    def _front(self, name: str) -> bool:
        """Layers 0-2, and the head's tied weight under its own name (so both copies of a tie share an optimizer;
        ``manual_tie_split`` leaves it to position: refused)."""
        head = f"layers.{len(self.layers) - 1}.weight"
        return int(name.split(".")[1]) < 3 or (name == head and self.mode != "manual_tie_split")

    def configure_optimizers(self) -> Any:
        named = list(self.named_parameters(remove_duplicate=False))
        front = list({id(p): p for n, p in named if self._front(n)}.values())
        back = list({id(p): p for n, p in named if not self._front(n) and all(p is not q for q in front)}.values())
        opt_g = torch.optim.SGD(front, lr=self.lr, momentum=0.9)
        opt_d = torch.optim.Adam(back, lr=self.lr / 10)
        if self.mode == "manual_groups":
            return [opt_g, opt_d], [torch.optim.lr_scheduler.StepLR(opt_g, 1, 0.8),
                                    torch.optim.lr_scheduler.StepLR(opt_d, 1, 0.9)]
        return opt_g, opt_d

    def _update(self, opt: Any, batch: Any, adversarial: bool) -> torch.Tensor:
        self.toggle_optimizer(opt)
        self.adversarial = adversarial
        loss = self.compute_loss(batch)
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        opt.step()
        opt.zero_grad()
        self.untoggle_optimizer(opt)
        self.adversarial = False
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        opt_g, opt_d = self.optimizers()
        if self.mode == "manual_gan":
            loss = self._update(opt_g, batch, False)
            self.log("loss_d", self._update(opt_d, batch, True))
        elif self.mode == "manual_alternate":
            loss = self._update(opt_g if batch_idx % 2 == 0 else opt_d, batch, batch_idx % 2 == 1)
        elif self.mode == "manual_groups":
            loss = self.compute_loss(batch)
            self.manual_backward(loss)
            self.remember("torch_norm", torch.nn.utils.clip_grad_norm_(self.parameters(), 0.3))
            for opt, sched in zip((opt_g, opt_d), self.lr_schedulers()):
                opt.step()
                opt.zero_grad()
                sched.step()
        elif self.mode == "manual_twice":
            loss = self.compute_loss(batch)
            self.compute_loss(batch)
        elif self.mode == "manual_tie_split":
            loss = self._update(opt_g, batch, False)
        else:  # manual_changed
            loss = self.compute_loss(batch)
            self.manual_backward(2 * loss)
        self.log("train_loss", loss)
        return loss
