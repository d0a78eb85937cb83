"""The driver of the GPU check: each case in a process of its own with a timeout, inside one overall budget; then
the table and ``results.json``. It imports neither torch nor the library (a case that crashes, hangs or cannot import
takes only itself down)."""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SPEED = {"a": "plain loop, whole batch", "a2": "plain loop, grad accumulation over m",
         "a3": "torch pipelining by hand, 2 stages, interleaved 1F1B", "c": "PipelineStrategy 1 rank x 2 stages",
         "c_offload": "c, offload='all' (activations in pinned host memory)",
         "c_compile": "c, compile=True (each layer torch.compile'd; compile in the warm-up)"}
# name: (kind, model, what, GPU timeout s); run in this order (the ratios that matter first)
CASES: dict[str, tuple[str, str, str, float]] = {}
for _model, _timeout in (("gpt2_124m", 100.0),):
    for _kind, _what in SPEED.items():
        CASES[f"{_model}-{_kind}"] = (_kind, _model, _what, _timeout)
for _schedule in ("interleaved_1f1b", "zbv"):
    for _precision, _short in (("32-true", "fp32"), ("bf16-mixed", "bf16")):
        CASES[f"parity-{_schedule}-{_short}"] = (f"parity:{_schedule}:{_precision}", "gpt2_124m_parity",
                                                 f"{_schedule} 1x2 vs one device, {_precision}", 100.0)
# offload's real host round trip (on a CPU device it moves nothing) must be exact too; interleaved, not zbv: the
# torch 2.11 refuses split backward (the CPU suite proves offload under it)
CASES["parity-interleaved_1f1b-fp32-offload"] = ("parity:interleaved_1f1b:32-true:all", "gpt2_124m_parity",
                                                 "interleaved_1f1b 1x2 vs one device, 32-true, offload='all'", 100.0)
for _kind, _what in SPEED.items():
    if _kind != "c_compile":  # compiled layers: measured on the GPT only (compiling the 1B costs the budget)
        CASES[f"llama_1b-{_kind}"] = (_kind, "llama_1b", _what, 150.0)
ENV_TIMEOUT = 60.0
# --smoke runs each code path once (a process costs seconds of imports on a CPU): both parity schedules and both
# precisions, every speed anchor on the GPT, the Llama through torch's schedule and ours; --cases all runs all
SMOKE_CASES = ["gpt2_124m-a", "gpt2_124m-a2", "gpt2_124m-a3", "gpt2_124m-c", "gpt2_124m-c_offload",
               "parity-interleaved_1f1b-fp32", "parity-zbv-bf16", "parity-interleaved_1f1b-fp32-offload",
               "llama_1b-a3", "llama_1b-c"]


