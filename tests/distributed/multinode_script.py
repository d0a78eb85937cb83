"""One rank of the two-"node" test: started by ``torchrun --nnodes 2`` (tests/distributed/test_multinode.py).

Trains pipeline 2 x replicas 2 over two torchrun launches with Lightning's ``num_nodes=2`` and saves this rank's
parameters and the topology it saw.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_pipe import PipelineStrategy
from tests.distributed.multinode_data import STEPS, make_model, replica_loader


def main(out_dir: Path) -> None:
    model = make_model()
    strategy = PipelineStrategy(schedule="1f1b", microbatches=2, data_parallel_size=2)
    trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=strategy, max_steps=STEPS,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model, replica_loader())
    topo = strategy.topology
    assert topo is not None
    torch.save({"global_rank": trainer.global_rank, "node_rank": trainer.node_rank, "world_size": trainer.world_size,
                "pp_rank": topo.pp_rank, "dp_rank": topo.dp_rank, "cluster": type(strategy.cluster_environment).__name__,
                "params": {n: p.detach().clone() for n, p in model.named_parameters()}},
               out_dir / f"result{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
