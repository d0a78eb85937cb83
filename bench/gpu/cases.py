"""The cases of the GPU check, each run in a process of its own by the driver (``python -m bench.gpu --case NAME``).

Speed (bf16 autocast / bf16-mixed, the same model, batches and optimizer — the module's own AdamW and LR
schedule — in every case; ``m`` micro-batches of ``microbatch_size`` sequences make one step's batch):

    a   plain torch loop, the whole batch per forward/backward
    a2  plain torch loop, gradient accumulation over the m micro-batches (the pipeline's micro-batch size)
    a3  torch.distributed.pipelining by hand: 2 PipelineStages on this rank, ScheduleInterleaved1F1B, m micro-batches
    c   PipelineStrategy via a Lightning Trainer: 1 rank x 2 stages, interleaved_1f1b, m micro-batches
    c_offload  c with offload="all": every layer's saved activations in pinned host memory (peak memory, step time)
    c_compile  c with compile=True: each layer through torch.compile (GPT only; compiling happens in the warm-up,
               whose first step is reported as first_step_s)

After the timed steps, each case runs one more step counting host-device syncs, and a3 / c one more under
``torch.profiler`` (the trace goes next to the results).

Parity (5 steps, then every parameter against one device): Lightning on one device (strategy "auto") vs
PipelineStrategy with 1 rank x 2 stages (interleaved_1f1b, or zbv where the torch allows split backward), the same
module, the same batches in the same order (``use_distributed_sampler=False``), fp32 with TF32 off or bf16-mixed.
"""

from __future__ import annotations

import inspect
import re
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.gpu.common import (
    ModelSpec,
    StepProfiler,
    SyncCounter,
    Window,
    build_model,
    flops_per_token,
    fp32_exact,
    loader,
    materialized,
)

# fp32 (TF32 off): 1e-5 as the repository's parity tests. bf16-mixed: 2 bf16 ulps of a parameter |p| < 1
# (tests/distributed/test_precision.py: micro-batches round differently from the whole batch) -- but AdamW moves an
# element by about lr a step whatever its gradient's size, so where a gradient near zero changes sign under rounding
# the element moves apart by up to 2 lr a step: a bound on every element alone cannot tell rounding from a wrong
# gradient. bf16 also needs the whole difference small against the whole update: |p - q| / |q - q0| (norms over all
# parameters) <= 0.1 (a missing or doubled gradient anywhere gives about 1; rounding gave 0.02 on the CPU).
PARITY_ATOL = {"32-true": 1e-5, "bf16-mixed": 2 * 2**-8}
PARITY_BF16_NORM_RATIO = 0.1
PARITY_STEPS = 5


class Ctx:
    """What a case gets from the driver: the model, its step counts, the device, where traces go, smoke or not."""

    def __init__(self, spec: ModelSpec, dev: torch.device, warmup: int, steps: int, smoke: bool,
                 trace: Path | None) -> None:
        self.spec, self.dev, self.warmup, self.steps, self.smoke, self.trace = spec, dev, warmup, steps, smoke, trace

    @property
    def total(self) -> int:  # timed window, then one step counting syncs, then one under the profiler
        return self.warmup + self.steps + 2


def _optimizer(model: Any) -> tuple[Any, Any]:
    conf = model.configure_optimizers()
    return conf["optimizer"], conf["lr_scheduler"]["scheduler"]


def _finish(out: dict[str, Any], ctx: Ctx, model: Any, window: Window, losses: list[Any],
            counter: SyncCounter) -> dict[str, Any]:
    n, fpt = flops_per_token(model, ctx.spec)
    tokens = ctx.steps * ctx.spec.batch * ctx.spec.block_size
    seconds = window.seconds
    out.update(seconds=seconds, tokens=tokens, tokens_per_s=tokens / seconds, step_ms=seconds / ctx.steps * 1e3,
               ms_per_microbatch=seconds / ctx.steps / ctx.spec.microbatches * 1e3, params_counted=n,
               flops_per_token=fpt, tflops=fpt * tokens / seconds / 1e12,
               loss_first_last=[float(losses[0]), float(losses[-1])] if losses else None,
               syncs=counter.summary(1))
    if ctx.dev.type == "cuda":
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated(ctx.dev) / 2**30
    return out


