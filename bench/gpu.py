"""GPT-2 124M on one GPU: a plain torch loop, Lightning on one device, and PipelineStrategy on one rank.

One prepared script for a machine with a single GPU (issue #12, "GPU readiness"). One GPU cannot host two NCCL
ranks, so this checks what one rank can: the CUDA paths of the strategy, bf16 / fp16, several stages on one rank,
the timeline on CUDA events, and speed relative to a hand-written loop. Cases (all bf16-mixed unless stated):

    a  plain torch loop: the same GPT, AdamW (the module's own groups), torch.autocast bf16, the same batches
    b  Lightning, one device (strategy "auto")
    c  PipelineStrategy, 1 rank, 1 stage, 1F1B, 4 micro-batches
    c1 PipelineStrategy, 1 rank, 1 stage, GPipe, 1 micro-batch (the strategy's cost without micro-batching)
    d  PipelineStrategy, 1 rank, 2 stages on it: ZB-V (stages_per_rank=2), 4 micro-batches
    d2 as d with interleaved 1F1B (the other multi-stage runtime path)
    e  as c, precision 16-mixed (fp16 with the strategy's loss scaling)
    f  as c, with the PipelineTimeline callback (CUDA events) on every step after warm-up: measured bubble

The model is ``recipes.gpt.model.GPT`` with configs/model/gpt2_124m.yaml's settings (vocab 50304, block 1024,
12 layers, 12 heads, 768 wide, dropout 0, bias), built directly (no Hydra). Data: random tokens made at start-up.
Each case runs in its own process (a failure or a hang in one cannot take the others down) for ``warmup`` +
``steps`` optimizer steps; throughput is measured over the last ``steps`` (CUDA synchronised at both ends).
The pipeline cases see the same batches in another order: under a distributed strategy Lightning always gives the
training loader a shuffling DistributedSampler, so their losses are not step-for-step those of (a) and (b).

Model FLOPs per token = 6 N + 12 n_layer n_embd block_size (nanoGPT's estimate_mfu / PaLM appendix B: 6 N for the
matmuls' forward and backward, the second term for attention scores and values), N = parameters without the
position embedding (nanoGPT's non-embedding count; the token embedding counts once, as the tied output head).
TFLOP/s = FLOPs per token x tokens/s; MFU against 989 TFLOP/s (H100/H200 dense bf16) where the GPU is one of those.

    python bench/gpu.py [--out DIR] [--cases a,b,c] [--batch 8] [--warmup 5] [--steps 25]
    python bench/gpu.py --smoke          # the same code on CPU with a tiny GPT (tests the script itself)
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

GPT2_124M = dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768, dropout=0.0, bias=True)
TINY = dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64, dropout=0.0, bias=True)
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4}  # dense bf16/fp16 tensor-core peak (SXM)

# key: (description, runner, options)
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "a": ("plain torch loop, bf16 autocast", "plain", {}),
    "b": ("Lightning, 1 device, bf16-mixed", "lightning", {}),
    "c": ("PipelineStrategy 1 rank x 1 stage, 1f1b m=4, bf16-mixed", "pipeline",
          {"schedule": "1f1b", "microbatches": 4}),
    "c1": ("PipelineStrategy 1 rank x 1 stage, gpipe m=1, bf16-mixed", "pipeline",
           {"schedule": "gpipe", "microbatches": 1}),
    "d": ("PipelineStrategy 1 rank x 2 stages, zbv m=4, bf16-mixed", "pipeline",
          {"schedule": "zbv", "microbatches": 4, "stages_per_rank": 2}),
    "d2": ("PipelineStrategy 1 rank x 2 stages, interleaved_1f1b m=4, bf16-mixed", "pipeline",
           {"schedule": "interleaved_1f1b", "microbatches": 4, "stages_per_rank": 2}),
    "e": ("PipelineStrategy 1 rank x 1 stage, 1f1b m=4, 16-mixed", "pipeline",
          {"schedule": "1f1b", "microbatches": 4, "precision": "16-mixed"}),
    "f": ("as c + PipelineTimeline (CUDA events)", "pipeline",
          {"schedule": "1f1b", "microbatches": 4, "timeline": True}),
}


# ------------------------------------------------------------------------------------------------- in one case
def _model_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(TINY if args.smoke else GPT2_124M)


def _build_model(args: argparse.Namespace):
    import torch

    from recipes.gpt.model import GPT

    torch.manual_seed(0)
    # lr / warm-up as in the recipe's gpt2_124m config; the schedule only changes the LR, not the cost of a step.
    return GPT(**_model_kwargs(args), lr=6e-4, weight_decay=0.1, betas=(0.9, 0.95), warmup_steps=2000,
               max_steps=args.warmup + args.steps)


def _loader(args: argparse.Namespace):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    kw = _model_kwargs(args)
    g = torch.Generator().manual_seed(1234)
    n = (args.warmup + args.steps) * args.batch
    tokens = torch.randint(0, kw["vocab_size"], (n, kw["block_size"] + 1), generator=g)
    return DataLoader(TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()),
                      batch_size=args.batch, shuffle=False, drop_last=True)


def _flops_per_token(model: Any, kw: dict[str, Any]) -> tuple[int, int]:
    seen: set[int] = set()
    n = 0
    for p in model.parameters():  # each Parameter object once (the tied head is the token embedding)
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    n -= model.layers[0].wpe.weight.numel()
    return n, 6 * n + 12 * kw["n_layer"] * kw["n_embd"] * kw["block_size"]


def _device():
    import torch

    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_plain(args: argparse.Namespace, opts: dict[str, Any], out: dict[str, Any]) -> float:
    import torch

    device = _device()
    model = _build_model(args).to(device)
    conf = model.configure_optimizers()
    optimizer, scheduler = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    dtype = torch.float16 if opts.get("precision") == "16-mixed" else torch.bfloat16
    model.train()
    total = args.warmup + args.steps
    t0 = t1 = None
    losses = []
    for i, (x, y) in enumerate(_loader(args)):
        if i >= total:
            break
        x, y = x.to(device), y.to(device)
        with torch.autocast(device.type, dtype=dtype):
            loss = model.loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if i == args.warmup - 1:
            _sync(device)
            t0 = time.perf_counter()
        if i == total - 1:
            _sync(device)
            t1 = time.perf_counter()
    out["loss_first_last"] = [float(losses[0]), float(losses[-1])]
    out["flops"] = _flops_per_token(model, _model_kwargs(args))
    return t1 - t0


class _Clock:
    """Lightning callback: synchronised timestamps at the end of the last warm-up step and of the last step."""

    def __new__(cls, warmup: int, total: int):
        from lightning.pytorch.callbacks import Callback

        class Clock(Callback):
            def __init__(self) -> None:
                self.t0 = self.t1 = self.loss_scale = None
                self.losses: list[float] = []

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
                if batch_idx in (0, total - 1) and isinstance(outputs, dict) and "loss" in outputs:
                    self.losses.append(float(outputs["loss"]))
                elif batch_idx in (0, total - 1) and outputs is not None and hasattr(outputs, "item"):
                    self.losses.append(float(outputs))
                if batch_idx == warmup - 1:
                    _sync(pl_module.device)
                    self.t0 = time.perf_counter()
                if batch_idx == total - 1:
                    _sync(pl_module.device)
                    self.t1 = time.perf_counter()
                    scaler = getattr(trainer.strategy.precision_plugin, "scaler", None)
                    if scaler is not None and hasattr(scaler, "get_scale"):
                        self.loss_scale = float(scaler.get_scale())

        return Clock()


def _timeline_class():
    from lightning_pipe import PipelineTimeline

    return PipelineTimeline


def run_lightning(args: argparse.Namespace, opts: dict[str, Any], out: dict[str, Any], pipeline: bool) -> float:
    import lightning.pytorch as L
    import torch

    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    total = args.warmup + args.steps
    model = _build_model(args)
    out["flops"] = _flops_per_token(model, _model_kwargs(args))
    clock = _Clock(args.warmup, total)
    callbacks = [clock]
    timeline = None
    if opts.get("timeline"):
        export = Path(args.result).with_suffix("") if args.export else None
        timeline = _timeline_class()(every_n_steps=1, warmup_steps=args.warmup, log=False, prog_bar=False,
                                     keep_steps=args.steps, export_dir=export)
        callbacks.append(timeline)
    if pipeline:
        import lightning_pipe

        strategy: Any = lightning_pipe.PipelineStrategy(
            schedule=opts["schedule"], microbatches=opts["microbatches"],
            stages_per_rank=opts.get("stages_per_rank"))
    else:
        strategy = "auto"
    accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    trainer = L.Trainer(strategy=strategy, accelerator=accelerator, devices=1,
                        precision=opts.get("precision", "bf16-mixed"), max_steps=total, max_epochs=1,
                        enable_checkpointing=False, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks)
    trainer.fit(model, train_dataloaders=_loader(args))
    if trainer.global_step != total:
        raise RuntimeError(f"ran {trainer.global_step} optimizer steps, expected {total}")
    out["loss_first_last"] = clock.losses
    # Lightning turns 16-mixed into bf16-mixed on CPU (with a warning): say what really ran
    out["precision"] = str(getattr(trainer.strategy.precision_plugin, "precision", "?"))
    out["precision_requested"] = opts.get("precision", "bf16-mixed")
    if pipeline:
        plan = getattr(trainer.strategy, "plan", None)
        if plan is not None:
            out["plan"] = {"schedule": plan.spec.name, "p": plan.pipeline_size, "v": plan.stages_per_rank,
                           "m": plan.microbatches}
    if clock.loss_scale is not None:
        out["loss_scale_at_end"] = clock.loss_scale
    if timeline is not None:
        out["timeline"] = _timeline_summary(timeline)
    return clock.t1 - clock.t0


def _timeline_summary(timeline: Any) -> dict[str, Any]:
    records = list(timeline.records)
    if not records:
        return {"recorded_steps": 0}
    per_kind: dict[str, float] = collections.defaultdict(float)
    for r in records:
        for s in r.slices:
            per_kind[s.kind] += (s.end_ns - s.start_ns) / 1e6 / len(records)
    bubbles = [r.bubble() for r in records]
    return {"recorded_steps": len(records), "bubble_mean": sum(bubbles) / len(bubbles),
            "bubble_min": min(bubbles), "bubble_max": max(bubbles), "bubble_last": timeline.last_bubble,
            "bubble_theory": timeline._meta.get("theoretical_bubble"),
            "schedule_step_ms_mean": sum(r.wall_ns for r in records) / len(records) / 1e6,
            "busy_ms_mean": sum(r.busy_ns() for r in records) / len(records) / 1e6,
            "ms_per_step_by_kind": {k: round(v, 3) for k, v in sorted(per_kind.items())}}


def run_case(args: argparse.Namespace) -> None:
    """Child process: run one case, write its result JSON to ``args.result`` (also on failure)."""
    import torch

    description, runner, opts = CASES[args.case]
    out: dict[str, Any] = {"case": args.case, "description": description, "ok": False}
    device = _device()
    out["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    torch.set_float32_matmul_precision("high")  # the same in every case (Lightning asks for it on tensor cores)
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        if runner == "plain":
            seconds = run_plain(args, opts, out)
        else:
            seconds = run_lightning(args, opts, out, pipeline=runner == "pipeline")
        tokens = args.steps * args.batch * _model_kwargs(args)["block_size"]
        n, fpt = out.pop("flops")
        out.update(ok=True, seconds=seconds, tokens=tokens, tokens_per_s=tokens / seconds,
                   step_ms=seconds / args.steps * 1e3, params_non_embedding=n, flops_per_token=fpt,
                   tflops=fpt * tokens / seconds / 1e12)
        if device.type == "cuda":
            out["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    except BaseException as err:
        out.pop("flops", None)
        out["error"] = f"{type(err).__name__}: {err}"
        out["traceback"] = traceback.format_exc()
        print(out["traceback"], file=sys.stderr, flush=True)
    finally:
        Path(args.result).write_text(json.dumps(out, indent=1, default=str))
        gc.collect()


# ------------------------------------------------------------------------------------------------- the driver
def _stream(cmd: list[str], timeout: float, env: dict[str, str]) -> tuple[int, list[str]]:
    """Run ``cmd``, echoing its output with a prefix; kill it (its process group) after ``timeout`` seconds."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=str(REPO), start_new_session=True)
    tail: collections.deque[str] = collections.deque(maxlen=40)
    killed = []

    def kill() -> None:
        killed.append(True)
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass

    timer = threading.Timer(timeout, kill)
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip())
            print(f"    | {line.rstrip()}", flush=True)
        rc = proc.wait()
    finally:
        timer.cancel()
    if killed:
        tail.append(f"killed after {timeout:.0f} s (--case-timeout)")
        rc = 124
    return rc, list(tail)


