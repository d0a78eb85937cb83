"""Activation offload and recomputation on the CPU: what stays with the device, what goes to the host, the step time.

Through the real Lightning strategy, 1F1B, GPT-like model (8 blocks, 64 wide, 64 tokens), m = 8 micro-batches, per
rank: *device* = peak bytes autograd keeps outside offloaded layers (``ActivationMeter``: saved tensors, deduplicated
by storage, parameters excluded); *host* = peak bytes the offload hooks hold (``OffloadStats``, unique tensors).
On a CPU device offload moves nothing ([Note: activation offload] in lightning_pipe/layers/offload.py), so the
step times say what the hooks' bookkeeping costs, not what host copies would; bench/gpu's ``c_offload`` row measures
those on a GPU. Last line: ``device_bytes_offload_all_vs_none=<x>`` on rank 0.

    python bench/offload.py [--sizes 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._ranks import run_ranks  # noqa: E402

M = 8
CONFIGS: list[tuple[str, Any]] = [  # (recompute, offload)
    ("none", "none"),
    ("none", "all"),
    ("none", 2),
    ("all", "none"),
    ("all", "all"),
]


def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as L
    import torch
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pipe import PipelineStrategy
    from lightning_pipe.trace.memory import ActivationMeter
    from recipes.gpt.model import GPT

    class Meter(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.host = 0

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.meter = ActivationMeter.attach(trainer.strategy.engine)

        def on_train_batch_start(self, *_: Any) -> None:
            self.t = time.perf_counter()

        def on_train_batch_end(self, *_: Any) -> None:
            self.times.append(time.perf_counter() - self.t)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.host = sum(sm.offload_stats.peak_bytes for sm in trainer.strategy.engine.stage_modules)

    world = int(os.environ["WORLD_SIZE"])
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (M * 4 * args.steps, 65), generator=g)
    rows = []
    for recompute, offload in CONFIGS:
        torch.manual_seed(0)
        model = GPT(vocab_size=256, block_size=64, n_layer=8, n_head=4, n_embd=64, warmup_steps=1, max_steps=100)
        meter = Meter()
        trainer = L.Trainer(strategy=PipelineStrategy(schedule="1f1b", microbatches=M, recompute=recompute,
                                                      offload=offload),
                            accelerator="cpu", devices=world, max_steps=args.steps, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            use_distributed_sampler=False, callbacks=[meter])
        loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=M * 4, drop_last=True)
        trainer.fit(model, loader)
        mine = (meter.meter.peak_bytes, meter.host, statistics.median(meter.times[1:]))
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        rows.append({"recompute": recompute, "offload": offload, "device": [x[0] for x in gathered],
                     "host": [x[1] for x in gathered], "step_s": max(x[2] for x in gathered)})
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--sizes", default="2", help="pipeline sizes to run (ranks)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per configuration (the first is untimed)")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    print("| p | recompute | offload | device activation MiB per rank | host MiB per rank | device vs none, rank 0 "
          "| ms/step |\n|---|---|---|---|---|---|---|")
    ratio = None
    for size in (int(s) for s in args.sizes.split(",")):
        rows = run_ranks(__file__, size, ["--sizes", str(size), "--steps", str(args.steps)])
        base = rows[0]["device"][0]
        for r in rows:
            dev = ", ".join(f"{b / 2**20:.2f}" for b in r["device"])
            host = ", ".join(f"{b / 2**20:.2f}" for b in r["host"])
            print(f"| {size} | {r['recompute']} | {r['offload']} | {dev} | {host} | {r['device'][0] / base:.2f} | "
                  f"{r['step_s'] * 1e3:.0f} |")
        ratio = next(r for r in rows if r["recompute"] == "none" and r["offload"] == "all")["device"][0] / base
    print(f"device_bytes_offload_all_vs_none={ratio:.3f}")


if __name__ == "__main__":
    main()
