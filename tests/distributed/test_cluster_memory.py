"""The cluster planner's memory model against what the strategy holds on 2 CPU ranks (fp32, the GPT recipe's model):
per rank its parameters, its optimizer state and the peak of the activations autograd keeps during a step, for
GPipe, 1F1B, interleaved 1F1B and ZB-V, with and without recomputation — each within 10 %."""

from __future__ import annotations

import pytest

from lightning_pipe.planner.cluster.comm import Links
from lightning_pipe.planner.cluster.kernels import GPU_EFFICIENCY, Kernels
from lightning_pipe.planner.cluster.layers import LayerModel
from lightning_pipe.planner.cluster.layout import Layout
from lightning_pipe.planner.cluster.memory import MemoryModel
from lightning_pipe.planner.cluster.project import _stages, compiled_order
from lightning_pipe.planner.cluster.specs import ClusterSpec, ModelSpec, Stack
from lightning_pipe.schedules.simulate import peak_activations
from tests.distributed.launcher import launch
from tests.distributed.scenarios.cluster_memory import ClusterMemoryCase

pytestmark = [pytest.mark.distributed]

CPU = ClusterSpec(gpus=2, gpus_per_node=2, peak_tflops=0.05, memory_gib=8, nvlink_gbps=1, network_gbps=1,
                  precision="fp32", accelerator="cpu", name="this machine")
CASES = [ClusterMemoryCase("gpipe", 1, 4, (3, 4)), ClusterMemoryCase("1f1b", 1, 4, (3, 4)),
         ClusterMemoryCase("1f1b", 1, 4, (3, 4), recompute="all"),
         ClusterMemoryCase("interleaved_1f1b", 2, 4, (2, 2, 2, 1)), ClusterMemoryCase("zbv", 2, 4, (2, 2, 1, 2)),
         ClusterMemoryCase("gpipe", 1, 8, (4, 3), recompute="all", mb_rows=1)]


def predicted(case: ClusterMemoryCase) -> tuple[list[float], list[float]]:
    """(parameters per rank, peak kept activations per rank) from the planner's model of this run."""
    model = ModelSpec(case.n_layer, case.n_embd, case.n_head, case.seq, case.vocab)
    layout = Layout(1, 2, 1, case.mb_rows, case.stages_per_rank, case.schedule,
                    "full" if case.recompute == "all" else "none", 0)
    lm = LayerModel(model, CPU, Stack(), Kernels(CPU), Links(CPU, GPU_EFFICIENCY), 1, float(case.mb_rows))
    stages = _stages(lm.layers(), case.partition)
    compiled = compiled_order(case.schedule, 2, case.stages_per_rank, case.microbatches)
    memory = MemoryModel(model, CPU, Stack(), layout, case.microbatches)
    # what autograd keeps (ActivationMeter's count): not the stage outputs torch's stage holds beside them
    return memory.params(compiled, stages), peak_activations(compiled, memory.held(stages, outputs=False))


@pytest.mark.timeout(600)
def test_memory_model_matches_what_the_strategy_holds(tmp_path) -> None:
    results = launch("cluster_memory", 2, CASES, tmp_path, timeout=540)
    for i, case in enumerate(CASES):
        params, acts = predicted(case)
        for rank in (0, 1):
            seen = results[rank][i]
            where = f"{case.schedule} v={case.stages_per_rank} recompute={case.recompute} rank {rank}"
            assert seen["param_bytes"] == pytest.approx(4 * params[rank], rel=0.10), where
            assert seen["optimizer_bytes"] == pytest.approx(8 * params[rank], rel=0.10), where
            assert seen["activation_peak"] == pytest.approx(acts[rank], rel=0.10), (where, seen, acts)