def _environment() -> dict[str, Any]:
    info: dict[str, Any] = {"python": sys.version.split()[0]}
    try:
        import torch

        info.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    except Exception as err:
        info["torch_error"] = repr(err)
    try:
        import lightning

        info["lightning"] = lightning.__version__
    except Exception as err:
        info["lightning_error"] = repr(err)
    try:  # lightning_pipe resolves every private torch / Lightning name at import: a missing one is named here
        from lightning_pipe._compat import lightning as compat_lightning
        from lightning_pipe._compat import torch as compat_torch

        info["compat_versions_checked"] = {"torch": compat_torch.versions_checked(),
                                           "lightning": compat_lightning.versions_checked()}
        info["compat_checked_on"] = {"torch": list(compat_torch.CHECKED_TORCH),
                                     "lightning": list(compat_lightning.CHECKED_LIGHTNING)}
    except Exception as err:
        info["compat_error"] = f"{type(err).__name__}: {err}"
    return info


def _fmt(value: Any, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _table(results: list[dict[str, Any]], peak: float | None) -> str:
    base = next((r for r in results if r["case"] == "a" and r.get("ok")), None)
    head = "| case | what | tokens/s | TFLOP/s | MFU | ratio to (a) | step ms | peak GiB | bubble |"
    rows = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in results:
        if not r.get("ok"):
            rows.append(f"| {r['case']} | {r['description']} | FAILED: {r.get('error', '?')[:160]} "
                        "| | | | | | |")
            continue
        ratio = r["tokens_per_s"] / base["tokens_per_s"] if base else None
        mfu = r["tflops"] / peak if peak else None
        bubble = (r.get("timeline") or {}).get("bubble_mean")
        what = r["description"]
        if r.get("precision") and r["precision"] != r.get("precision_requested", r["precision"]):
            what += f" [ran as {r['precision']}]"  # Lightning turns 16-mixed into bf16-mixed on CPU
        rows.append(f"| {r['case']} | {what} | {r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | "
                    f"{_fmt(mfu, '.1%')} | {_fmt(ratio, '.3f')} | {r['step_ms']:.1f} | "
                    f"{_fmt(r.get('peak_mem_gib'), '.1f')} | {_fmt(bubble, '.3f')} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny GPT on CPU, few steps: tests this script")
    p.add_argument("--out", help="directory for results.json (and the timeline's records/trace of case f)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {list(CASES)}")
    p.add_argument("--batch", type=int, default=8, help="sequences per batch (block_size tokens each)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5; smoke 2)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 25; smoke 3)")
    p.add_argument("--case-timeout", type=float, default=None, help="seconds per case (default 150; smoke 600)")
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--export", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.warmup = args.warmup if args.warmup is not None else (2 if args.smoke else 5)
    args.steps = args.steps if args.steps is not None else (3 if args.smoke else 25)
    if args.smoke and not args.case:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, even on a machine with a GPU
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    if args.case:
        run_case(args)
        return

    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        p.error(f"unknown case(s) {unknown}; known: {list(CASES)}")
    timeout = args.case_timeout or (600.0 if args.smoke else 150.0)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [x for x in env.get("PYTHONPATH", "").split(os.pathsep) if x])
    env.setdefault("PYTHONUNBUFFERED", "1")
    info = _environment()
    kw = _model_kwargs(args)
    print(f"environment: {json.dumps(info)}", flush=True)
    print(f"model: {kw}; batch {args.batch} x {kw['block_size']} tokens; {args.warmup} warm-up + {args.steps} "
          f"timed steps per case; {'smoke (CPU)' if args.smoke else 'GPU'}", flush=True)
    out_dir = Path(args.out) if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            result_file = (out_dir or Path(tmp)) / f"case_{case}.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--case", case, "--result", str(result_file),
                   "--batch", str(args.batch), "--warmup", str(args.warmup), "--steps", str(args.steps)]
            if args.smoke:
                cmd.append("--smoke")
            if out_dir:
                cmd.append("--export")
            print(f"\n== ({case}) {CASES[case][0]}", flush=True)
            t = time.perf_counter()
            rc, tail = _stream(cmd, timeout, env)
            try:
                result = json.loads(result_file.read_text())
            except (OSError, ValueError):
                result = {"case": case, "description": CASES[case][0], "ok": False,
                          "error": f"process exited {rc} without a result; last output: " + " / ".join(tail[-8:])}
            result["process_rc"], result["process_s"] = rc, round(time.perf_counter() - t, 1)
            if result.get("ok"):
                print(f"== ({case}) {result['tokens_per_s']:,.0f} tokens/s, {result['tflops']:.2f} TFLOP/s, "
                      f"{result['step_ms']:.1f} ms/step ({result['process_s']} s in all)", flush=True)
            else:
                print(f"== ({case}) FAILED: {result.get('error')}", flush=True)
            results.append(result)

    device = next((r.get("device") for r in results if r.get("device")), "?")
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in str(device)), None)
    flops = next((r for r in results if r.get("ok")), None)
    print(f"\n## {device}; torch {info.get('torch')} (CUDA {info.get('cuda')}), lightning {info.get('lightning')}; "
          f"{time.perf_counter() - started:.0f} s")
    if flops:
        print(f"FLOPs/token = 6N + 12*L*C*T = 6*{flops['params_non_embedding']:,} + 12*{kw['n_layer']}*"
              f"{kw['n_embd']}*{kw['block_size']} = {flops['flops_per_token']:,}"
              + (f"; MFU against {peak} TFLOP/s" if peak else ""))
    print(_table(results, peak))
    for r in results:
        if r.get("timeline"):
            print(f"({r['case']}) timeline: {json.dumps(r['timeline'])}")
    if out_dir:
        summary = {"environment": info, "device": device, "model": kw, "batch": args.batch, "warmup": args.warmup,
                   "steps": args.steps, "peak_tflops": peak, "results": results}
        (out_dir / "results.json").write_text(json.dumps(summary, indent=1, default=str))
        print(f"wrote {out_dir / 'results.json'}")
    failed = [r["case"] for r in results if not r.get("ok")]
    if failed:
        print(f"failed cases: {failed}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