def _loop(ctx: Ctx, model: Any, step: Any, profile: bool) -> tuple[Window, list[Any], SyncCounter, dict[str, Any]]:
    """Run ``step(x, y) -> loss`` for every batch: warm-up, the timed window, a sync-counted step, a profiled one."""
    window, counter = Window(ctx.dev, ctx.warmup, ctx.steps), SyncCounter(ctx.dev)
    profiler = StepProfiler(ctx.dev, ctx.trace) if profile else None
    losses: list[Any] = []
    extra: dict[str, Any] = {}
    for i, (x, y) in enumerate(loader(ctx.spec, ctx.total)):
        counted, profiled = i == ctx.warmup + ctx.steps, i == ctx.warmup + ctx.steps + 1
        if profiled and profiler is None:
            break
        if profiled and profiler is not None:
            profiler.start()
        if counted:
            with counter.counting():
                loss = step(x.to(ctx.dev, non_blocking=True), y.to(ctx.dev, non_blocking=True))
        else:
            loss = step(x.to(ctx.dev, non_blocking=True), y.to(ctx.dev, non_blocking=True))
        losses.append(loss.detach())
        if profiled and profiler is not None:
            extra["profile"] = profiler.stop()
        window.step_done(i + 1)
    return window, losses[:ctx.warmup + ctx.steps], counter, extra


# ------------------------------------------------------------------------------------------------- a, a2
def run_plain(ctx: Ctx, accumulate: bool) -> dict[str, Any]:
    model = materialized(build_model(ctx.spec, ctx.total)).to(ctx.dev)
    model.train()
    optimizer, scheduler = _optimizer(model)
    m = ctx.spec.microbatches if accumulate else 1

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        total = torch.zeros((), device=ctx.dev)
        for xi, yi in zip(x.chunk(m), y.chunk(m)):
            with torch.autocast(ctx.dev.type, dtype=torch.bfloat16):
                loss = model.compute_loss((xi, yi)) / m
            loss.backward()
            total += loss.detach()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    window, losses, counter, _ = _loop(ctx, model, step, profile=False)
    return _finish({"microbatches_per_step": m}, ctx, model, window, losses, counter)


# ------------------------------------------------------------------------------------------------- a3
class _Autocast(nn.Module):
    """A stage module under bf16 autocast, as PipelinePrecision runs each stage's forward (no weight-cast cache)."""

    def __init__(self, inner: nn.Module, device_type: str) -> None:
        super().__init__()
        self.inner, self.device_type = inner, device_type

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device_type, dtype=torch.bfloat16, cache_enabled=False):
            return self.inner(x)


def _init_world(dev: torch.device) -> str:
    """A one-rank default process group: NCCL on CUDA, gloo on CPU (an in-process store: no port)."""
    import torch.distributed as dist

    backend = "nccl" if dev.type == "cuda" else "gloo"
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"device_id": dev} if dev.type == "cuda" else {}
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    return backend


def run_torch_pipeline(ctx: Ctx) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    backend = _init_world(ctx.dev)
    model = materialized(build_model(ctx.spec, ctx.total)).to(ctx.dev)
    model.train()
    optimizer, scheduler = _optimizer(model)
    layers, m = list(model.layers), ctx.spec.microbatches
    cut = (len(layers) + 1) // 2  # as PipelineStrategy's partition="uniform": the first stage takes the odd layer
    stages = [PipelineStage(_Autocast(nn.Sequential(*part), ctx.dev.type), i, 2, ctx.dev, group=dist.group.WORLD)
              for i, part in enumerate((layers[:cut], layers[cut:]))]
    own_scaling = "scale_grads" in inspect.signature(ScheduleInterleaved1F1B).parameters
    scale = 1.0 / m if own_scaling else 1.0  # else torch divides the gradients by m itself

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        with torch.autocast(ctx.dev.type, dtype=torch.bfloat16, cache_enabled=False):
            return model.loss_fn(output, target) * scale

    kwargs = {"scale_grads": False} if own_scaling else {}
    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=loss_fn, **kwargs)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        schedule.step(x, target=y, losses=losses)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return torch.stack([loss.detach() for loss in losses]).sum() / (scale * m)

    window, losses, counter, extra = _loop(ctx, model, step, profile=True)
    out = {"backend": backend, "split": [cut, len(layers) - cut], "microbatches_per_step": m, **extra}
    return _finish(out, ctx, model, window, losses, counter)


