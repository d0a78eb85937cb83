"""Who starts the ranks (:func:`pipeline_launcher`); spawned ranks (``strategy="pipeline_spawn"``, notebooks) hand the
*whole* model back to the main process.

Lightning's multiprocessing launcher sends rank 0's ``state_dict()`` back and loads it non-strictly. Under the
pipeline rank 0 holds only the first stage, so the main process would silently keep the initial weights of every
other stage. Here every rank of replica 0 contributes its stage's tensors and rank 0 sends the union.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from typing_extensions import override

from lightning_pipe._compat.lightning import MultiProcessingLauncher, SubprocessScriptLauncher


def pipeline_launcher(strategy: Any, environment: ClusterEnvironment, start_method: str) -> Any:
    """Nobody where torchrun, SLURM or a test harness started the ranks; Lightning's script launcher for
    ``"popen"`` (re-runs the script per rank, like ``ddp``); ours for spawned or forked ranks."""
    if environment.creates_processes_externally:
        return None
    if start_method == "popen":
        return SubprocessScriptLauncher(environment, strategy.num_processes, strategy.num_nodes)
    return PipelineMultiProcessingLauncher(strategy, start_method=start_method)


class PipelineMultiProcessingLauncher(MultiProcessingLauncher):
    @override
    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Any | None:
        module = trainer.lightning_module
        topology = getattr(self._strategy, "topology", None)
        if dist.is_initialized() and topology is not None and topology.pipeline_size > 1:
            mine = {k: v.detach().cpu() for k, v in module.state_dict(keep_vars=False).items()} \
                if topology.dp_rank == 0 else {}
            gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
            dist.gather_object(mine, gathered if dist.get_rank() == 0 else None, dst=0)
            if dist.get_rank() == 0:
                full: dict[str, Any] = {}
                for part in gathered:
                    full.update(part or {})
                original = module.state_dict
                module.state_dict = lambda *a, **k: full  # what the parent class saves for the main process
                try:
                    return super()._collect_rank_zero_results(trainer, results)
                finally:
                    module.state_dict = original
        return super()._collect_rank_zero_results(trainer, results)
