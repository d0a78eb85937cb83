"""No host-device sync inside the training step (issue 22.4), under every built-in schedule; and one collective per
training batch where nothing asks for more.

Each case trains a few steps on 2 real ranks while ``Tensor.item`` / ``tolist`` / ``cpu`` / ``numpy`` /
``__bool__`` / ``__float__`` / ``__int__`` and CUDA's synchronize / event and stream queries are counted per call
site (tests/distributed/scenarios/syncs.py). On CPU none of them waits for anything, yet each is a stall on CUDA:
counting them here makes a new one fail on a machine without a GPU.

What the design allows per training batch, on every rank ([Note: host reads in a training step] in
lightning_pipe/runtime/host_reads.py): exactly one read, the step-boundary agreement of the fault handling (SIGTERM,
requeue, the epoch's last batch), which decides on the host whether to stop: read from the step's one collective
(``engine.take_agreed_flags``, [Note: one collective at the step's end]) or, where the loss is reduced apart
(Chimera), from the faults' own all-reduce (``watchdog.any_rank``). Nothing else
of ours, and nothing of torch's or Lightning's own on this path. The first step is not counted (shape inference,
the loss kind: [Note: the loss kind is read once]).

The same runs show that no training step leaves its last stage's outputs behind ([Note: no outputs kept by a training
step] in lightning_pipe/_compat/torch.py): the logits of every micro-batch, held through the optimizer step before.
"""

from __future__ import annotations

import pytest

from tests.distributed.launcher import launch
from tests.distributed.scenarios.syncs import SyncCase

pytestmark = [pytest.mark.distributed]

V_PLACED = ("interleaved_1f1b", "looped_bfs", "zb_h1", "zbv", "dualpipev")
SCHEDULES = ("1f1b", "gpipe", *V_PLACED, "v_half", "v_min", "pipedream", "pipedream_2bw", "chimera", "pipemare")
# (file, function, call): the sites of the one read per training batch (one of them, per schedule)
ALLOWED = {("lightning_pipe/runtime/engine.py", "take_agreed_flags", "tolist"),
           ("lightning_pipe/runtime/watchdog.py", "any_rank", "tolist")}

CASES = [SyncCase(schedule=s, stages_per_rank=2 if s in V_PLACED else None) for s in SCHEDULES] + [
    # clipping (the global norm) and accumulation; a token-weighted loss over 2 replicas with the gradient sync
    # overlapped with the schedule (pipeline size 1 here: the replicas' target counts, the gradient factor)
    SyncCase(schedule="1f1b", acc=2, clip=0.05),
    SyncCase(schedule="gpipe", model="lm_pair", n_layers=6, dp=2, acc=2, clip=0.05),
    # the embedding and head tied across the two ranks: their sum rides the agreement
    SyncCase(schedule="1f1b", model="lm_tied", n_layers=6),
]


def _site(key: str) -> tuple[str, str, str]:
    where, function, call = key.split(" ")
    return where.rsplit(":", 1)[0], function, call


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict]]:
    """One launch for the module's tests (within the first test's timeout)."""
    return launch("syncs", 2, CASES, tmp_path_factory.mktemp("syncs"), timeout=280)


@pytest.mark.timeout(300)
def test_no_sync_inside_the_training_step(results: list[list[dict]]) -> None:
    for rank, per_case in enumerate(results):
        for case, result in zip(CASES, per_case):
            counted = result["counted_steps"]
            assert counted >= 2, (case, counted)
            ours: dict[tuple[str, str, str], int] = {}
            for key, n in result["ours"].items():
                ours[_site(key)] = ours.get(_site(key), 0) + n
            assert set(ours) <= ALLOWED and sum(ours.values()) == counted, (
                f"rank {rank}, {case}: host-device syncs in a training step, per call site over {counted} batches "
                f"(allowed: one read per batch at one of {sorted(ALLOWED)}): {result['ours']}")
            assert result["others"] == {}, f"rank {rank}, {case}: torch's / Lightning's own: {result['others']}"
            # [Note: self.log's move to the device it is on]: on while the strategy runs, undone by its teardown
            assert all(result["fast_log"]) and len(result["fast_log"]) == counted, (rank, case, result["fast_log"])
            assert not result["fast_log_after"], (rank, case)


@pytest.mark.timeout(300)
def test_a_training_step_keeps_no_outputs(results: list[list[dict]]) -> None:
    for rank, per_case in enumerate(results):
        for case, result in zip(CASES, per_case):
            assert result["kept_outputs"] == [0] * result["counted_steps"], (
                f"rank {rank}, {case}: last-stage outputs still held after each training batch "
                f"({result['kept_outputs']}): a training step must not keep them (the schedule's step is called with "
                "return_outputs=False where it takes it)")


@pytest.mark.timeout(300)
def test_one_collective_per_training_step(results: list[list[dict]]) -> None:
    """[Note: one collective at the step's end]: without clipping, accumulation or replicas a training batch ends in
    the agreement's all-reduce and nothing else, tied weights included ([Note: tie sums in the agreement]). Chimera
    reduces its loss over its two pipelines apart (three per batch)."""
    for rank, per_case in enumerate(results):
        for case, result in zip(CASES, per_case):
            if case.clip is not None or case.acc > 1 or case.dp > 1:
                continue
            per_batch = 3 if case.schedule == "chimera" else 1
            assert result["collectives"] == {"all_reduce": per_batch * result["counted_steps"]}, (
                f"rank {rank}, {case}: collectives over {result['counted_steps']} training batches: "
                f"{result['collectives']} (expected {per_batch} all-reduce per batch)")
