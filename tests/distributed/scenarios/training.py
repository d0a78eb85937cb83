"""Training parity, written once for both sides: the pipeline ranks and the single-device reference.

``run_training(case, pipeline=True)`` runs inside a launched rank; ``pipeline=False`` rebuilds the same
LightningModule from the same seed on one process and trains it with the global batch (per-replica batch x
data-parallel size) in the order Lightning's DistributedSampler gives the replicas: the reference.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypedDict

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, StochasticWeightAveraging
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.distributed.tensor import DTensor
from torch.utils.data import TensorDataset
from typing_extensions import NotRequired

from lightning_pipe import PipelinePrecision, PipelineStrategy
from tests.models import (
    FrozenFrontRegressor,
    MetaBuiltRegressor,
    ParamFreeFrontRegressor,
    RecurrentRegressor,
    SavedOutputRegressor,
    TensorParallelRegressor,
    ToyRegressor,
    WeightNormRegressor,
    loader,
    reference_train_loader,
    regression_data,
)


@dataclass(frozen=True)
class TrainingCase:
    """One training run; every field has the value most cases use, a case names only what it changes."""

    # the model (``model`` is a key of MODELS; the toy models honour every other field, tiny_gpt refuses what it can't)
    model: str = "toy"
    n_layers: int = 8
    tied: bool = False
    optimizer: str = "sgd"
    inf_grad_at_step: int | None = None  # fp16: an overflow in the last stage only, at this optimizer step
    dropout: float = 0.0  # the tiny GPT's dropout (embedding, attention, residual branches)
    seed_per_rank: bool = False  # each launched rank seeds torch differently after building the model
    # the strategy
    schedule: str = "1f1b"
    microbatches: int | None = 4
    dp: int = 1
    fsdp: int = 1  # FSDP2 shards per stage (fsdp_size); replicas x shards read different data
    fsdp_reshard: bool = False  # fsdp_reshard_after_forward
    tp: int = 1  # tensor_parallel_size: ranks each layer is split over (they read the same data)
    stages_per_rank: int | None = None
    partition: str | list[int] = "uniform"
    schedule_options: dict[str, Any] | None = None
    recompute: str | int = "none"
    offload: str | int | list[int] = "none"
    compile: bool | dict[str, Any] = False  # torch.compile each layer (test_compile.py); the reference stays eager
    # data-parallel sync during the schedule (engine.overlap_dp_sync): on, off, or "alternate" optimizer steps
    dp_overlap: bool | str = True
    # the trainer
    steps: int = 3
    acc: int = 1
    clip: float | None = None
    clip_algo: str = "norm"
    precision: str = "32-true"
    fp16_init_scale: float = 2.0**16  # 16-mixed: the loss scale both sides start from
    monitor_dir: str | None = None  # ModelCheckpoint(monitor="val_loss") writes here
    # the data (per replica)
    batch: int = 8
    n_data: int = 192
    # what runs and what the parity check compares
    validate: bool = True  # validation during fit, trainer.validate, trainer.test
    predict: bool = False  # trainer.predict (padded last batch) and a second Trainer on the same module
    predict_n: int = 22  # predict samples (with replicas: Lightning's sampler shares them out unpadded)
    # Stage squared gradient norms add up to the single-device one only when no parameter is held by two stages:
    # a tie across stages counts its weight on both. Cases with ``tied=True`` must switch this off explicitly.
    check_grad_norms: bool = True
    expect_error: bool = False  # the worker records the exception message instead of failing the launch
    # per-rank Trainer limits, e.g. {"limit_train_batches": [5, 3]}: rank 1's epoch ends first (issue 23)
    rank_limits: dict[str, list[int]] | None = None
    # pipeline side: every rank but global rank 0 shifts its freshly built parameters, so only the initial broadcasts
    # (over the data-parallel and the tensor group) make the ranks start as the one device does. Pipeline size 1
    # only: every layer's source is then global rank 0.
    skewed_init: bool = False
    swa: bool = False  # a StochasticWeightAveraging callback (refused under the pipeline: test_errors.py)
    drop_last: bool = True  # the pipeline's training loader (False: a partial last batch per epoch)


class TrainingResult(TypedDict):
    """What one rank (or the reference) returns; the keys under ``NotRequired`` depend on the case or the side."""

    params: dict[str, torch.Tensor]  # named_parameters (this rank's stages under the pipeline)
    losses: list[float]  # logged train_loss per batch
    fit_val_losses: list[float]  # val_loss at each validation during fit
    scales: list[float]  # fp16 GradScaler scale per batch (empty otherwise)
    calls: dict[str, int]  # hook call counts
    grad_sq_before_step: list[float]  # squared gradient norm seen by on_before_optimizer_step
    val_loss: NotRequired[float]
    test_loss: NotRequired[float]
    predictions: NotRequired[torch.Tensor | None]
    val_loss_new_trainer: NotRequired[float]
    meta_tensors: NotRequired[int]  # pipeline only
    topology: NotRequired[tuple[int, int]]  # pipeline only: (dp_rank, pp_rank)
    best: NotRequired[tuple[str, float]]  # with monitor_dir: ModelCheckpoint's best path and score
    dp_sync: NotRequired[dict[str, int]]  # pipeline only: batches whose gradients were averaged each way
    tp_rank: NotRequired[int]  # pipeline only
    sharded_params: NotRequired[int]  # pipeline only: parameters held as split DTensors (FSDP / tensor parallel)
    per_edge_p2p: NotRequired[bool]  # pipeline only: torch 2.15 per-edge communicators in use
    offloaded_tensors: NotRequired[int]  # pipeline only: saved tensors this rank's offload hooks packed
    compiled_graphs: NotRequired[int]  # pipeline only: graphs Dynamo compiled in this process so far
    held_after_eval: NotRequired[list[int]]  # pipeline only: per forward-only batch, stage state torch still held


class NoLayerList(ToyRegressor):
    """Keeps its layers under another name: the strategy must say how to provide a layer list."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.blocks = self.layers
        del self.layers


