"""What runs on one rank: the contract a schedule fills (``spec``), the stage every engine builds (``stage``), the
engine (``engine``), its assembly from a module and a plan (``build``), and the watchdog (``watchdog``)."""

from lightning_pipe.runtime.build import PipelineLayout, build_engine
from lightning_pipe.runtime.engine import PipelineEngine

__all__ = ["PipelineEngine", "PipelineLayout", "build_engine"]
