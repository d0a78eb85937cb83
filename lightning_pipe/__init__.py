"""lightning_pipe: pipeline parallelism for PyTorch Lightning.

``import lightning_pipe`` registers ``Trainer(strategy="pipeline")`` (and ``"pipeline_spawn"``) with Lightning.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_pipe.config import PipelineConfig, PipelineConfigError, Topology
from lightning_pipe.module import PipelineModule
from lightning_pipe.partition import split_layers
from lightning_pipe.precision import PipelinePrecision
from lightning_pipe.schedules import available_schedules, get_schedule_spec
from lightning_pipe.strategy import PipelineStrategy

__version__ = "0.1.0"

__all__ = [
    "PipelineConfig",
    "PipelineConfigError",
    "PipelineModule",
    "PipelinePrecision",
    "PipelineStrategy",
    "Topology",
    "available_schedules",
    "get_schedule_spec",
    "split_layers",
]

# Lightning has no entry-point discovery for strategies: register on import. Launched ranks re-run the user's
# script, which imports us again, so the name is known there too.
if "pipeline" not in StrategyRegistry:
    PipelineStrategy.register_strategies(StrategyRegistry)
