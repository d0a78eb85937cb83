"""Callbacks for the GPT recipe: throughput in tokens/s, model FLOP/s and MFU."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor

# Dense bf16/fp16 tensor-core peaks per device, in TFLOP/s (vendor datasheets, no sparsity). Matched in order as a
# substring of torch.cuda.get_device_name(): longer names first ("A100" before "A10", "L40S" before "L4").
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("GH200", 989.0), ("A100", 312.0), ("L40S", 362.0),
    ("L4", 121.0), ("A10", 125.0), ("V100", 125.0),
)


def known_peak_tflops(device_name: str) -> float | None:
    """The bf16 dense peak of a known accelerator, by (a part of) its name; None if unknown."""
    for key, tflops in PEAK_TFLOPS:
        if key in device_name:
            return tflops
    return None


def data_parallel_replicas(trainer: pl.Trainer) -> int:
    """How many replicas see different data: DP size under the pipeline or DDP, 1 on one device.

    Read from the strategy's sampler settings (``num_replicas``), which is exactly the data-parallel world —
    the pipeline strategy counts each replica once, however many stages it has.
    """
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("num_replicas", 1))


def _batch_inputs(batch: Any) -> Any:
    if isinstance(batch, (tuple, list)):
        return batch[0] if batch else None
    if isinstance(batch, Mapping):
        return batch.get("input", batch.get("input_ids"))
    return batch


def batch_tokens(batch: Any) -> int:
    """Tokens in one batch: the element count of the inputs of an ``(x, y)`` batch, a bare tensor, or a dict's
    ``"input"`` (``"input_ids"`` for transformers' collators). Other layouts count 0 rather than guess."""
    x = _batch_inputs(batch)
    return x.numel() if isinstance(x, Tensor) else 0


def _sequence_length(batch: Any) -> int | None:
    x = _batch_inputs(batch)
    return int(x.shape[-1]) if isinstance(x, Tensor) and x.dim() >= 2 else None


def model_parameter_count(pl_module: pl.LightningModule, replicas: int = 1) -> int:
    """Parameters of the whole model, each counted once, on every rank (a collective under the pipeline).

    Under the pipeline each rank holds only its stages' parameters, and a tied weight is held by the stages of both
    its ends: a rank counts a parameter unless its only local names are a tie's later uses (``_pipeline_layout``);
    the counts are summed over the world and divided by the data-parallel ``replicas`` (each holds the whole model).
    """
    layout = getattr(pl_module, "_pipeline_layout", None)
    later_uses = {name for tie in getattr(layout, "tied", ()) for name in tie.names[1:]}
    names: dict[int, list[str]] = {}
    params: dict[int, Tensor] = {}
    for name, p in pl_module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        params[id(p)] = p
    local = sum(params[i].numel() for i, ns in names.items() if not set(ns) <= later_uses)
    if layout is None or not (dist.is_available() and dist.is_initialized()):
        return local
    device = next((p.device for p in params.values() if p.device.type != "meta"), torch.device("cpu"))
    total = torch.tensor([local], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return int(total.item()) // max(replicas, 1)


def attention_shape(pl_module: pl.LightningModule) -> tuple[int, int] | None:
    """``(layers, width)`` for the attention FLOPs: the recipes' ``n_layer`` / ``n_embd`` hyper-parameters, or a
    transformers config's ``num_hidden_layers`` / ``hidden_size``; None when the model exposes neither."""
    hp = getattr(pl_module, "hparams", {}) or {}
    if "n_layer" in hp and "n_embd" in hp:
        return int(hp["n_layer"]), int(hp["n_embd"])
    config = getattr(pl_module, "hf_config", None)
    if config is not None and hasattr(config, "num_hidden_layers") and hasattr(config, "hidden_size"):
        return int(config.num_hidden_layers), int(config.hidden_size)
    return None


def flops_per_token(n_params: int, attention: tuple[int, int] | None, seq_len: int | None) -> float:
    """Training FLOPs per token: ``6 N`` (forward + backward matmuls) + ``12 L C T`` (attention scores and values,
    when the shape is known), as in the PaLM paper's MFU and nanoGPT's estimate."""
    flops = 6.0 * n_params
    if attention is not None and seq_len is not None:
        layers, width = attention
        flops += 12.0 * layers * width * seq_len
    return flops


class TokensPerSecond(pl.Callback):
    """Log training throughput: ``tokens_per_s`` = batch tokens x data-parallel replicas / step time; model
    ``tflops_per_s`` = FLOPs per token x tokens/s; and ``mfu`` = that / (peak x devices) when a peak is known.

    Step time is measured from ``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward and
    optimizer step of the whole pipeline schedule; data loading and validation excluded). The first
    ``skip_steps`` steps (warm-up, shape inference) are left out of the run averages.

    Args:
        skip_steps: steps left out of ``mean_tokens_per_s`` / ``mean_mfu``.
        peak_tflops: the peak of ONE device for the precision you train in; default: the bf16 dense peak of a known
            GPU (``PEAK_TFLOPS``, by ``torch.cuda.get_device_name``), none on CPU (then ``mfu`` is not logged).
    """

    def __init__(self, skip_steps: int = 2, peak_tflops: float | None = None) -> None:
        super().__init__()
        self.skip_steps = skip_steps
        self.peak_tflops = peak_tflops
        self.n_params: int | None = None
        self.flops_per_token: float | None = None
        self._attention: tuple[int, int] | None = None
        self._devices = 1
        self._t0 = 0.0
        self._steps = 0
        self._tokens = 0
        self._flops = 0.0
        self._seconds = 0.0

    @property
    def mean_tokens_per_s(self) -> float:
        return self._tokens / self._seconds if self._seconds > 0 else float("nan")

    @property
    def mean_tflops_per_s(self) -> float:
        return self._flops / self._seconds / 1e12 if self._seconds > 0 else float("nan")

    @property
    def mean_mfu(self) -> float:
        peak = self.peak_tflops
        return self.mean_tflops_per_s / (peak * self._devices) if peak else float("nan")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # On every rank: a collective under the pipeline.
        self.n_params = model_parameter_count(pl_module, data_parallel_replicas(trainer))
        self._attention = attention_shape(pl_module)
        self._devices = int(getattr(trainer, "world_size", 1) or 1)
        if self.peak_tflops is None and pl_module.device.type == "cuda":
            self.peak_tflops = known_peak_tflops(torch.cuda.get_device_name(pl_module.device))

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        seconds = max(time.perf_counter() - self._t0, 1e-9)
        tokens = batch_tokens(batch) * data_parallel_replicas(trainer)
        flops = 0.0
        if self.n_params is not None:
            self.flops_per_token = flops_per_token(self.n_params, self._attention, _sequence_length(batch))
            flops = self.flops_per_token * tokens
        self._steps += 1
        if self._steps > self.skip_steps:
            self._tokens += tokens
            self._flops += flops
            self._seconds += seconds
        # Not synced: every rank measured the same step; rank 0's value is the one the loggers keep.
        log = {"tokens_per_s": tokens / seconds}
        if flops:
            log["tflops_per_s"] = flops / seconds / 1e12
            if self.peak_tflops:
                log["mfu"] = log["tflops_per_s"] / (self.peak_tflops * self._devices)
        for name, value in log.items():
            pl_module.log(name, value, prog_bar=name != "tflops_per_s", on_step=True, on_epoch=False)
