"""lightning_pipe: pipeline parallelism for PyTorch Lightning.

``import lightning_pipe`` registers ``Trainer(strategy="pipeline")`` (and ``"pipeline_spawn"``) with Lightning.

Layout: a plain-torch core that never imports Lightning, one folder per layer, each importing only those below it
(``layers`` -> ``parallel`` -> ``runtime`` -> ``schedules`` -> ``planner`` / ``rebalance``; ``config``, ``_compat``,
``trace``, ``checkpoint``, ``hf`` low), and the Lightning adapter in ``lightning_pipe.lightning``; private torch /
Lightning names live in ``lightning_pipe._compat`` (docs/development.md).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_pipe.config import PipelineConfig, PipelineConfigError
from lightning_pipe.lightning.callbacks import PipelineTimeline
from lightning_pipe.lightning.grad_norms import grad_norm
from lightning_pipe.lightning.loading import explain_sharded_loads
from lightning_pipe.lightning.module import PipelineModule
from lightning_pipe.lightning.precision import PipelinePrecision
from lightning_pipe.lightning.strategy import PipelineStrategy
from lightning_pipe.parallel.tensor_parallel import FusedColwiseParallel
from lightning_pipe.schedules import available_schedules, compute_order

__version__ = "0.1.0"

__all__ = [
    "PipelineConfig",
    "PipelineConfigError",
    "FusedColwiseParallel",
    "PipelineModule",
    "PipelinePrecision",
    "PipelineStrategy",
    "PipelineTimeline",
    "available_schedules",
    "compute_order",
    "grad_norm",
]


def __getattr__(name: str) -> object:
    # Lazy: `import lightning_pipe` never imports transformers (an optional extra).
    if name == "HFCausalLM":
        from lightning_pipe.lightning.hf import HFCausalLM

        return HFCausalLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Lightning has no entry-point discovery for strategies: register on import. Launched ranks re-run the user's
# script, which imports us again, so the name is known there too.
if "pipeline" not in StrategyRegistry:
    PipelineStrategy.register_strategies(StrategyRegistry)
explain_sharded_loads()  # a sharded checkpoint given to Lightning's own loaders: the error says how to read it
