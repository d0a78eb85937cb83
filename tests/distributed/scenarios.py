"""What a multi-rank test runs, written once for both sides: the pipeline ranks and the single-device reference.

``run_training(case, pipeline=True)`` runs inside a launched rank; ``pipeline=False`` runs the same LightningModule
on one process, with the global batch (per-replica batch x data-parallel size), as the reference.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import TensorDataset

from lightning_pipe import PipelinePrecision, PipelineStrategy
from tests.models import MetaBuiltRegressor, ToyRegressor, loader, reference_train_loader, regression_data

DEFAULTS: dict[str, Any] = dict(schedule="1f1b", dp=1, acc=1, clip=None, clip_algo="norm", steps=3, optimizer="sgd",
                                tied=False, n_layers=8, microbatches=4, split="uniform", batch=8,
                                stages_per_rank=None, predict=False, validate=True, n_data=192, model="toy",
                                precision="32-true", recompute="none", inf_grad_at_step=None)


class NoLayerList(ToyRegressor):
    """Keeps its layers under another name: the strategy must say how to provide a layer list."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.blocks = self.layers
        del self.layers


def tiny_gpt(**_: Any) -> L.LightningModule:
    """The recipe's GPT, tiny: embedding and head tied across the first and the last stage."""
    from recipes.gpt.model import GPT

    return GPT(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32, lr=3e-3, warmup_steps=2, max_steps=20)


def token_data(n: int, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (n, 17), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


MODELS = {"toy": ToyRegressor, "no_layers": NoLayerList, "gpt": tiny_gpt, "meta": MetaBuiltRegressor}
DATA = {"gpt": token_data}


class LossRecorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.val_losses: list[float] = []

        self.scales: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            self.scales.append(float(scaler.get_scale()))

    def on_validation_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.state.fn == "fit":
            self.val_losses.append(float(trainer.callback_metrics["val_loss"]))


def _precision(case: dict[str, Any], pipeline: bool) -> dict[str, Any]:
    """fp16 AMP on CPU: Lightning would switch "16-mixed" to bf16 on CPU, so pass the plugins explicitly."""
    if case["precision"] != "16-mixed":
        return {"precision": case["precision"]}
    if pipeline:
        return {"plugins": [PipelinePrecision("16-mixed", device="cpu")]}
    return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]}


def _trainer(case: dict[str, Any], pipeline: bool, recorder: Callback) -> L.Trainer:
    if pipeline:
        strategy: Any = PipelineStrategy(schedule=case["schedule"], microbatches=case["microbatches"],
                                         data_parallel_size=case["dp"], split=case["split"],
                                         stages_per_rank=case["stages_per_rank"],
                                         schedule_options=case.get("schedule_options"), recompute=case["recompute"])
        devices = int(os.environ["TEST_WORLD_SIZE"])  # Lightning deletes WORLD_SIZE at teardown
    else:
        strategy, devices = "auto", 1
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=case["steps"],
                     **_precision(case, pipeline), accumulate_grad_batches=case["acc"], gradient_clip_val=case["clip"],
                     gradient_clip_algorithm=case["clip_algo"], logger=False,
                     enable_checkpointing=case.get("monitor_dir") is not None,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     limit_val_batches=3, val_check_interval=2, check_val_every_n_epoch=None,
                     callbacks=[recorder, *_monitor(case)])


def _monitor(case: dict[str, Any]) -> list[Callback]:
    """ModelCheckpoint(monitor="val_loss"): the metric must exist, identical, on every rank."""
    if case.get("monitor_dir") is None:
        return []
    return [ModelCheckpoint(dirpath=case["monitor_dir"], monitor="val_loss", mode="min", save_top_k=1)]


