"""The parity assertions of the multi-rank tests: what the pipeline ranks returned vs the single-device reference.

``results`` is what ``launcher.launch`` returns: per rank (rank order), one result per case (case order).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from tests.distributed.scenarios.training import TOKEN_WEIGHTED, TrainingCase, TrainingResult, run_training

ATOL = 1e-5  # fp32, several optimizer steps: pipeline and one device differ only in reduction order

# [Note: one reference per one-device run]
# The one-device reference (``run_training(case, pipeline=False)``) reads none of these fields; the data-parallel
# and FSDP sizes only as the batch they multiply (read training.py's ``run_training`` and ``_trainer`` before adding
# a field that the reference reads to this list). Cases equal on the rest share one reference run per pytest
# process: many parity cases vary the pipeline only (the tensor-parallel launch alone had 11 schedules on 4 runs),
# and each reference is a whole Lightning fit / validate / test on one device, run in the test process.
PIPELINE_ONLY = ("schedule", "microbatches", "fsdp_reshard", "tp", "stages_per_rank", "partition",
                 "schedule_options", "recompute", "offload", "dp_overlap", "seed_per_rank", "skewed_init",
                 "rank_limits", "check_grad_norms", "expect_error")
_REFERENCES: dict[str, TrainingResult] = {}
reference_runs = {"computed": 0, "shared": 0}


def reference(case: TrainingCase) -> TrainingResult:
    """``case`` trained on one device, computed once per distinct one-device run (callers must not modify it)."""
    defaults = TrainingCase()
    one_device = replace(case, **{name: getattr(defaults, name) for name in PIPELINE_ONLY},
                         dp=1, fsdp=1, batch=case.batch * case.dp * case.fsdp)
    key = repr(one_device)
    if key in _REFERENCES:
        reference_runs["shared"] += 1
    else:
        reference_runs["computed"] += 1
        _REFERENCES[key] = run_training(one_device, pipeline=False)
    return _REFERENCES[key]

Results = Sequence[Sequence[Mapping[str, Any]]]


def merge_replica(results: Results, case_idx: int, dp_rank: int = 0, *, run: str | None = None,
                  key: str = "params") -> dict[str, Any]:
    """One data-parallel replica's name-keyed ``key`` (params, start_optim, ...) merged over its pipeline stages.

    ``run`` picks a sub-result of the case (a checkpoint case's ``"full"`` or ``"resumed"`` fit).
    """
    out: dict[str, Any] = {}
    for rank in results:
        r = rank[case_idx] if run is None else rank[case_idx][run]
        if r["topology"][0] == dp_rank:
            out.update(r[key])
    return out


def assert_same(got: Mapping[str, Any], want: Mapping[str, Any], atol: float, what: str) -> None:
    """The same names, and every value within ``atol`` (rtol 0)."""
    assert sorted(got) == sorted(want), f"{what}: names differ: {sorted(set(got) ^ set(want))}"
    for name in want:
        torch.testing.assert_close(torch.as_tensor(got[name]), torch.as_tensor(want[name]), atol=atol, rtol=0,
                                   msg=lambda m, name=name: f"{what} {name}: {m}")


def assert_case_parity(results: Results, case_idx: int, case: TrainingCase) -> None:
    """Train ``case`` on one device and compare: every parameter of every replica, the logged losses, validation and
    test losses, predictions, hook call counts and (``case.check_grad_norms``) the gradient norms before each step."""
    ref = reference(case)
    for dp_rank in range(case.dp * case.fsdp):  # every replica, every FSDP shard rank (gathered whole)
        got = merge_replica(results, case_idx, dp_rank)
        assert sorted(got) == sorted(ref["params"]), "every parameter lives on exactly one stage"
        for name, value in ref["params"].items():
            torch.testing.assert_close(got[name], value, atol=ATOL, rtol=0, msg=lambda m, name=name: f"{case} {name}: {m}")
    # Every stage of a replica logs that replica's loss; the replicas' mean is the global batch loss.
    by_replica: dict[int, list[torch.Tensor]] = {}
    for res in results:
        by_replica.setdefault(res[case_idx]["topology"][0], []).append(torch.tensor(res[case_idx]["losses"]))
    for losses in by_replica.values():
        for other in losses[1:]:
            torch.testing.assert_close(other, losses[0], atol=0, rtol=0)
    # A token-weighted loss over data ranks (replicas, FSDP shards) of uneven token counts: each logs its own
    # sum / count (and sync_dist averages those), one device the global sum / count; the gradients follow the global
    # one (the parameters above compare), the logged numbers are compared where one rank reads all the data.
    replica_weighted = case.dp * case.fsdp > 1 and case.model in TOKEN_WEIGHTED
    mean_loss = torch.stack([losses[0] for losses in by_replica.values()]).mean(0)
    if not replica_weighted:
        torch.testing.assert_close(mean_loss, torch.tensor(ref["losses"]), atol=ATOL, rtol=0)
    for res in results:
        r = res[case_idx]
        # hooks fire as on one device: zero_grad per optimizer step, backward per batch
        assert r["calls"] == ref["calls"], (r["calls"], ref["calls"])
        assert r["meta_tensors"] == 0
        # [Note: evaluation keeps no stage outputs]: nothing of a forward-only batch outlives it
        assert not any(r.get("held_after_eval", ())), (case, r["held_after_eval"])
        if case.dp > 1 and case.fsdp == 1 and case.tp == 1 and case.dp_overlap is True and "dp_sync" in r:
            # every optimizer step's gradients were averaged during the schedule: no all-reduce after it
            steps = ref["calls"].get("on_before_optimizer_step", r["dp_sync"]["overlapped"])
            assert r["dp_sync"] == {"overlapped": steps, "after_schedule": 0} and steps > 0, (case, r["dp_sync"])
        if case.validate and not replica_weighted:
            # validation during fit (every 2 batches), trainer.validate and trainer.test: forward-only pipeline
            assert len(ref["fit_val_losses"]) >= 1
            for key in ("fit_val_losses", "val_loss", "test_loss"):
                torch.testing.assert_close(torch.tensor(r[key]), torch.tensor(ref[key]), atol=ATOL, rtol=0)
    if case.check_grad_norms:
        # on_before_optimizer_step sees the full gradients (not wiped by zero_grad): the squared norms of the
        # stages of one replica add up to the single-device one, at every optimizer step (FSDP: the hook sees each
        # rank's gradient shards, so the shard ranks of replica 0, data-parallel indices 0..fsdp-1, add up too)
        # (tensor parallel: the hook's norm of a split DTensor is the whole one (gathered over the tensor and FSDP
        # dimensions), on every tensor and shard rank: count data-parallel index 0, tensor rank 0)
        counted_dp = 1 if case.tp > 1 else case.fsdp
        stage_sq = torch.tensor([r[case_idx]["grad_sq_before_step"] for r in results
                                 if r[case_idx]["topology"][0] < counted_dp and r[case_idx].get("tp_rank", 0) == 0
                                 ]).sum(0)
        torch.testing.assert_close(stage_sq, torch.tensor(ref["grad_sq_before_step"]), rtol=1e-4, atol=1e-6)
    if case.predict:
        # rank 0 predicts its data-parallel share: every (dp x fsdp)-th sample (Lightning's DistributedSampler)
        # (with uneven shares each replica its own: predict meets no other replica)
        share = case.dp * case.fsdp
        for res in results:
            dp_rank = res[case_idx]["topology"][0]
            torch.testing.assert_close(res[case_idx]["predictions"], ref["predictions"][dp_rank::share], atol=ATOL,
                                       rtol=0)
            assert res[case_idx]["predictions"].shape[0] == len(range(dp_rank, case.predict_n, share))
        for res in results:
            torch.testing.assert_close(torch.tensor(res[case_idx]["val_loss_new_trainer"]),
                                       torch.tensor(ref["val_loss"]), atol=ATOL, rtol=0)
