"""Plan a GPU cluster before renting it: analytic costs for a described model, cluster and software stack, replayed
by the planner's schedule simulator (the one the measured profile feeds), searched over every layout.

``python -m lightning_pipe.planner project --model M.json --cluster a100-80gb-hdr --global-batch B`` from the shell
(:mod:`~lightning_pipe.planner.cluster.cli`); from Python::

    from lightning_pipe.planner.cluster import Layout, Projector, load_cluster, load_model, search
    proj = Projector(load_model("model.json"), load_cluster("h100-80gb-ndr", gpus=512), global_batch=1024)
    proj.predict(Layout(tp=8, pp=4, dp=16, mbs=1, v=2, schedule="interleaved_1f1b", recompute="full", zero=1))
    search(proj, top=5).ranked

docs/planner.md, "Planning a cluster": the cost and memory model, its calibration and what it leaves out.
"""

from lightning_pipe.planner.cluster.kernels import GPU_EFFICIENCY, Efficiency
from lightning_pipe.planner.cluster.layout import Layout, parse_layout
from lightning_pipe.planner.cluster.presets import CLUSTERS, STACKS
from lightning_pipe.planner.cluster.project import Projection, Projector
from lightning_pipe.planner.cluster.search import SearchOutcome, search
from lightning_pipe.planner.cluster.sources import load_cluster, load_model, load_stack
from lightning_pipe.planner.cluster.specs import ClusterSpec, ModelSpec, SpecError, Stack

__all__ = [
    "CLUSTERS",
    "GPU_EFFICIENCY",
    "STACKS",
    "ClusterSpec",
    "Efficiency",
    "Layout",
    "ModelSpec",
    "Projection",
    "Projector",
    "SearchOutcome",
    "SpecError",
    "Stack",
    "load_cluster",
    "load_model",
    "load_stack",
    "parse_layout",
    "search",
]