def _stream(cmd: list[str], timeout: float, env: dict[str, str], log_prefix: str) -> tuple[int, list[str]]:
    """Run ``cmd`` echoing its output; kill its whole process group after ``timeout`` seconds (rc 124)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=str(REPO), start_new_session=True)
    tail: collections.deque[str] = collections.deque(maxlen=40)
    killed: list[bool] = []

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
            print(f"{log_prefix}{line.rstrip()}", flush=True)
        rc = proc.wait()
    finally:
        timer.cancel()
    if killed:
        tail.append(f"killed after {timeout:.0f} s (the case's timeout)")
        rc = 124
    return rc, list(tail)


def _fmt(value: Any, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def speed_table(results: dict[str, dict[str, Any]], peak: float | None) -> list[str]:
    rows = ["| model | case | what | tokens/s | TFLOP/s | MFU | ms/step | ms/micro-batch | syncs/step (in schedule) "
            "| peak GiB |", "|---|---|---|---|---|---|---|---|---|---|"]
    ratios = []
    for model in ("gpt2_124m", "llama_1b"):
        got = {k: results.get(f"{model}-{k}", {}) for k in SPEED}
        for kind, r in got.items():
            if kind == "c_compile" and f"{model}-{kind}" not in results:
                continue  # an optional row
            if r.get("status") != "ok":
                rows.append(f"| {model} | {kind} | {SPEED[kind]} | {r.get('status', 'not run').upper()}: "
                            f"{str(r.get('error', ''))[:150]} | | | | | | |")
                continue
            s = r.get("syncs") or {}
            syncs = f"{s.get('per_step', 0):.0f} ({s.get('in_schedule_per_step', 0):.0f})" \
                if s.get("mode") == "warn" else s.get("mode", "—")
            rows.append(f"| {model} | {kind} | {SPEED[kind]} | {r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | "
                        f"{_fmt(r['tflops'] / peak if peak else None, '.1%')} | {r['step_ms']:.1f} | "
                        f"{r['ms_per_microbatch']:.2f} | {syncs} | {_fmt(r.get('peak_mem_gib'), '.1f')} |")
        c = got["c"].get("tokens_per_s") if got["c"].get("status") == "ok" else None
        parts = []
        for base in ("a2", "a3", "a"):
            b = got[base].get("tokens_per_s") if got[base].get("status") == "ok" else None
            parts.append(f"c/{base} = {_fmt(c / b if c and b else None, '.3f')}")
        off = got["c_offload"] if got["c_offload"].get("status") == "ok" else {}
        if off and c:  # what offload costs in speed and saves in peak device memory, against c
            peaks = (off.get("peak_mem_gib"), got["c"].get("peak_mem_gib"))
            parts.append(f"c_offload/c = {off['tokens_per_s'] / c:.3f} (tokens/s), "
                         f"{_fmt(peaks[0] / peaks[1] if peaks[0] and peaks[1] else None, '.3f')} (peak GiB)")
        comp = got["c_compile"] if got["c_compile"].get("status") == "ok" else {}
        if comp and c:  # compiled layers against eager ones, compile time excluded (the first step reported apart)
            parts.append(f"c_compile/c = {comp['tokens_per_s'] / c:.3f} (tokens/s; first step "
                         f"{_fmt(comp.get('first_step_s'), '.1f')} s vs {_fmt(got['c'].get('first_step_s'), '.1f')} s)")
        ratios.append(f"{model}: " + ", ".join(parts))
    return rows + [""] + ratios


def parity_table(results: dict[str, dict[str, Any]]) -> list[str]:
    rows = ["| parity case | status | max abs diff | max rel diff | tolerance (atol, rtol 0) | max update "
            "| diff/update (norms) |", "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if not name.startswith("parity-"):
            continue
        status = r.get("status", "not run")
        if status == "ok":
            status = "PASS" if r.get("passed") else f"FAIL ({len(r.get('failures', []))}+ params)"
            rows.append(f"| {name} | {status} | {r['max_abs_diff']:.3g} ({r['max_abs_diff_param']}) | "
                        f"{r['max_rel_diff']:.3g} | {r['tolerance']['atol']:.3g} | {r['max_update']:.3g} | "
                        f"{_fmt(r.get('diff_norm_over_update_norm'), '.3g')} |")
        else:
            rows.append(f"| {name} | {status.upper()}: {str(r.get('error', ''))[:160]} | | | | | |")
    return rows


def main(argv: list[str] | None = None) -> int:
    from bench.gpu import __doc__ as doc

    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny models on the CPU (gloo, fp32 parity): tests the script")
    p.add_argument("--out", help="results.json and the traces (default $OUT if set, else bench/out/gpu)")
    p.add_argument("--cases", default=None,
                   help=f"comma-separated subset of {list(CASES)}, or 'all' (the default; smoke: {SMOKE_CASES})")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; smoke 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10; smoke 2)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole run (default 540; smoke 900): a case gets what is left at most")
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--trace", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 3)
    args.steps = args.steps if args.steps is not None else (2 if args.smoke else 10)
    if args.case:
        from bench.gpu.child import run_child

        return run_child(args)
    if args.cases in (None, "all"):
        cases = SMOKE_CASES if args.smoke and args.cases is None else list(CASES)
    else:
        cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        p.error(f"unknown case(s) {unknown}; known: {list(CASES)}")
    out_dir = Path(args.out or os.environ.get("OUT") or REPO / "bench" / "out" / "gpu")
    out_dir.mkdir(parents=True, exist_ok=True)
    budget = args.budget or (900.0 if args.smoke else 540.0)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [x for x in env.get("PYTHONPATH", "").split(os.pathsep) if x])
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")
    if args.smoke:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, also on a machine with a GPU
    started = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ["env", *cases]:
            left = budget - (time.perf_counter() - started)
            kind, model, what, timeout = CASES.get(name, ("env", "-", "environment", ENV_TIMEOUT))
            timeout = (min(timeout * 3, 300.0) if args.smoke else timeout)
            if left < 20:
                results[name] = {"status": "skipped", "error": f"out of time ({budget:.0f} s budget)"}
                print(f"== {name}: skipped, out of time", flush=True)
                continue
            result_file = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, "-m", "bench.gpu", "--case", name, "--result", str(result_file),
                   "--warmup", str(args.warmup), "--steps", str(args.steps)]
            if kind in ("a3", "c"):
                cmd += ["--trace", str(out_dir / f"trace_{name}.json.gz")]
            if args.smoke:
                cmd.append("--smoke")
            print(f"\n== {name}: {what}", flush=True)
            t = time.perf_counter()
            rc, tail = _stream(cmd, min(timeout, left), env, "    | ")
            try:
                result = json.loads(result_file.read_text())
            except (OSError, ValueError):
                result = {"status": "failed", "error": f"exited {rc} without a result: " + " / ".join(tail[-6:])}
            if rc == 124:
                result.update(status="timeout", error=f"killed after {min(timeout, left):.0f} s")
            result.update(process_rc=rc, process_s=round(time.perf_counter() - t, 1), kind=kind, model_name=model)
            results[name] = result
            print(f"== {name}: {result.get('status')} in {result['process_s']} s"
                  + (f" — {result.get('error')}" if result.get("status") != "ok" else ""), flush=True)
    env_info = results.pop("env", {})
    device = env_info.get("device", "?")
    peak = env_info.get("peak_bf16_tflops")
    lines = [f"## GPU check: {device}; torch {env_info.get('torch')} (CUDA {env_info.get('cuda')}), lightning "
             f"{env_info.get('lightning')}, Python {env_info.get('python')}; {time.perf_counter() - started:.0f} s"
             + (" (smoke: tiny models on the CPU)" if args.smoke else ""),
             f"warm-up {args.warmup} + {args.steps} timed steps per speed case; MFU against "
             f"{_fmt(peak, '.1f')} TFLOP/s dense bf16; FLOPs/token = 6N + 12 L C T", "",
             *speed_table(results, peak), "", *parity_table(results)]
    for name, r in results.items():
        for site, s in ((r.get("syncs") or {}).get("sites") or {}).items():
            lines.append(f"sync {name}: {s['count']}x {'IN SCHEDULE ' if s['in_schedule'] else ''}{site}: "
                         f"{s['code']}")
    print("\n" + "\n".join(lines), flush=True)
    summary = {"environment": env_info, "smoke": args.smoke, "warmup": args.warmup, "steps": args.steps,
               "budget_s": budget, "wall_s": round(time.perf_counter() - started, 1), "results": results,
               "table": lines}
    (out_dir / "results.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"wrote {out_dir / 'results.json'}", flush=True)
    bad = [n for n, r in results.items() if r.get("status") not in ("ok", "refused")
           or (n.startswith("parity-") and r.get("status") == "ok" and not r.get("passed"))]
    if bad:
        print(f"not ok: {bad}", flush=True)
    return 1 if bad else 0