def run_training(case: dict[str, Any], pipeline: bool) -> dict[str, Any]:
    case = {**DEFAULTS, **case}
    torch.manual_seed(1234)
    model = MODELS[case["model"]](n_layers=case["n_layers"], optimizer=case["optimizer"], tied=case["tied"],
                                  inf_grad_at_step=case["inf_grad_at_step"])
    data = DATA.get(case["model"], regression_data)(case["n_data"])
    batch = case["batch"] * (1 if pipeline else case["dp"])
    recorder = LossRecorder()
    trainer = _trainer(case, pipeline, recorder)
    # Lightning shuffles training data through its DistributedSampler; the reference walks the same order.
    train_loader = loader(data, batch) if pipeline else reference_train_loader(data, batch)
    trainer.fit(model, train_loader, loader(data, batch) if case["validate"] else None)
    out: dict[str, Any] = {
        "params": {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)},
        "losses": recorder.losses,
        "fit_val_losses": recorder.val_losses,
        "scales": recorder.scales,
        "calls": dict(getattr(model, "calls", {})),
        "grad_sq_before_step": getattr(model, "grad_norms_before_step", []),
    }
    if case["validate"]:
        metrics = trainer.validate(model, loader(data, batch), verbose=False)
        out["val_loss"] = metrics[0]["val_loss"]
        out["test_loss"] = trainer.test(model, loader(data, batch), verbose=False)[0]["test_loss"]
    if case["predict"]:
        # 22 samples with batch 8: the last batch (6 rows) does not divide into 4 micro-batches: pad-and-trim.
        pred_data = regression_data(22, seed=7)
        preds = trainer.predict(model, loader(pred_data, case["batch"], drop_last=False))
        out["predictions"] = torch.cat(preds) if preds and preds[0] is not None else None
        # A new Trainer (new strategy) on the same, already split module: the layout is reused.
        fresh = _trainer(case, pipeline, LossRecorder())
        out["val_loss_new_trainer"] = fresh.validate(model, loader(data, batch), verbose=False)[0]["val_loss"]
    if pipeline:
        # every tensor this rank holds is allocated; other stages' layers never were (meta, then placeholders)
        out["meta_tensors"] = sum(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
        out["topology"] = (trainer.strategy.topology.dp_rank, trainer.strategy.topology.pp_rank)
    if trainer.checkpoint_callback is not None and case.get("monitor_dir") is not None:
        out["best"] = (trainer.checkpoint_callback.best_model_path, float(trainer.checkpoint_callback.best_model_score))
    return out


# ---------------------------------------------------------------------------------------------------------- checkpoints
# Used by tests/distributed/test_checkpoint.py. Every path a case names is absolute (the test's tmp_path).

CKPT_DEFAULTS: dict[str, Any] = dict(schedule="1f1b", dp=1, steps=8, optimizer="adamw", tied=False, n_layers=8,
                                     microbatches=4, batch=8, stages_per_rank=None, steps_per_epoch=4)


class StateAtStart(Callback):
    """The state a resumed run starts from (params and name-keyed optimizer state), after the checkpoint loaded."""

    def __init__(self) -> None:
        self.params: dict[str, torch.Tensor] = {}
        self.optim: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.params = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        self.optim = optimizer_by_name(pl_module, trainer.optimizers[0])


def optimizer_by_name(module: Any, optimizer: Any) -> dict[str, torch.Tensor]:
    from lightning_pipe.checkpoint import ModuleNames

    layout = getattr(module, "_pipeline_layout", None)
    names = ModuleNames(module, "layers", layout.tied if layout is not None else ())
    out = {}
    for p, st in optimizer.state.items():
        if id(p) in names.owned or layout is None:
            for k, v in st.items():
                out[f"{names.name_of[id(p)]}.{k}"] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    return out


def _ckpt_run(case: dict[str, Any], ckpt_path: Any = None, callbacks: list[Callback] = ()) -> dict[str, Any]:
    torch.manual_seed(1234)
    model = ToyRegressor(n_layers=case["n_layers"], optimizer=case["optimizer"], tied=case["tied"])
    n_data = case["steps_per_epoch"] * case["batch"] * case["dp"]
    recorder, start = LossRecorder(), StateAtStart()
    strategy = PipelineStrategy(schedule=case["schedule"], microbatches=case["microbatches"],
                                data_parallel_size=case["dp"], stages_per_rank=case["stages_per_rank"])
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=int(os.environ["TEST_WORLD_SIZE"]),
                        max_steps=case["steps"], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        callbacks=[recorder, start, *callbacks], enable_checkpointing=bool(callbacks))
    trainer.fit(model, loader(regression_data(n_data), case["batch"]), ckpt_path=ckpt_path)
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "losses": recorder.losses,
            "start_params": start.params, "start_optim": start.optim, "global_step": trainer.global_step,
            "topology": (trainer.strategy.topology.dp_rank, trainer.strategy.topology.pp_rank)}


def run_ckpt(case: dict[str, Any]) -> dict[str, Any]:
    """One scenario for every checkpoint case; ``case["kind"]`` picks train / resume / crash."""
    kind = case.pop("kind", "train")
    return {"train": run_ckpt_train, "resume": run_ckpt_resume, "crash": run_ckpt_crash}[kind](case)