# ------------------------------------------------------------------------------------------------- c
def _trainer(ctx: Ctx, strategy: Any, precision: str, max_steps: int, callbacks: list[Any]) -> Any:
    import lightning.pytorch as L

    return L.Trainer(strategy=strategy, accelerator="gpu" if ctx.dev.type == "cuda" else "cpu", devices=1,
                     precision=precision, max_steps=max_steps, max_epochs=1, use_distributed_sampler=False,
                     enable_checkpointing=False, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks)


def _pipeline(schedule: str, m: int, offload: str = "none", compile: bool = False) -> Any:
    from lightning_pipe import PipelineStrategy

    return PipelineStrategy(schedule=schedule, microbatches=m, stages_per_rank=2, offload=offload, compile=compile)


def _hooks(ctx: Ctx, window: Window, counter: SyncCounter, profiler: StepProfiler | None) -> Any:
    from lightning.pytorch.callbacks import Callback

    counted, profiled = ctx.warmup + ctx.steps, ctx.warmup + ctx.steps + 1

    class Hooks(Callback):
        """Times the window, counts syncs over one whole training step, profiles the next."""

        def __init__(self) -> None:
            self.losses: list[Any] = []
            self.profile: dict[str, Any] | None = None
            self._counting: Any = None
            self.host_bytes = 0
            self.first_step_s: float | None = None  # the first step, warm-up included (compile=True: compiling)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:  # what offload held in host memory, at most
            self.host_bytes = sum(sm.offload_stats.peak_bytes for sm in trainer.strategy.engine.stage_modules)

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 0:
                self.first_step_s = -time.perf_counter()
            if batch_idx == counted:
                self._counting = counter.counting()
                self._counting.__enter__()
            elif batch_idx == profiled and profiler is not None:
                profiler.start()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 0 and self.first_step_s is not None:
                if ctx.dev.type == "cuda":
                    torch.cuda.synchronize(ctx.dev)  # first step only, outside the timed window
                self.first_step_s += time.perf_counter()
            if batch_idx == counted:
                self._counting.__exit__(None, None, None)
            elif batch_idx == profiled and profiler is not None:
                self.profile = profiler.stop()
            if batch_idx < counted:
                loss = outputs["loss"] if isinstance(outputs, dict) else outputs
                self.losses.append(loss.detach())
            window.step_done(batch_idx + 1)

    return Hooks()


def run_lightning_pipeline(ctx: Ctx, offload: str = "none", compile: bool = False) -> dict[str, Any]:
    window, counter = Window(ctx.dev, ctx.warmup, ctx.steps), SyncCounter(ctx.dev)
    plain = offload == "none" and not compile
    hooks = _hooks(ctx, window, counter, StepProfiler(ctx.dev, ctx.trace) if plain else None)
    model = build_model(ctx.spec, ctx.total)
    strategy = _pipeline("interleaved_1f1b", ctx.spec.microbatches, offload, compile)
    trainer = _trainer(ctx, strategy, "bf16-mixed", ctx.total, [hooks])
    trainer.fit(model, train_dataloaders=loader(ctx.spec, ctx.total))
    if trainer.global_step != ctx.total:
        raise RuntimeError(f"ran {trainer.global_step} optimizer steps, expected {ctx.total}")
    out = {"backend": strategy.process_group_backend, "microbatches_per_step": ctx.spec.microbatches,
           "precision": str(trainer.precision_plugin.precision), "profile": hooks.profile, "offload": offload,
           "offload_host_peak_gib": hooks.host_bytes / 2**30, "compile": compile, "first_step_s": hooks.first_step_s}
    plan = getattr(strategy, "plan", None)
    if plan is not None:
        out["plan"] = {"schedule": plan.spec.name, "p": plan.pipeline_size, "v": plan.stages_per_rank,
                       "m": plan.microbatches}
    return _finish(out, ctx, model, window, hooks.losses, counter)


