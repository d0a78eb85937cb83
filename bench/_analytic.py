"""The analytic cost source on this machine, for ``bench/planner.py``: the cluster planner's layer costs computed
from this machine's description (matmul rate, streaming bandwidth, cost of one operation, the measured gloo link)
instead of profiled, fed to the same cost model and simulator as the measured profile."""

from __future__ import annotations

import argparse

from bench._planner_runs import vocab


def analytic_profiles(args: argparse.Namespace, world: int, latency: float, bandwidth: float, raw, overhead: float,
                      sizes: list[int]):
    """(the analytic profile alone, the same with the runtime's host costs the bench measured on the tiny probe:
    per step, per micro-batch, per action on torch's bare stages). Every rank measures; rank 0's numbers are used."""
    import torch.distributed as dist

    from lightning_pipe.planner.cluster.machine import analytic_profile, measure_machine
    from lightning_pipe.planner.cluster.specs import ModelSpec

    machine = [measure_machine(world, latency, bandwidth)]
    dist.broadcast_object_list(machine, src=0)
    model = ModelSpec(layers=args.layers, hidden=args.width, heads=args.heads, seq=args.seq, vocab=vocab(args))
    alone = analytic_profile(model, machine[0], sizes)
    host = analytic_profile(model, machine[0], sizes)
    host.step_overhead, host.microbatch_overhead, host.action_overhead = (raw.step_overhead, raw.microbatch_overhead,
                                                                           overhead)
    return alone, host, machine[0]
