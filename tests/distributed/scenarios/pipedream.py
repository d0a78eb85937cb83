"""PipeDream (weight stashing) and PipeMare runs: the training scenario plus what only these schedules have to show —
the weight version each micro-batch used on this rank's stage, the stashes alive at once (PipeDream), the weight
copies and learning-rate factors (PipeMare), the update count."""

from __future__ import annotations

from typing import Any

import torch

from tests.distributed.scenarios.training import DATA, MODELS, LossRecorder, TrainingCase, _trainer, full_tensor
from tests.models import loader, regression_data


class VersionRecorder(LossRecorder):
    """Per batch: ``(micro-batch, version)`` of every training forward of this rank's stage (PipeMare:
    ``(micro-batch, forward version, backward version)`` per backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.versions: list[list[tuple[int, int]]] = []
        self.lrs: list[float] = []
        self.max_stashes = 0
        self.pp_rank = -1
        self.lr_factors: list[float] = []
        self.copy_bytes = 0  # PipeMare: the most bytes of weight copies alive at once
        self.stage_bytes = 0  # the stage's parameters

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        super().on_train_batch_end(trainer, *args)
        (stage,) = trainer.strategy.engine.stages
        self.versions.append(stage.take_versions())
        self.pp_rank = trainer.strategy.topology.pp_rank
        self.max_stashes = getattr(stage, "max_stashes", 0)
        self.lr_factors, self.copy_bytes = list(getattr(stage, "lr_factors", [])), getattr(stage, "max_copy_bytes", 0)
        self.stage_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in stage.submod.parameters()}.values())
        self.lrs.append(float(trainer.optimizers[0].param_groups[0]["lr"]))


def run_pipedream(case: TrainingCase) -> dict[str, Any]:
    torch.manual_seed(1234)
    model = MODELS[case.model](case)
    data = DATA.get(case.model, regression_data)(case.n_data)
    recorder = VersionRecorder()
    trainer = _trainer(case, True, recorder)
    trainer.fit(model, loader(data, case.batch), loader(data, case.batch) if case.validate else None)
    out: dict[str, Any] = {
        "params": {n: full_tensor(p) for n, p in model.named_parameters(remove_duplicate=False)},
        "losses": recorder.losses, "versions": recorder.versions, "lrs": recorder.lrs,
        "max_stashes": recorder.max_stashes, "global_step": trainer.global_step, "pp_rank": recorder.pp_rank,
        "calls": dict(getattr(model, "calls", {})),
        "lr_factors": recorder.lr_factors, "copy_bytes": recorder.copy_bytes, "stage_bytes": recorder.stage_bytes}
    if case.validate:
        out["val_loss"] = trainer.validate(model, loader(data, case.batch), verbose=False)[0]["val_loss"]
    return out
