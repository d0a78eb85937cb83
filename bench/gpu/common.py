"""What every case of the GPU check shares: the models, their data, the device, timing, FLOPs, the sync counter and
the profiler. Imported inside the case processes (torch and Lightning are loaded there, never in the driver)."""

from __future__ import annotations

import contextlib
import gzip
import json
import time
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

REPO = Path(__file__).resolve().parents[2]
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4}  # dense bf16 tensor-core peak (SXM datasheet)


@dataclass(frozen=True)
class ModelSpec:
    """One model of the check: the recipe class, its settings, and the batch the speed cases run."""

    recipe: str  # "gpt" (recipes.gpt.model.GPT) or "llama" (recipes.llama.model.Llama)
    kwargs: dict[str, Any]
    microbatches: int  # m: micro-batches per step (pipeline, a2, a3)
    microbatch_size: int  # sequences per micro-batch (block_size tokens each)
    lr: float = 6e-4
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1

    @property
    def batch(self) -> int:
        return self.microbatches * self.microbatch_size

    @property
    def block_size(self) -> int:
        return int(self.kwargs["block_size"])


# configs/model/gpt2_124m.yaml and configs/model/llama_1b.yaml, written out (no Hydra on the GPU machine): the speed
# cases run micro-batches of 4 sequences (GPT-2: 4 x 1024 tokens; Llama: 4 x 2048), 16384 tokens a step for both.
GPT2_124M = dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768, dropout=0.0, bias=True)
LLAMA_1B = dict(vocab_size=50304, block_size=2048, n_layer=22, n_head=32, n_kv_head=4, n_embd=2048, multiple_of=256,
                rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False, init_seed=0)
TINY_GPT = dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64, dropout=0.0, bias=True)
TINY_LLAMA = dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, multiple_of=32,
                  rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False, init_seed=0)

MODELS: dict[str, ModelSpec] = {
    "gpt2_124m": ModelSpec("gpt", GPT2_124M, microbatches=4, microbatch_size=4),
    "llama_1b": ModelSpec("llama", LLAMA_1B, microbatches=2, microbatch_size=4, lr=4e-4),
    # parity: GPT-2 124M, 4 micro-batches of 2 sequences, the config's peak learning rate from the first step
    "gpt2_124m_parity": ModelSpec("gpt", GPT2_124M, microbatches=4, microbatch_size=2),
}
SMOKE_MODELS: dict[str, ModelSpec] = {
    "gpt2_124m": ModelSpec("gpt", TINY_GPT, microbatches=4, microbatch_size=2),
    "llama_1b": ModelSpec("llama", TINY_LLAMA, microbatches=2, microbatch_size=2, lr=4e-4),
    "gpt2_124m_parity": ModelSpec("gpt", TINY_GPT, microbatches=4, microbatch_size=2),
}


def model_spec(name: str, smoke: bool) -> ModelSpec:
    return (SMOKE_MODELS if smoke else MODELS)[name]


def build_model(spec: ModelSpec, max_steps: int) -> Any:
    """The recipe's module with ``spec``'s settings; no warm-up (the check runs a handful of steps).

    The Llama recipe builds its layers in ``configure_model`` (meta device under the pipeline): the plain loops call
    it themselves, Lightning calls it under either strategy. Seeded, so every case starts from the same weights."""
    torch.manual_seed(0)
    common = dict(lr=spec.lr, weight_decay=spec.weight_decay, betas=spec.betas, warmup_steps=0, max_steps=max_steps)
    if spec.recipe == "gpt":
        from recipes.gpt.model import GPT

        return GPT(**spec.kwargs, **common)
    from recipes.llama.model import Llama

    return Llama(**spec.kwargs, **common)


def materialized(model: Any) -> Any:
    """The whole model on the host, for the loops that run it without Lightning."""
    if hasattr(model, "configure_model"):
        model.configure_model()  # the GPT recipe's is Lightning's no-op; the Llama recipe's builds the layers
    return model


def loader(spec: ModelSpec, steps: int, batch: int | None = None, seed: int = 1234) -> DataLoader:
    """``steps`` batches of random tokens (inputs, next-token targets), in order: every case sees the same ones."""
    g = torch.Generator().manual_seed(seed)
    batch = batch or spec.batch
    tokens = torch.randint(0, int(spec.kwargs["vocab_size"]), (steps * batch, spec.block_size + 1), generator=g)
    data = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    return DataLoader(data, batch_size=batch, shuffle=False, drop_last=True)


def device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def flops_per_token(model: Any, spec: ModelSpec) -> tuple[int, int]:
    """(N, 6 N + 12 L C T): nanoGPT's estimate_mfu (PaLM appendix B): 6 N for the matmuls forward and backward,
    12 L C T for attention scores and values (full, not causal). N counts every parameter object once, without the
    lookups that are no matmul: GPT's position embedding (its token embedding is the tied head: counted), Llama's
    untied token embedding (its head counts)."""
    seen: set[int] = set()
    n = 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        lookup = name.endswith("wpe.weight") or (name.endswith("tok_embeddings.weight")
                                                 and not spec.kwargs.get("tie_embeddings", False))
        n += 0 if lookup else p.numel()
    kw = spec.kwargs
    return n, 6 * n + 12 * kw["n_layer"] * kw["n_embd"] * kw["block_size"]


def peak_tflops(device_name: str) -> float | None:
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in device_name), None)