# the tiny GPT's layer list: embedding, n_layer blocks, final norm, head
GPT_NON_BLOCK_LAYERS = 3


def tiny_gpt(case: TrainingCase) -> L.LightningModule:
    """The recipe's GPT, tiny: embedding and head tied across the first and the last stage, its own AdamW.

    It cannot honour every field of a case: refuse the ones it would otherwise silently ignore.
    """
    from recipes.gpt.model import GPT

    if not case.tied or case.optimizer not in ("adamw", "sgd") or case.inf_grad_at_step is not None:
        raise ValueError(f"the tiny GPT is always tied and trains with its AdamW or SGD (no injected overflow): {case}")
    if case.n_layers <= GPT_NON_BLOCK_LAYERS:
        raise ValueError(f"the tiny GPT needs n_layers > {GPT_NON_BLOCK_LAYERS} (embedding, norm, head): {case}")
    model = GPT(vocab_size=64, block_size=16, n_layer=case.n_layers - GPT_NON_BLOCK_LAYERS, n_head=2, n_embd=32,
                dropout=case.dropout, lr=3e-3, warmup_steps=2, max_steps=20)
    if case.optimizer == "sgd":
        # SGD moves by the (clipped) gradient itself: a wrong global norm shows in the parameters, where AdamW's
        # normalisation would all but hide it.
        model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=0.5)  # type: ignore[method-assign]
    return model


def tiny_llama(case: TrainingCase) -> L.LightningModule:
    """The Llama recipe, tiny: meta-built, grouped-query attention (4 query, 2 key/value heads), SwiGLU, its own
    AdamW; the head tied to the embedding with ``tied=True``."""
    from recipes.llama.model import Llama

    if case.optimizer != "adamw" or case.inf_grad_at_step is not None:
        raise ValueError(f"the tiny Llama trains with AdamW (no injected overflow): {case}")
    if case.n_layers <= GPT_NON_BLOCK_LAYERS:
        raise ValueError(f"the tiny Llama needs n_layers > {GPT_NON_BLOCK_LAYERS} (embedding, norm, head): {case}")
    return Llama(vocab_size=64, block_size=16, n_layer=case.n_layers - GPT_NON_BLOCK_LAYERS, n_head=4, n_kv_head=2,
                 n_embd=32, multiple_of=16, tie_embeddings=case.tied, lr=3e-3, warmup_steps=2, max_steps=20)


