"""Expert parallelism (issue 25, item 4): the Llama recipe's MoE layers on pipeline 2 x data parallel 2 with the
experts sharded over the two replicas (``expert_parallel_size=2``, 4 ranks), against the same module trained on one
process; its checkpoint loads into another expert-parallel size and on one device. One launch, several cases."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_pipe.checkpoint import consolidated
from lightning_pipe.checkpoint.format import NAMES_KEY
from tests.distributed.launcher import launch
from tests.distributed.parity import ATOL
from tests.distributed.scenarios.expert_parallel import ExpertCase, moe_llama, run_reference
from tests.torch_tiers import refused

pytestmark = [pytest.mark.parity, pytest.mark.distributed]


def merged(results: list, index: int, key: str = "params") -> dict[str, torch.Tensor]:
    """Every rank's parameters under their global names; copies held by several ranks must agree."""
    out: dict[str, torch.Tensor] = {}
    for rank, rank_results in enumerate(results):
        for name, value in rank_results[index][key].items():
            if name in out:
                torch.testing.assert_close(value, out[name], atol=0, rtol=0, msg=f"rank {rank} {name} differs")
            out[name] = value
    return out


@pytest.mark.timeout(400)
def test_expert_parallel_matches_one_device_and_checkpoints_are_layout_free(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ep2.ckpt")
    schedules = ["1f1b"] if refused("split_backward") else ["1f1b", "zbv"]
    cases = [ExpertCase(schedule=s, stages_per_rank=2 if s == "zbv" else None, aux_coef=0.05, shared_expert=True,
                     save=ckpt if s == "1f1b" else None) for s in schedules]
    cases.append(ExpertCase(ep=1, resume=ckpt, steps=4, aux_coef=0.05, shared_expert=True))  # the EP-2 checkpoint into a layout without EP
    cases.append(ExpertCase(ep=3, expect_error=True))  # 3 divides neither dp=2 nor 4 experts: refused at setup
    cases.append(ExpertCase(experts=0, expect_error=True))  # a dense model: nothing to shard, refused (not ignored)
    results = launch("expert_parallel", 4, cases, tmp_path / "run", timeout=360)
    for i, case in enumerate(cases[:len(schedules)]):
        want, _ = run_reference(case)
        got = merged(results, i)
        assert set(got) == set(want), set(got) ^ set(want)
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, atol=ATOL, rtol=0, msg=lambda m, n=name, c=case: f"{c} {n}: {m}")
        assert any("experts.experts.3." in n for n in got)
        # each replica held only its half of the experts
        assert all("experts.experts.3." not in n for n in results[0][i]["params"])
        assert all(v >= 1.0 for v in results[0][i]["load_max"]), results[0][i]["load_max"]
    trained = merged(results, 0)
    loaded = merged(results, len(schedules), "start_params")
    for name, value in trained.items():
        torch.testing.assert_close(loaded[name], value, atol=0, rtol=0, msg=f"EP 1 loaded {name}")
    single_file = consolidated(ckpt)
    one_device = {k.removeprefix("state_dict.").removeprefix("model."): v for k, v in single_file["state_dict"].items()}
    # its optimizer state is positional: in the one-device model's order, each replica's experts in their place
    listed = [n for group in single_file[NAMES_KEY][0] for n in group]
    reference = moe_llama(cases[0])
    reference.configure_model()  # the layers are built there (on meta under the strategy)
    plain = [n for n, _ in reference.named_parameters()]
    assert listed == [n for n in plain if n in set(listed)] and len(listed) == len(plain), listed
    for name, value in trained.items():
        torch.testing.assert_close(one_device[name], value, atol=0, rtol=0, msg=f"consolidated {name}")
    error, dense = results[0][-2:]
    assert not error["ok"] and "expert_parallel_size" in error["error"] and "expert_parallel_size=3" in error["error"]
    for rank_results in results:
        assert not rank_results[-1]["ok"]
        assert "expert_parallel_size=2 and no RoutedExperts in SgdLlama.layers" in rank_results[-1]["error"], dense