def fp32_exact() -> None:
    """fp32 parity: no TF32 in matmuls or convolutions (Lightning leaves the default alone)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


class Window:
    """Wall time over a window of steps, the device synchronised at both ends (CUDA work is asynchronous)."""

    def __init__(self, dev: torch.device, warmup: int, steps: int) -> None:
        self.dev, self.warmup, self.steps = dev, warmup, steps
        self.t0: float | None = None
        self.t1: float | None = None

    def step_done(self, finished: int) -> None:
        """Call after each step with the number of steps finished so far."""
        if finished == self.warmup:
            sync(self.dev)
            self.t0 = time.perf_counter()
        elif finished == self.warmup + self.steps:
            sync(self.dev)
            self.t1 = time.perf_counter()

    @property
    def seconds(self) -> float:
        if self.t0 is None or self.t1 is None:
            raise RuntimeError(f"the timed window did not close (warm-up {self.warmup}, steps {self.steps})")
        return self.t1 - self.t0


# ------------------------------------------------------------------------------------------------- syncs
SYNC_MESSAGE = "synchronizing CUDA operation"  # c10/cuda: TORCH_WARN("called a synchronizing CUDA operation")


def _short(filename: str) -> str:
    """A path relative to the repository, or from ``torch/`` / ``lightning/`` on for installed packages."""
    path = Path(filename)
    with contextlib.suppress(ValueError):
        return str(path.resolve().relative_to(REPO))
    parts = path.parts
    for anchor in ("torch", "lightning", "lightning_pipe"):
        if anchor in parts:
            return str(Path(*parts[len(parts) - 1 - parts[::-1].index(anchor):]))
    return path.name


class SyncCounter:
    """Counts host-device syncs with ``torch.cuda.set_sync_debug_mode("warn")`` and names each one's site.

    CUDA reports each sync as a warning at the Python line that made the call (autograd replays its threads'
    warnings at ``backward``). The warning is caught while it is shown, where the whole Python stack is still there:
    the site is the innermost frame of our code (``lightning_pipe/``, ``bench/``, ``recipes/``), and the sync counts
    as *inside the schedule* when torch.distributed.pipelining is on the stack. Without CUDA (``--smoke``) nothing
    is reported and ``mode`` says so; any other warning passes on as usual."""

    OURS = ("lightning_pipe/", "bench/", "recipes/")

    def __init__(self, dev: torch.device) -> None:
        self.dev = dev
        self.available = dev.type == "cuda" and hasattr(torch.cuda, "set_sync_debug_mode")
        self.mode = "warn" if self.available else f"unavailable on {dev.type}"
        self.events: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        with warnings.catch_warnings():
            warnings.simplefilter("always")  # every occurrence, not once per line
            shown = warnings.showwarning

            def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None,
                     line: Any = None) -> None:
                if SYNC_MESSAGE in str(message):
                    self.record(traceback.extract_stack()[:-1], filename, lineno)
                else:
                    shown(message, category, filename, lineno, file, line)

            warnings.showwarning = show
            if self.available:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                if self.available:  # off before anything else: a synchronize here would count too
                    torch.cuda.set_sync_debug_mode(0)

    def record(self, stack: list[traceback.FrameSummary], filename: str, lineno: int) -> None:
        frames = [f for f in stack if "/warnings.py" not in f.filename]
        ours = [f for f in frames if _short(f.filename).startswith(self.OURS)
                and not _short(f.filename).startswith("bench/gpu/")]  # the check's own harness is not a site
        site = ours[-1] if ours else None
        self.events.append({
            "site": f"{_short(site.filename)}:{site.lineno}" if site else None,
            "code": (site.line or "").strip() if site else None,
            "function": site.name if site else None,
            "innermost": f"{_short(filename)}:{lineno}",
            "in_schedule": any("torch/distributed/pipelining/" in f.filename.replace("\\", "/") for f in frames),
        })

    def summary(self, steps: int) -> dict[str, Any]:
        sites: dict[str, dict[str, Any]] = {}
        for e in self.events:
            key = f"{e['site']} <- {e['innermost']}"
            entry = sites.setdefault(key, {"count": 0, "in_schedule": e["in_schedule"], "code": e["code"],
                                           "function": e["function"]})
            entry["count"] += 1
        inside = sum(e["in_schedule"] for e in self.events)
        return {"mode": self.mode, "steps": steps, "per_step": len(self.events) / max(1, steps),
                "in_schedule_per_step": inside / max(1, steps),
                "sites": dict(sorted(sites.items(), key=lambda kv: -kv[1]["count"]))}


# ------------------------------------------------------------------------------------------------- profiler
class StepProfiler:
    """``torch.profiler`` around one step (CPU, and CUDA where there is one); the trace is written gzip-compressed
    (``chrome://tracing`` and Perfetto read it as it is)."""

    def __init__(self, dev: torch.device, path: Path | None) -> None:
        self.dev, self.path = dev, path
        self.prof: Any = None

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.dev.type == "cuda" else [])
        self.prof = profile(activities=activities)
        self.prof.start()

    def stop(self) -> dict[str, Any]:
        sync(self.dev)
        self.prof.stop()
        out: dict[str, Any] = {"events": len(self.prof.events())}
        if self.path is not None:
            plain = self.path.with_suffix("")  # trace_x.json.gz -> trace_x.json, compressed below
            self.prof.export_chrome_trace(str(plain))
            with open(plain, "rb") as src, gzip.open(self.path, "wb", compresslevel=6) as dst:
                dst.write(src.read())
            plain.unlink()
            out["trace"] = self.path.name
            out["trace_bytes"] = self.path.stat().st_size
        return out


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1, default=str))
