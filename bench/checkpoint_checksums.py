"""Cost of checkpoint checksums ([Note: checkpoint checksums]): save and load, with and without, in one process.

Two states: the GPT recipe's default model (configs/model/gpt_tiny.yaml, ~0.8 M parameters) with its AdamW state,
and ``--big-mib`` of fp32 tensors. "Without" is the same save (DCP write, fsynced ``meta.pt``, atomic rename) and the
same load (metadata checks + reading every tensor) minus the checksum steps. Runs alternate; medians are printed.
Files are read back from the page cache (just written): on a cold disk, verification reads each file once more.

    python bench/checkpoint_checksums.py [--repeats 5] [--big-mib 200] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch.distributed.checkpoint import FileSystemWriter, save  # noqa: E402

from lightning_pipe.checkpoint import checkpoint_size, files, reading  # noqa: E402
from lightning_pipe.checkpoint.checksums import verify_checksums  # noqa: E402
from lightning_pipe.checkpoint.format import FORMAT, META_FILENAME, MODEL_PREFIX, ModuleNames, flatten_optimizer  # noqa: E402


def gpt_state() -> dict[str, Any]:
    from recipes.gpt.model import GPT

    model = GPT(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.layers[0](torch.zeros(2, 8, dtype=torch.long)).sum().backward()  # every AdamW buffer exists
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    opt.step()
    state = {MODEL_PREFIX + k: v for k, v in model.state_dict().items()}
    state.update(flatten_optimizer(opt, ModuleNames(model), 0)["flat"])
    return state


def big_state(mib: int) -> dict[str, Any]:
    n = 1 << 20  # 4 MiB per tensor
    return {f"{MODEL_PREFIX}t{i}": torch.randn(n) for i in range(mib // 4)}


def save_once(state: dict[str, Any], path: Path, checksums: bool) -> None:
    token = uuid.uuid4().hex[:8]
    tmp = files.partial_path(path, token)
    meta = {"pipeline": {"format": FORMAT, "optimizers": None}}
    if checksums:
        files.seal(tmp, meta, files.write_shards(state, tmp, no_dist=True))
    else:
        save(state, storage_writer=FileSystemWriter(str(tmp)), no_dist=True)
        files._save_synced(meta, tmp / META_FILENAME)
    files.commit(tmp, path, token)


def load_once(path: Path, checksums: bool) -> None:
    if checksums:
        verify_checksums(path)
    md, _ = reading.read_sharded_metadata(path)
    reading.load_flat(path, {k: None for k in md.state_dict_metadata}, md)


def timed(what: str, state: dict[str, Any], path: Path, checksums: bool) -> float:
    t = time.perf_counter()
    if what == "save":
        save_once(state, path, checksums)
    else:
        load_once(path, checksums)
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--big-mib", type=int, default=200)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
    root = Path(tempfile.mkdtemp(dir=args.dir))
    for label, state in (("gpt_tiny+adamw", gpt_state()), (f"{args.big_mib}MiB", big_state(args.big_mib))):
        n = sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
        plain, checked = root / f"{label}-plain", root / f"{label}-checked"
        result = {}
        for what in ("save", "load"):
            times: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.repeats):  # alternate, so the machine's noise hits both sides
                for on in (False, True):
                    times[on].append(timed(what, state, checked if on else plain, on))
            result[what] = (statistics.median(times[False]), statistics.median(times[True]))
        size = checkpoint_size(checked)
        for what, (off, on) in result.items():
            print(f"{label}: {n / 2**20:.1f} MiB of tensors, {size / 2**20:.1f} MiB on disk: {what} "
                  f"{off * 1e3:.1f} ms -> {on * 1e3:.1f} ms with checksums, ratio {on / off:.2f}")
    files.remove(root)


if __name__ == "__main__":
    main()