# ------------------------------------------------------------------------------------------------- parity
def _params(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def _losses() -> Any:
    from lightning.pytorch.callbacks import Callback

    class Losses(Callback):
        def __init__(self) -> None:
            self.values: list[float] = []

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.values.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))

    return Losses()


def run_parity(ctx: Ctx, schedule: str, precision: str, offload: str = "none") -> dict[str, Any]:
    """One device, then the pipeline, in this process (the same seeded weights); every parameter compared.
    ``offload="all"``: the pipeline's saved activations make the round trip through pinned host memory."""
    if precision == "32-true":
        fp32_exact()
    spec, steps = ctx.spec, PARITY_STEPS
    start = _params(materialized(build_model(spec, steps)))
    runs: dict[str, dict[str, Any]] = {}
    for name, strategy in (("one_device", "auto"), ("pipeline", _pipeline(schedule, spec.microbatches, offload))):
        model, losses = build_model(spec, steps), _losses()
        trainer = _trainer(ctx, strategy, precision, steps, [losses])
        trainer.fit(model, train_dataloaders=loader(spec, steps))
        if trainer.global_step != steps:
            raise RuntimeError(f"{name}: ran {trainer.global_step} optimizer steps, expected {steps}")
        runs[name] = {"params": _params(model), "losses": losses.values}
        if name == "pipeline":
            runs[name]["backend"] = strategy.process_group_backend
    want, got = runs["one_device"]["params"], runs["pipeline"]["params"]
    if sorted(want) != sorted(got):
        raise AssertionError(f"parameter names differ: {sorted(set(want) ^ set(got))}")
    atol = PARITY_ATOL[precision]
    abs_diff = {n: float((got[n] - want[n]).abs().max()) for n in want}
    # relative: per parameter tensor, max |p - q| / max |q|; and element by element (huge where q is near zero)
    rel_diff = {n: abs_diff[n] / max(float(want[n].abs().max()), 1e-30) for n in want}
    elementwise = max(float(((got[n] - want[n]).abs() / want[n].abs().clamp_min(1e-30)).max()) for n in want)
    moved = max(float((want[n] - start[n]).abs().max()) for n in want)
    diff_sq = sum(float((got[n] - want[n]).double().pow(2).sum()) for n in want)
    update_sq = sum(float((want[n] - start[n]).double().pow(2).sum()) for n in want)
    worst = max(abs_diff, key=lambda n: abs_diff[n])
    out: dict[str, Any] = {
        "schedule": schedule, "precision": precision, "offload": offload, "steps": steps, "backend": runs["pipeline"]["backend"],
        "tolerance": {"atol": atol, "rtol": 0.0}, "parameters": len(want),
        "max_abs_diff": abs_diff[worst], "max_abs_diff_param": worst, "max_rel_diff": max(rel_diff.values()),
        "max_elementwise_rel_diff": elementwise,
        "max_update": moved, "diff_norm_over_update_norm": (diff_sq / update_sq) ** 0.5 if update_sq else None,
        "losses": {k: v["losses"] for k, v in runs.items()},
        "tf32": torch.backends.cuda.matmul.allow_tf32 if ctx.dev.type == "cuda" else None}
    failures = []
    for n in want:
        try:
            torch.testing.assert_close(got[n], want[n], atol=atol, rtol=0.0)
        except AssertionError as err:
            failures.append(f"{n}: {str(err).splitlines()[0]} (max abs {abs_diff[n]:.3g})")
    ratio = out["diff_norm_over_update_norm"]
    if precision == "bf16-mixed":
        out["tolerance"]["diff_norm_over_update_norm"] = PARITY_BF16_NORM_RATIO
        if ratio is None or ratio > PARITY_BF16_NORM_RATIO:
            failures.append(f"|p - q| / |q - q0| = {ratio} > {PARITY_BF16_NORM_RATIO}")
    out["passed"] = not failures
    out["failures"] = failures[:10]
    return out


def refusal(err: BaseException, schedule: str | None) -> bool:
    """A split-backward schedule refused by the library on a torch that gets it wrong (< 2.13), not a crash."""
    if schedule not in ("zbv", "zb_h1", "dualpipev"):
        return False
    text = f"{type(err).__name__}: {err}"
    return bool(re.search(r"torch[^\n]{0,40}2\.1[0-9]", text))