def gpt_splitting_its_head(case: TrainingCase) -> L.LightningModule:
    """The tiny GPT with a tensor-parallel hook that also splits the head (tied to the embedding, which it leaves
    whole): the two copies of the tie would train apart, which setup must refuse."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from recipes.gpt.model import Head

    model = tiny_gpt(case)
    split_blocks = model.parallelize_layer

    def parallelize_layer(index: int, layer: torch.nn.Module, tp_mesh: Any) -> None:
        split_blocks(index, layer, tp_mesh)
        if isinstance(layer, Head):
            parallelize_module(layer, tp_mesh, {"head": ColwiseParallel(output_layouts=Replicate())})

    model.parallelize_layer = parallelize_layer  # type: ignore[method-assign]
    return model


def tp_hook_failing_first(case: TrainingCase) -> L.LightningModule:
    """The tensor-parallel toy whose ``parallelize_layer`` raises on tensor rank 1 at layer 0, while tensor rank 0
    goes on to the next layers' broadcasts and its own hook's collectives (issue 23: a hang before the fix)."""
    model = toy(TensorParallelRegressor)(case)
    split = model.parallelize_layer

    def parallelize_layer(index: int, layer: torch.nn.Module, tp_mesh: Any) -> None:
        if index == 0 and tp_mesh.get_local_rank() == 1:
            raise ValueError("injected failure in parallelize_layer on tensor rank 1 at layer 0")
        split(index, layer, tp_mesh)

    model.parallelize_layer = parallelize_layer  # type: ignore[method-assign]
    return model


def tp_loss_failing(case: TrainingCase) -> L.LightningModule:
    """The tensor-parallel toy whose loss raises at the second optimizer step on every rank that computes it, while
    the step's autograd graph still holds the split (DTensor) weights: the teardown must not replace that error with
    its own (torch swaps tensor subclasses to move them, and refuses while the graph holds them)."""
    model = toy(TensorParallelRegressor)(case)
    loss = model.loss_fn

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if model.trainer.global_step == 1:
            raise ValueError("injected failure in loss_fn at step 1")
        return loss(output, target)

    model.loss_fn = loss_fn  # type: ignore[method-assign]
    return model


def toy(cls: type[ToyRegressor]) -> Callable[[TrainingCase], L.LightningModule]:
    def build(case: TrainingCase) -> L.LightningModule:
        return cls(n_layers=case.n_layers, optimizer=case.optimizer, tied=case.tied,
                   inf_grad_at_step=case.inf_grad_at_step)

    return build


def token_data(n: int, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (n, 17), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def packed_token_data(n: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """``n`` packed rows of 16 tokens ``{"input_ids", "document_ids", "labels"}`` (``data=packed``'s batches):
    documents of 5..16 tokens (windows of k + 1), packed best-fit decreasing; the rows' tail padding has labels -100,
    so micro-batches hold different token counts (the recipes' loss is then token-weighted)."""
    from lightning_pipe.layers.packing import IGNORE_INDEX, pack_documents, plan_rows

    g = torch.Generator().manual_seed(seed)
    windows = [torch.randint(0, 64, (int(k) + 1,), generator=g) for k in torch.randint(5, 17, (3 * n,), generator=g)]
    rows = plan_rows([len(w) - 1 for w in windows], 16)
    rows = [rows[i] for i in torch.randperm(len(rows), generator=g)[:n]]  # not only the longest-first rows
    x, ids = pack_documents([w[:-1] for w in windows], rows, 16, pad_value=0)
    y, _ = pack_documents([w[1:] for w in windows], rows, 16, pad_value=IGNORE_INDEX)
    return [{"input_ids": a, "document_ids": b, "labels": c} for a, b, c in zip(x, ids, y)]


MODELS: dict[str, Callable[[TrainingCase], L.LightningModule]] = {
    "toy": toy(ToyRegressor), "no_layers": toy(NoLayerList), "meta": toy(MetaBuiltRegressor), "gpt": tiny_gpt,
    "tp": toy(TensorParallelRegressor), "gpt_split_head": gpt_splitting_its_head, "llama": tiny_llama,
    "tp_hook_fails": tp_hook_failing_first, "tp_loss_fails": tp_loss_failing, "gpt_packed": tiny_gpt, "llama_packed": tiny_llama,
    "saved_outputs": toy(SavedOutputRegressor), "weight_norm": toy(WeightNormRegressor),
    "recurrent": toy(RecurrentRegressor), "frozen_front": toy(FrozenFrontRegressor),
    "param_free_front": toy(ParamFreeFrontRegressor)}
TOKEN_WEIGHTED = frozenset({"gpt_packed", "llama_packed"})
"""Models whose data has -100 targets (a token-weighted loss with uneven counts per micro-batch and replica)."""
DATA: dict[str, Callable[[int], Any]] = {"gpt": token_data, "gpt_split_head": token_data,
                                                   "llama": token_data, "gpt_packed": packed_token_data,
                                                   "llama_packed": packed_token_data}


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


class DataParallelSync(Callback):
    """Sets the engine's overlap switch per batch (``case.dp_overlap``) and keeps its counts (and how many saved
    tensors offload packed) at the end of fit."""

    def __init__(self, case: TrainingCase) -> None:
        self.case = case
        self.counts: dict[str, int] = {}
        self.offloaded = 0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        mode = self.case.dp_overlap
        on = (batch_idx // self.case.acc) % 2 == 0 if mode == "alternate" else bool(mode)
        trainer.strategy.engine.overlap_dp_sync = on  # type: ignore[attr-defined]

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.counts = dict(trainer.strategy.engine.dp_sync_counts)  # type: ignore[attr-defined]
        self.offloaded = sum(sm.offload_stats.tensors for sm in trainer.strategy.engine.stage_modules)  # type: ignore[attr-defined]


class HeldAfterEval(Callback):
    """After each validation / test / predict batch: how many micro-batch outputs and forward caches this rank's
    stages still hold ([Note: evaluation keeps no stage outputs]; torch >= 2.15 names the cache
    ``_forward_chunk_states``)."""

    def __init__(self) -> None:
        self.held: list[int] = []

    def _count(self, trainer: L.Trainer, *args: Any) -> None:
        self.held.append(sum(len(getattr(st, "output_chunks", ())) + len(getattr(st, "fwd_cache", None) or
                                                                         getattr(st, "_forward_chunk_states", ()))
                             for st in trainer.strategy.engine.stages))  # type: ignore[attr-defined]

    on_validation_batch_end = on_test_batch_end = on_predict_batch_end = _count


def _precision(case: TrainingCase, pipeline: bool) -> dict[str, Any]:
    """fp16 AMP on CPU: Lightning would switch "16-mixed" to bf16 on CPU, so pass the plugins explicitly."""
    if case.precision != "16-mixed":
        return {"precision": case.precision}
    if pipeline:
        return {"plugins": [PipelinePrecision("16-mixed", device="cpu", init_scale=case.fp16_init_scale)]}
    return {"plugins": [MixedPrecision("16-mixed", "cpu",
                                       scaler=torch.amp.GradScaler("cpu", init_scale=case.fp16_init_scale))]}


def _trainer(case: TrainingCase, pipeline: bool, recorder: Callback, *extra: Callback) -> L.Trainer:
    strategy: Any
    if pipeline:
        strategy = PipelineStrategy(schedule=case.schedule, microbatches=case.microbatches,
                                    data_parallel_size=case.dp, partition=case.partition,
                                    stages_per_rank=case.stages_per_rank, schedule_options=case.schedule_options,
                                    recompute=case.recompute, offload=case.offload, fsdp_size=case.fsdp,
                                    fsdp_reshard_after_forward=case.fsdp_reshard, tensor_parallel_size=case.tp,
                                    compile=case.compile)
        devices = int(os.environ["TEST_WORLD_SIZE"])  # Lightning deletes WORLD_SIZE at teardown
    else:
        strategy, devices = "auto", 1
    # ModelCheckpoint(monitor="val_loss"): the metric must exist, identical, on every rank
    monitor = [] if case.monitor_dir is None else [
        ModelCheckpoint(dirpath=case.monitor_dir, monitor="val_loss", mode="min", save_top_k=1)]
    if case.swa:
        monitor.append(StochasticWeightAveraging(swa_lrs=0.01))
    limits: dict[str, Any] = {"limit_val_batches": 3}
    if pipeline and case.rank_limits:
        limits.update({key: values[int(os.environ["RANK"])] for key, values in case.rank_limits.items()})
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=case.steps, **limits,
                     **_precision(case, pipeline), accumulate_grad_batches=case.acc, gradient_clip_val=case.clip,
                     gradient_clip_algorithm=case.clip_algo, logger=False,
                     enable_checkpointing=case.monitor_dir is not None,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     val_check_interval=2, check_val_every_n_epoch=None,
                     callbacks=[recorder, *monitor, *extra])


def run_training(case: TrainingCase, pipeline: bool) -> TrainingResult:
    torch.manual_seed(1234)
    model = MODELS[case.model](case)
    if pipeline and case.seed_per_rank:  # e.g. an unseeded run: random streams differ from rank to rank
        torch.manual_seed(1234 + int(os.environ["RANK"]))
    if pipeline and case.skewed_init:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * int(os.environ["RANK"]))
    data = DATA.get(case.model, regression_data)(case.n_data)
    batch = case.batch * (1 if pipeline else case.dp * case.fsdp)
    recorder = LossRecorder()
    dp_sync, held = DataParallelSync(case), HeldAfterEval()
    trainer = _trainer(case, pipeline, recorder, *([dp_sync, held] if pipeline else []))
    # Lightning shuffles training data through its DistributedSampler; the reference walks the same order.
    train_loader = loader(data, batch, case.drop_last) if pipeline else reference_train_loader(data, batch)
    trainer.fit(model, train_loader, loader(data, batch) if case.validate else None)
    out = TrainingResult(
        params={n: full_tensor(p) for n, p in model.named_parameters(remove_duplicate=False)},
        losses=recorder.losses, fit_val_losses=recorder.val_losses, scales=recorder.scales,
        calls=dict(getattr(model, "calls", {})), grad_sq_before_step=list(getattr(model, "grad_norms_before_step", [])))
    if case.validate:
        out["val_loss"] = trainer.validate(model, loader(data, batch), verbose=False)[0]["val_loss"]
        out["test_loss"] = trainer.test(model, loader(data, batch), verbose=False)[0]["test_loss"]
    if case.predict:
        # 22 samples with batch 8: the last batch (6 rows) does not divide into 4 micro-batches: pad-and-trim.
        pred_data = regression_data(case.predict_n, seed=7)
        preds = trainer.predict(model, loader(pred_data, case.batch, drop_last=False))
        out["predictions"] = torch.cat(preds) if preds and preds[0] is not None else None
        # A new Trainer (new strategy) on the same, already split module: the layout is reused, with another
        # micro-batch count (it moves no layer; a custom schedule's action lists fix theirs)
        again = (case if case.schedule == "custom" or case.microbatches is None
                 else replace(case, microbatches=case.microbatches * 2))
        fresh = _trainer(again, pipeline, LossRecorder())
        out["val_loss_new_trainer"] = fresh.validate(model, loader(data, batch), verbose=False)[0]["val_loss"]
    if pipeline:
        # every tensor this rank holds is allocated; other stages' layers never were (meta, then placeholders)
        out["meta_tensors"] = sum(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
        out["topology"] = (trainer.strategy.topology.dp_rank, trainer.strategy.topology.pp_rank)
        out["dp_sync"] = dp_sync.counts
        out["tp_rank"] = trainer.strategy.topology.tp_rank
        # torch >= 2.15: one communicator per directed edge (the flag every PipelineStage reads when it is built)
        out["per_edge_p2p"] = bool(getattr(getattr(torch.distributed, "config", None), "pipeline_per_edge_p2p", False))
        out["offloaded_tensors"] = dp_sync.offloaded
        out["held_after_eval"] = held.held
        out["compiled_graphs"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        out["sharded_params"] = sum(isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements)
                                    for p in model.parameters())
    callback = trainer.checkpoint_callback
    if callback is not None and case.monitor_dir is not None:
        out["best"] = (callback.best_model_path, float(callback.best_model_score))
    return out


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A detached copy; an FSDP-sharded DTensor gathered whole (collective: every shard rank calls it in turn)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def run_pipeline(case: TrainingCase) -> TrainingResult:
    """The scenario a launched rank runs."""
    return run_training(case, pipeline=True)