def run_ckpt_train(case: dict[str, Any]) -> dict[str, Any]:
    """Train N steps with ModelCheckpoint (sharded, one per epoch, "last" link); then resume from epoch 0's."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    case = {**CKPT_DEFAULTS, **case}
    # Saved at the end of each epoch's last batch (every_n_train_steps): resuming from there is exact in Lightning.
    # (A save from on_train_epoch_end replays one batch on resume, on one device too; mid-epoch resumes restart
    # the epoch's data, as Lightning does for loaders without state.)
    ckpt = ModelCheckpoint(dirpath=case["dir"], save_top_k=-1, every_n_train_steps=case["steps_per_epoch"],
                           save_last="link")
    full = _ckpt_run(case, callbacks=[ckpt])
    out = {"full": full}
    if case.get("resume_from"):
        out["resumed"] = _ckpt_run(case, ckpt_path=case["resume_from"])
    return out


def run_ckpt_resume(case: dict[str, Any]) -> dict[str, Any]:
    """Resume (``ckpt_path``) in this case's layout, from a checkpoint written by any layout or a single file."""
    case = {**CKPT_DEFAULTS, **case}
    return {"resumed": _ckpt_run(case, ckpt_path=case["resume_from"])}


def run_ckpt_crash(case: dict[str, Any]) -> dict[str, Any]:
    """Save every 2 steps; rank ``crash_rank`` dies (os._exit) in the middle of the second save."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_pipe.checkpoint import format as ckpt_lib

    case = {**CKPT_DEFAULTS, **case}
    calls = {"n": 0}
    original = ckpt_lib.write_shards

    def dying_write(state: dict[str, Any], tmp: Any, no_dist: bool = False) -> None:
        calls["n"] += 1
        if calls["n"] == 2 and int(os.environ["RANK"]) == case["crash_rank"]:
            os._exit(17)  # killed mid-save: the other ranks have started writing into the .partial directory
        original(state, tmp, no_dist)

    ckpt_lib.write_shards = dying_write
    ckpt = ModelCheckpoint(dirpath=case["dir"], save_top_k=-1, every_n_train_steps=2, save_last="link")
    return _ckpt_run(case, callbacks=[ckpt])


# ---------------------------------------------------------------------------------------------------------- timeline
# Used by tests/distributed/test_trace.py: train with the PipelineTimeline callback, return what it recorded/logged.

TRACE_DEFAULTS: dict[str, Any] = dict(schedule="1f1b", microbatches=4, split="uniform", n_layers=8, width=8,
                                      mb_rows=2, steps=3, every_n_steps=1, warmup_steps=1, export_dir=None,
                                      csv_dir=None, stages_per_rank=None)


class MetricsSeen(Callback):
    """What the logger connector holds after each batch (the callback's values are logged on_train_batch_end)."""

    def __init__(self) -> None:
        self.seen: list[dict[str, float]] = []

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._grab(trainer)

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._grab(trainer)

    def _grab(self, trainer: L.Trainer) -> None:
        self.seen.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("pipeline/")})


def run_trace(case: dict[str, Any]) -> dict[str, Any]:
    from lightning.pytorch.loggers import CSVLogger

    from lightning_pipe import PipelineTimeline

    case = {**TRACE_DEFAULTS, **case}
    torch.manual_seed(0)
    model = ToyRegressor(n_layers=case["n_layers"], width=case["width"])
    m = case["microbatches"]
    batch = m * case["mb_rows"]
    data = regression_data(batch * case["steps"])
    timeline = PipelineTimeline(every_n_steps=case["every_n_steps"], export_dir=case["export_dir"],
                                warmup_steps=case["warmup_steps"])
    seen = MetricsSeen()
    strategy = PipelineStrategy(schedule=case["schedule"], microbatches=m, split=case["split"],
                                stages_per_rank=case["stages_per_rank"])
    logger: Any = CSVLogger(case["csv_dir"], name="", version="") if case["csv_dir"] else False
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=int(os.environ["TEST_WORLD_SIZE"]),
                        max_steps=case["steps"], logger=logger, log_every_n_steps=1, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[timeline, seen])
    trainer.fit(model, loader(data, batch))
    return {"records": [r.to_dict() for r in timeline.records], "last_bubble": timeline.last_bubble,
            "per_pp": timeline.last_bubbles_per_pp_rank, "seen": seen.seen,
            "theory": trainer.strategy.engine.plan.theoretical_bubble() if trainer.strategy.engine else None}
