"""One case of the GPU check, in its own process: run it, write its result JSON (also when it fails or is refused)."""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import sys
import traceback
from importlib import metadata
from pathlib import Path
from typing import Any


def environment() -> dict[str, Any]:
    """What ran: versions, the device, whether the library imports, and which optional packages are there."""
    import torch

    from bench.gpu.common import device, peak_tflops

    dev = device()
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    info: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
                            "device": name, "peak_bf16_tflops": peak_tflops(name)}
    if dev.type == "cuda":
        try:
            version = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception as err:
            info["nccl"] = f"unknown: {err}"
    for module in ("lightning", "lightning_pipe", "recipes.gpt.model", "recipes.llama.model"):
        try:  # the library names a private torch name it misses here
            info[module] = getattr(importlib.import_module(module), "__version__", "imports")
        except Exception as err:
            info[module] = f"import failed: {type(err).__name__}: {err}"
    for dist, module in (("transformers", "transformers"), ("hydra-core", "hydra"), ("omegaconf", "omegaconf")):
        try:  # installed or not, importable or not: the check needs none of them
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = None
        try:
            info[f"{module}_importable"] = importlib.util.find_spec(module) is not None
        except ImportError:
            info[f"{module}_importable"] = False
    return info


def run_child(args: argparse.Namespace) -> int:
    from bench.gpu.driver import CASES

    out: dict[str, Any] = {"case": args.case, "status": "failed"}
    schedule = None
    try:
        if args.case == "env":
            out.update(environment())
            out["status"] = "ok"
            return 0
        import torch

        from bench.gpu import cases
        from bench.gpu.common import device, model_spec

        kind, model, what, _ = CASES[args.case]
        dev = device()
        out.update(what=what, device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        torch.set_float32_matmul_precision("high")  # the speed cases run bf16; parity's fp32 turns TF32 off
        ctx = cases.Ctx(model_spec(model, args.smoke), dev, args.warmup, args.steps, args.smoke,
                        Path(args.trace) if args.trace else None)
        out["model"] = {"name": model, **ctx.spec.kwargs, "microbatches": ctx.spec.microbatches,
                        "microbatch_size": ctx.spec.microbatch_size, "batch": ctx.spec.batch}
        if kind.startswith("parity:"):
            _, schedule, precision, *offload = kind.split(":")
            out.update(cases.run_parity(ctx, schedule, precision, *offload))
        elif kind in ("a", "a2"):
            out.update(cases.run_plain(ctx, accumulate=kind == "a2"))
        elif kind == "a3":
            out.update(cases.run_torch_pipeline(ctx))
        elif kind == "c":
            out.update(cases.run_lightning_pipeline(ctx))
        elif kind == "c_offload":
            out.update(cases.run_lightning_pipeline(ctx, offload="all"))
        elif kind == "c_compile":
            out.update(cases.run_lightning_pipeline(ctx, compile=True))
        else:
            raise ValueError(f"unknown case kind {kind!r}")
        out["status"] = "ok"
    except BaseException as err:  # recorded, never raised: the driver reads the JSON
        from bench.gpu.cases import refusal

        out["error"] = f"{type(err).__name__}: {err}"
        out["traceback"] = traceback.format_exc()
        out["status"] = "refused" if refusal(err, schedule) else "failed"
        print(out["traceback"], file=sys.stderr, flush=True)
    finally:
        Path(args.result).write_text(json.dumps(out, indent=1, default=str))
        gc.collect()
    return 0
