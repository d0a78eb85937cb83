"""The everyday features on a model this project did not write (issue 45): a tiny Llama from transformers through
``HFCausalLM``, with a token accuracy from ``compute_loss(batch, return_outputs=True)``, ``self.all_gather`` of the
validation token counts, ``layer_value`` of a decoder layer, ``lightning_pipe.grad_norm`` and torch's
``clip_grad_norm_`` in ``configure_gradient_clipping``, ``ModelSummary``, and a short last batch (30 rows in batches
of 8 for 4 micro-batches: the last has 6). The same module on one device is the reference."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torchmetrics
from lightning.pytorch.callbacks import ModelSummary
from torch.utils.data import DataLoader

import lightning_pipe
from lightning_pipe import HFCausalLM
from tests.distributed.scenarios.feature_fit import FeatureCase, Recorder, params_of, result_of, trainer_for
from tests.distributed.scenarios.hf import make_config, padded_data
from tests.models import SameOrderAsDistributedSampler


class EverydayLM(HFCausalLM):
    def __init__(self) -> None:
        super().__init__(config=make_config("llama"), seed=5,
                         optimizer=lambda params: torch.optim.SGD(params, lr=0.2, momentum=0.9))
        self.token_acc = torchmetrics.classification.MulticlassAccuracy(96, average="micro", ignore_index=-100)
        self.record: dict[str, list[Any]] = {}
        self.val_tokens = 0

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss, logits = self.compute_loss(batch, return_outputs=True)
        self.token_acc(logits[:, :-1].argmax(-1), batch["labels"][:, 1:])  # the next token
        self.log("train_acc", self.token_acc, on_step=True, on_epoch=False)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        self.val_tokens += int((batch["labels"][:, 1:] != -100).sum())
        return super().validation_step(batch, batch_idx)

    def on_validation_epoch_start(self) -> None:
        self.val_tokens = 0

    def on_validation_epoch_end(self) -> None:
        self.record.setdefault("tokens", []).append(float(self.all_gather(torch.tensor(float(self.val_tokens))).sum()))
        norm = self.layer_value(2, lambda layer: sum(p.norm() ** 2 for p in layer.parameters()) ** 0.5)
        self.record.setdefault("layer2_norm", []).append(float(norm))

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        norms = lightning_pipe.grad_norm(self, 2)
        self.record.setdefault("grad_norm", []).append(float(norms["grad_2.0_norm_total"]))

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:
        torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)


def collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def hf_everyday(case: FeatureCase, pipeline: bool) -> dict[str, Any]:
    model, recorder = EverydayLM(), Recorder(("train_acc",))
    handler_text: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: handler_text.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("lightning.pytorch.callbacks.model_summary")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        trainer = trainer_for(case, pipeline, [recorder, ModelSummary(max_depth=2)], enable_model_summary=True,
                              max_steps=-1, max_epochs=1)
        # 30 rows: the last batch has 6; the reference reads them in the DistributedSampler's order
        train = DataLoader(padded_data(30), batch_size=8, collate_fn=collate,
                           sampler=None if pipeline else SameOrderAsDistributedSampler(30))
        trainer.fit(model, train, DataLoader(padded_data(16, seed=9), batch_size=8, collate_fn=collate))
    finally:
        logger.removeHandler(handler)
    out = result_of(trainer, model, recorder, pipeline)  # type: ignore[arg-type]
    out["params"] = params_of(model)
    out["summary"] = "\n".join(handler_text)
    return out


__all__ = ["hf_everyday"]
