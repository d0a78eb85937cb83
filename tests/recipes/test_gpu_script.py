"""The one-GPU check (``python -m bench.gpu``) on the CPU, so that it cannot rot: ``--smoke`` runs
every case (parity, the speed anchors a / a2 / a3 / c, the sync counter, the profiler trace) with tiny models, gloo
and the CPU device, with Hydra and OmegaConf hidden as on the GPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
import warnings
from pathlib import Path

import pytest
import torch

from bench.gpu.common import REPO, SYNC_MESSAGE, SyncCounter
from bench.gpu.driver import SMOKE_CASES

HIDE_HYDRA = '''import sys
from tests.lean_imports import skip_torchmetrics_extras  # as tests/site/sitecustomize.py does elsewhere
skip_torchmetrics_extras()
class _Absent:
    """As on the GPU machine: hydra-core and omegaconf are not installed."""
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.split(".")[0] in ("hydra", "omegaconf"):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)
        return None
sys.meta_path.insert(0, _Absent)
'''


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_gpu_check_smoke_runs_every_case_on_the_cpu(tmp_path: Path) -> None:
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDE_HYDRA)
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), str(hide)])}
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, "-m", "bench.gpu", "--smoke", "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    summary = json.loads((out / "results.json").read_text())
    assert summary["smoke"] and summary["environment"]["hydra_importable"] is False
    assert summary["environment"]["omegaconf_importable"] is False
    results = summary["results"]
    assert sorted(results) == sorted(SMOKE_CASES)
    for name, r in results.items():
        assert r["status"] == "ok", (name, r.get("error"), r.get("traceback"))
        if name.startswith("parity-"):
            assert r["passed"] and r["parameters"] > 0 and r["max_update"] > 0, r
            assert r["backend"] == "gloo" and r["max_abs_diff"] <= r["tolerance"]["atol"], r
            assert len(r["losses"]["one_device"]) == len(r["losses"]["pipeline"]) == r["steps"]
        else:
            assert r["tokens_per_s"] > 0 and r["ms_per_microbatch"] > 0 and r["flops_per_token"] > 0, r
            assert r["syncs"]["mode"] == "unavailable on cpu"
    for name in ("gpt2_124m-c", "llama_1b-c"):  # the pipeline ran the layout asked for
        assert results[name]["plan"] == {"schedule": "interleaved_1f1b", "p": 1, "v": 2,
                                         "m": results[name]["model"]["microbatches"]}
    # the pipeline's and torch's hand-written schedule see the same micro-batches: the same losses (bf16 on CPU)
    for model in ("gpt2_124m", "llama_1b"):
        torch.testing.assert_close(torch.tensor(results[f"{model}-c"]["loss_first_last"]),
                                   torch.tensor(results[f"{model}-a3"]["loss_first_last"]), atol=1e-3, rtol=0)
    traces = sorted(p.name for p in out.glob("trace_*.json.gz"))
    assert traces == sorted(f"trace_{m}-{k}.json.gz" for m in ("gpt2_124m", "llama_1b") for k in ("a3", "c"))
    assert len(list(out.iterdir())) + 1 <= 8, "the check writes 8 files at most (the log is one)"
    assert "gpt2_124m: c/a2 = " in proc.stdout and "| parity-zbv-bf16 | PASS |" in proc.stdout
    # offload: the speed row ran with it, and its parity (a host round trip on a GPU) passed
    assert results["gpt2_124m-c_offload"]["offload"] == "all" and "c_offload/c = " in proc.stdout
    assert results["parity-interleaved_1f1b-fp32-offload"]["offload"] == "all"


def _sync_in_library() -> None:  # stands in for a line of lightning_pipe that makes CUDA report a sync
    warnings.warn("called a synchronizing CUDA operation", stacklevel=1)


def test_sync_counter_names_the_site_and_lets_other_warnings_through() -> None:
    counter = SyncCounter(torch.device("cpu"))
    with counter.counting():
        _sync_in_library()
        _sync_in_library()
        warnings.warn("an unrelated warning", stacklevel=1)  # shown as usual, not counted
    assert len(counter.events) == 2 and counter.events[0]["site"] is None  # tests/ is not a site of ours
    library = REPO / "lightning_pipe" / "engine.py"
    pipelining = Path(torch.__file__).parent / "distributed" / "pipelining" / "schedules.py"
    stack = [traceback.FrameSummary(str(pipelining), 10, "step", line="self._step_microbatches()"),
             traceback.FrameSummary(str(library), 300, "_step_loss", line="if packed[1] < 0:")]
    counter.record(stack, "engine.py", 300)
    summary = counter.summary(steps=1)
    assert summary["per_step"] == 3 and summary["in_schedule_per_step"] == 1
    warned_at = f"tests/recipes/test_gpu_script.py:{_sync_in_library.__code__.co_firstlineno + 1}"
    assert summary["sites"][f"None <- {warned_at}"]["count"] == 2
    site = summary["sites"]["lightning_pipe/engine.py:300 <- engine.py:300"]
    assert site == {"count": 1, "in_schedule": True, "code": "if packed[1] < 0:", "function": "_step_loss"}
    assert SYNC_MESSAGE in "called a synchronizing CUDA operation"


def test_sync_counter_catches_every_warning_raised_in_cpp(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's sync report is a C++ TORCH_WARN turned into a Python warning when the op returns: stand in a C++
    warning that the CPU raises (copy-constructing a tensor) for it; each occurrence counts, at the calling line."""
    import bench.gpu.common as common

    monkeypatch.setattr(common, "SYNC_MESSAGE", "To copy construct from a tensor")
    counter = SyncCounter(torch.device("cpu"))
    x, y = torch.ones(2), torch.ones(3)
    with counter.counting():
        for _ in range(3):
            x.new_tensor(y)
    assert [e["innermost"] for e in counter.events] == [counter.events[0]["innermost"]] * 3
    assert counter.events[0]["innermost"].startswith("tests/recipes/test_gpu_script.py:")
