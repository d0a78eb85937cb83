"""Routed experts and expert parallelism as plain data (issue 25): routing, the exchange's regrouping, rank
arithmetic, the settings' errors, the Llama recipe's MoE layer and the trace's dispatch slices. No process group."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipe.config import PipelineConfig, PipelineConfigError
from lightning_pipe.parallel import experts as ep
from lightning_pipe.parallel.experts import ExpertGroups, ExpertLayout, RoutedExperts, check_expert_parallel, is_expert
from lightning_pipe.parallel.topology import Topology
from lightning_pipe.trace import spans
from lightning_pipe.trace.recorder import _CpuClock, _Run


def naive(experts: RoutedExperts, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.stack([sum(weight[t, j] * experts.experts[str(int(index[t, j]))](x[t]) for j in range(index.size(1)))
                        for t in range(x.size(0))])


def routed(n: int = 4) -> RoutedExperts:
    torch.manual_seed(0)
    return RoutedExperts([nn.Linear(6, 6) for _ in range(n)])


def test_routed_experts_apply_each_tokens_choices_weighted_and_every_expert_gets_a_gradient() -> None:
    experts = routed()
    x = torch.randn(7, 6)
    index = torch.tensor([[0, 2], [2, 0], [2, 1], [0, 1], [1, 2], [0, 2], [2, 2]])  # expert 3: no token
    weight = torch.rand(7, 2)
    out = experts(x, index, weight)
    torch.testing.assert_close(out, naive(experts, x, index, weight))
    out.sum().backward()
    grads = [p.grad for p in experts.parameters()]
    assert all(g is not None for g in grads)  # the unused expert too (zeros): replicas' lists stay aligned
    assert float(experts.experts["3"].weight.grad.abs().sum()) == 0.0


def test_the_exchange_regroups_tokens_by_expert_and_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The all_to_all path on one rank (the collective as a copy): its sorting, grouping and restoring."""
    def copy(out: torch.Tensor, inp: torch.Tensor, *args: object, **kwargs: object) -> None:
        out.copy_(inp)

    monkeypatch.setattr(ep.dist, "all_to_all_single", copy)
    experts = routed()
    groups = object.__new__(ExpertGroups)
    groups.size, groups.exchange, groups.layout = 1, None, ExpertLayout(1, 1, 0)
    experts.groups = groups
    x = torch.randn(9, 6, requires_grad=True)
    index = torch.randint(0, 4, (9, 2))
    weight = torch.rand(9, 2)
    out = experts(x, index, weight)
    torch.testing.assert_close(out, naive(experts, x, index, weight))
    out.sum().backward()
    assert x.grad is not None


def test_expert_rank_arithmetic_follows_the_data_parallel_index() -> None:
    # dp 4, E 2: groups {0, 1} and {2, 3} exchange tokens; {0, 2} and {1, 3} hold the same experts
    layouts = [ExpertLayout(4, 2, d) for d in range(4)]
    assert [lay.owned(8) for lay in layouts] == [range(0, 4), range(4, 8), range(0, 4), range(4, 8)]
    assert layouts[3].group_dp_ranks(layouts[3].group_index) == [2, 3]
    assert layouts[3].replica_dp_ranks(layouts[3].expert_rank) == [1, 3]


def test_sharding_keeps_global_names_and_marks_the_experts() -> None:
    experts = routed()
    groups = object.__new__(ExpertGroups)
    groups.size, groups.layout = 2, ExpertLayout(2, 2, 1)
    experts.shard(groups)
    assert sorted(experts.experts) == ["2", "3"] and all(is_expert(p) for p in experts.parameters())
    assert "experts.3.weight" in experts.state_dict()
    with pytest.raises(PipelineConfigError, match=r"expert_parallel_size=2, 3 experts in .*model.moe_experts"):
        routed(3).shard(groups, "layers.1.feed_forward.experts")


def test_a_checkpoint_orders_sharded_experts_as_the_whole_model_does() -> None:
    """Each expert-parallel rank holds some experts under their global keys; the ranks' parameter orders merge into
    the one-device model's ``named_parameters()`` order (a consolidated file's optimizer state is positional in it)."""
    from lightning_pipe.checkpoint.format import ModuleNames, merge_groups

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router = nn.Linear(4, 4, bias=False)
            self.moe = RoutedExperts([nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)) for _ in range(4)])
            self.post = nn.LayerNorm(4)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(4, 4), Block(), nn.Linear(4, 2))

    whole = [name for name, _ in Model().named_parameters()]
    orders, groups = {}, []
    for expert_rank in (1, 0):  # the rank holding the later experts first: no help from the gather order
        part = Model()
        sharding = object.__new__(ExpertGroups)
        sharding.size, sharding.layout = 2, ExpertLayout(2, 2, expert_rank)
        part.layers[1].moe.shard(sharding)
        names = ModuleNames(part)
        orders.update(names.order)
        groups.append([[{"params": [n for n, _ in part.named_parameters()]}]])
    assert merge_groups(groups, orders)[0][0]["params"] == whole


