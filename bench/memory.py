"""Peak activation memory per stage: GPipe vs 1F1B vs ZeroBubble-V vs V-Half / V-Min, with and without recomputation.

What is measured: bytes autograd keeps for backward (saved tensors, deduplicated by storage, parameters excluded),
live, at their peak during a training step — per rank, through the real Lightning strategy
(``lightning_pipe.trace.memory.ActivationMeter``). GPT-like model, m = 8 micro-batches, pipeline sizes 2 and 4 on CPU.
Theory: GPipe keeps all m micro-batches' activations on the first stage, 1F1B at most p, so 1F1B / GPipe ≈ p / m.
1F1B stage r holds at most p - r micro-batches in flight, so per rank the ratio is (p - r)/m.
V-Half / V-Min (two half-size stages per rank, held from forward to weight backward) cap a rank at p and
max(2, ceil(2p/3)) stage-micro-batches: 0.5 and 0.375 (p = 4) of 1F1B's peak, which is its first rank's p micro-batches.
Every schedule gets the same balanced split (blocks evenly, embedding with the first, norm + head with the last).
Lines ``v_half_vs_1f1b=<x>`` / ``v_min_vs_1f1b=<x>``: the busiest rank's peak over 1F1B's busiest, for the largest p.
Last line: ``activation_ratio_1f1b_vs_gpipe=<x>`` on the first stage for the largest p (theory p/m = 0.5 at p = 4).

    python bench/memory.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._ranks import run_ranks  # noqa: E402

M = 8
CONFIGS = [  # (schedule, stages_per_rank, recompute)
    ("gpipe", None, "none"),
    ("1f1b", None, "none"),
    ("zbv", 2, "none"),
    ("v_half", 2, "none"),
    ("v_min", 2, "none"),
    ("gpipe", None, "all"),
    ("1f1b", None, "all"),
]


def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as L
    import torch
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, TensorDataset

    from bench.schedules import balanced_split
    from lightning_pipe import PipelineStrategy
    from lightning_pipe.trace.memory import ActivationMeter
    from recipes.gpt.model import GPT

    class Meter(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            self.meter = ActivationMeter.attach(trainer.strategy.engine)

    world = int(os.environ["WORLD_SIZE"])
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (M * 4 * 3, 65), generator=g)
    rows = []
    for schedule, v, recompute in CONFIGS:
        torch.manual_seed(0)
        # 8 blocks: enough layers for 2 stages per rank at p = 4 (2 + 8 + ... = 11 layers >= 8 stages)
        model = GPT(vocab_size=256, block_size=64, n_layer=8, n_head=4, n_embd=64, warmup_steps=1, max_steps=100)
        meter = Meter()
        split = balanced_split(8, world * (v or 1))
        trainer = L.Trainer(strategy=PipelineStrategy(schedule=schedule, microbatches=M, stages_per_rank=v,
                                                      recompute=recompute, partition=split),
                            accelerator="cpu", devices=world, max_steps=2, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                            callbacks=[meter])
        loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=M * 4, drop_last=True)
        trainer.fit(model, loader)
        peaks = [None] * world
        dist.all_gather_object(peaks, meter.meter.peak_bytes)
        rows.append({"schedule": schedule, "v": v or 1, "recompute": recompute, "peaks": peaks})
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--sizes", default="2,4", help="pipeline sizes to run (ranks)")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    print("| p | schedule | stages/rank | recompute | peak activation MiB per rank (rank 0 first) | "
          "vs GPipe, per rank |\n|---|---|---|---|---|---|")
    first_stage_ratio, v_ratios = None, {}
    for size in (int(s) for s in args.sizes.split(",")):
        rows = run_ranks(__file__, size, ["--sizes", str(size)])
        gpipe = next(r for r in rows if r["schedule"] == "gpipe" and r["recompute"] == "none")["peaks"]
        for r in rows:
            mib = ", ".join(f"{b / 2**20:.2f}" for b in r["peaks"])
            rel = ", ".join(f"{b / g:.2f}" for b, g in zip(r["peaks"], gpipe))
            print(f"| {size} | {r['schedule']} | {r['v']} | {r['recompute']} | {mib} | {rel} |")
        theory = ", ".join(f"{(size - rank) / M:.2f}" for rank in range(size))
        print(f"| {size} | theory 1F1B: stage r holds p-r of m={M} micro-batches | | | | {theory} |")
        one = next(r for r in rows if r["schedule"] == "1f1b" and r["recompute"] == "none")["peaks"]
        first_stage_ratio = one[0] / gpipe[0]
        for name in ("zbv", "v_half", "v_min"):
            peaks = next(r for r in rows if r["schedule"] == name)["peaks"]
            v_ratios[name] = max(peaks) / max(one)
            per_rank = ", ".join(f"{b / max(one):.3f}" for b in peaks)
            print(f"| {size} | {name} vs 1F1B's peak (busiest rank {v_ratios[name]:.3f}) | | | | {per_rank} |")
    print(f"v_half_vs_1f1b={v_ratios['v_half']:.3f}")
    print(f"v_min_vs_1f1b={v_ratios['v_min']:.3f}")
    # The first stage is where 1F1B's p/m saving applies in full (theory: p/m; here for the largest p run).
    print(f"activation_ratio_1f1b_vs_gpipe={first_stage_ratio:.3f}")


if __name__ == "__main__":
    main()
