"""Host memory the last stage holds for outputs nobody reads any more: in training ([Note: no outputs kept by a
training step] in lightning_pipe/_compat/torch.py) and in validation ([Note: evaluation keeps no stage outputs] in
lightning_pipe/runtime/evaluation.py).

One process, one stage (the last), a language-model head with a large vocabulary: every micro-batch's output is a
``rows x seq x vocab`` float32 logits tensor. Two runs per phase, each in a fresh process (peak RSS is per process):

* ``kept``: torch's default, emulated: a training step called without ``return_outputs=False`` (every
  micro-batch's logits held until the next step, and concatenated into the step's return value); a validation
  step that leaves the stages' per-micro-batch outputs in place while its loss is computed on the merged batch;
* ``strategy``: the strategy as it is.

Printed per phase (``--phase fit``, ``validate`` or ``both``): peak RSS of each run, the logits of one micro-batch,
and ``peak_rss_ratio[_<phase>]=<strategy / kept>``.

    python bench/kept_outputs.py [--phase both] [--vocab 32768] [--seq 128] [--batch 32] [--microbatches 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(args: argparse.Namespace) -> float:
    """Train a few steps; the process's peak RSS in MiB."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    import resource
    import warnings

    import lightning.pytorch as L
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_pipe._compat.torch as _compat
    import lightning_pipe.runtime.evaluation as evaluation
    from lightning_pipe import PipelineModule, PipelineStrategy

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if args.mode == "kept":
        _compat.train_step_kwargs = lambda schedule: {}  # type: ignore[assignment]  # torch's default step
        evaluation.release_outputs = lambda stages: None  # type: ignore[assignment]  # torch's state kept

    class Head(PipelineModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(nn.Embedding(args.vocab, 32), nn.Linear(32, args.vocab))

        def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(output.flatten(0, 1), target.flatten())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

        def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
            self.log("val_loss", self.compute_loss(batch))

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch * args.steps, args.seq), generator=g)
    data = DataLoader(TensorDataset(tokens, tokens), batch_size=args.batch, drop_last=True)
    trainer = L.Trainer(strategy=PipelineStrategy("1f1b", microbatches=args.microbatches), accelerator="cpu",
                        devices=1, max_steps=args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    if args.phase == "fit":
        trainer.fit(Head(), data)
    else:
        trainer.validate(Head(), data, verbose=False)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase", choices=["fit", "validate", "both"], default="both")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--mode", choices=["kept", "strategy"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode is not None:
        print(json.dumps(run(args)))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    phases = ["fit", "validate"] if args.phase == "both" else [args.phase]
    peaks: dict[tuple[str, str], float] = {}
    for phase in phases:
        for mode in ("kept", "strategy"):
            cmd = [sys.executable, __file__, *sys.argv[1:], "--phase", phase, "--mode", mode]
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
            peaks[phase, mode] = json.loads(out.strip().splitlines()[-1])
    logits = args.batch // args.microbatches * args.seq * args.vocab * 4 / 2**20
    print("| phase | outputs kept (torch's default), peak RSS MiB | strategy, peak RSS MiB |\n|---|---|---|")
    for phase in phases:
        print(f"| {phase} | {peaks[phase, 'kept']:.0f} | {peaks[phase, 'strategy']:.0f} |")
    print(f"vocab={args.vocab} seq={args.seq} batch={args.batch} microbatches={args.microbatches}: one micro-batch's "
          f"logits {logits:.0f} MiB")
    for phase in phases:
        print(f"peak_rss_ratio_{phase}={peaks[phase, 'strategy'] / peaks[phase, 'kept']:.3f}")


if __name__ == "__main__":
    main()