@pytest.mark.parametrize("world, dp, fsdp, size, match", [
    (4, 2, 1, 3, r"must divide the data-parallel size.*expert_parallel_size=3, data_parallel_size=2"),
    (4, 1, 2, 2, r"FSDP or tensor parallelism.*fsdp_size=2"),
])
def test_expert_parallel_settings_are_checked_against_the_world(world: int, dp: int, fsdp: int, size: int,
                                                                match: str) -> None:
    with pytest.raises(PipelineConfigError, match=match) as err:
        check_expert_parallel(size, Topology.create(world, dp, 0, fsdp_size=fsdp))
    assert "strategy.expert_parallel_size" in str(err.value)


def test_expert_parallel_size_in_the_config() -> None:
    with pytest.raises(PipelineConfigError, match="strategy.expert_parallel_size"):
        PipelineConfig(expert_parallel_size=0)
    with pytest.raises(PipelineConfigError, match="rebalance_every_n_steps"):
        PipelineConfig(expert_parallel_size=2, rebalance_every_n_steps=10)


def test_dispatch_spans_become_slices_of_their_action_outside_the_busy_time() -> None:
    run = _Run(_CpuClock())

    def forward() -> None:
        with spans.span("dispatch", "all_to_all"):
            sum(range(1000))

    with spans.listening(run._span):
        run._timed("F", 1, 3, "", forward)
    with spans.span("dispatch"):  # nobody listens: nothing recorded
        pass
    record = run.finish(0, run.clock.mark(), 0)
    kinds = [(s.kind, s.stage, s.mb) for s in record.slices]
    assert kinds == [("dispatch", 1, 3), ("F", 1, 3)]
    forward_ns = record.slices[1].end_ns - record.slices[1].start_ns
    assert record.dispatch_ns() > 0 and record.busy_ns() == forward_ns - record.dispatch_ns()
    assert record.compute_order() == ["1F3"]


def test_llama_moe_layer_routes_logs_load_and_adds_its_balance_loss() -> None:
    from recipes.llama.model import Llama
    from recipes.llama.moe import MoEFeedForward, balance_loss

    uniform = torch.full((8, 4), 0.25)
    assert float(balance_loss(uniform, torch.arange(8).view(4, 2) % 4, 4)) == pytest.approx(1.0)

    def build(coef: float) -> Llama:
        model = Llama(vocab_size=32, block_size=8, n_layer=2, n_embd=16, n_head=2, n_kv_head=1, multiple_of=8,
                      moe_experts=4, moe_top_k=2, moe_shared_expert=True, moe_aux_coef=coef)
        model.configure_model()
        return model

    x = torch.randint(0, 32, (2, 8))
    plain, with_aux = build(0.0), build(0.5)
    main = plain.compute_loss((x, x))
    total = with_aux.compute_loss((x, x))  # one device: the balance terms join the loss
    assert float(total.detach()) > float(main.detach())
    ffn = with_aux.layers[1].feed_forward
    assert isinstance(ffn, MoEFeedForward)
    load = ffn.take_load()
    assert float(load.sum()) == 2 * 8 * 2 and float(ffn.expert_load.sum()) == 0  # (token, choice) pairs, reset


def test_each_expert_starts_alike_whichever_experts_a_rank_holds() -> None:
    from recipes.llama.model import Llama

    def block(drop: bool) -> nn.Module:
        model = Llama(vocab_size=32, block_size=8, n_layer=1, n_embd=16, n_head=2, n_kv_head=1, multiple_of=8,
                      moe_experts=4)
        with torch.device("meta"):
            model.configure_model()
        layer = model.layers[1]
        if drop:  # as sharding leaves it on expert rank 1 of 2
            for key in ("0", "1"):
                del layer.feed_forward.experts.experts[key]
        layer.to_empty(device="cpu")
        model.reset_layer(1, layer)
        return layer

    whole, half = block(False), block(True)
    for key in ("2", "3"):
        for a, b in zip(whole.feed_forward.experts.experts[key].parameters(),
                        half.feed_forward.experts.experts[key].parameters()):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    torch.testing.assert_close(whole.attention.wq.weight, half.attention.wq.weight, atol=0, rtol=0)


