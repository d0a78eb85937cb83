"""The cluster planner as plain data: its activation count against Korthikanti et al.'s formula, its collectives,
the split, the readers of model / cluster / layout files and their errors, the search's exactness and its memory
floor, the emitted Hydra experiment (composed by Hydra here; trained in tests/recipes/test_cluster_emit.py) and the
``project`` command."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest

from lightning_pipe.layers.partition import balanced_counts
from lightning_pipe.planner.__main__ import main
from lightning_pipe.planner.cluster import CLUSTERS, STACKS, Layout, Projector, SpecError, parse_layout, search
from lightning_pipe.planner.cluster.comm import Links, Placement
from lightning_pipe.planner.cluster.emit import experiment
from lightning_pipe.planner.cluster.kernels import GPU_EFFICIENCY, Kernels
from lightning_pipe.planner.cluster.layers import LayerModel
from lightning_pipe.planner.cluster.layout import check_layout
from lightning_pipe.planner.cluster.project import balanced_blocks, compiled_order
from lightning_pipe.planner.cluster.search import layouts
from lightning_pipe.planner.cluster.sources import load_cluster, load_model
from lightning_pipe.planner.cluster.specs import ClusterSpec, ModelSpec
from lightning_pipe.schedules.simulate import peak_activations

REPO = Path(__file__).resolve().parents[2]
A100 = CLUSTERS["a100-80gb-hdr"]
SMALL = ModelSpec(layers=12, hidden=1024, heads=16, seq=1024, vocab=50304, name="small")


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_block_activations_are_korthikantis_count(tp: int) -> None:
    """Megatron's block, fp16 with dropout, no sequence parallelism: sbh (10 + 24/t + 5as/(ht)) bytes kept;
    2 sbh under full recompute; the attention scores' 5as/(ht) gone under selective recompute."""
    model = ModelSpec(layers=4, hidden=4096, heads=32, seq=2048, vocab=51200)
    b = 2
    lm = LayerModel(model, A100, STACKS["megatron_sc21"], Kernels(A100), Links(A100, GPU_EFFICIENCY), tp, float(b))
    saved = lm.block().saved
    sbh, a, s, h = 2048 * b * 4096, 32, 2048, 4096
    assert saved["none"] == pytest.approx(sbh * (10 + 24 / tp + 5 * a * s / (h * tp)))
    assert saved["selective"] == pytest.approx(sbh * (10 + 24 / tp))
    assert saved["full"] == pytest.approx(2 * sbh)


def test_collectives_inside_and_across_nodes() -> None:
    links = Links(A100, GPU_EFFICIENCY)
    size = 1e9
    inside = links.all_reduce(size, (8, 1))
    assert inside == pytest.approx(2 * 7 / 8 * size / (300e9 * 0.8) + 2 * 7 * 2e-6)
    across = links.all_reduce(size, (1, 4))  # one GPU per node: its own NIC carries all of it
    assert across == pytest.approx(2 * 3 / 4 * size / (25e9 * 0.8) + 2 * 3 * 5e-6)
    assert links.all_reduce(size, (8, 4)) < across  # eight NICs per node share the cross-node part
    assert links.reduce_scatter(size, (8, 1)) == pytest.approx(inside / 2)
    placement = Placement({"tp": 8, "pp": 4, "dp": 2}, ("tp", "pp", "dp"), 8)
    assert placement.span("tp") == (8, 1) and placement.span("pp") == (1, 4) and placement.span("dp") == (1, 2)
    assert not placement.same_node("pp", 0, 1)
    assert Placement({"tp": 2, "pp": 4, "dp": 1}, ("tp", "pp", "dp"), 8).same_node("pp", 0, 3)


@pytest.mark.parametrize(("blocks", "stages", "first", "last"), [(12, 4, 0.3, 2.5), (24, 8, 1.0, 0.0), (7, 3, 5, 5),
                                                                   (10, 2, 0.0, 9.0), (5, 5, 0.1, 0.1)])
def test_balanced_split_is_the_exact_optimum(blocks: int, stages: int, first: float, last: float) -> None:
    counts = balanced_blocks(blocks, stages, 1.0, first, last)
    costs = [first] + [1.0] * blocks + [0.0, last]
    assert sum(counts) == blocks + 3 and min(counts) >= 1

    def worst(c: tuple[int, ...] | list[int]) -> float:
        ends = list(itertools.accumulate(c))
        return max(sum(costs[e - n:e]) for n, e in zip(c, ends))

    assert worst(counts) == pytest.approx(worst(balanced_counts(costs, stages)))


def test_layout_strings_parse_and_refuse() -> None:
    assert parse_layout("tp=8, pp=12,schedule=1F1B") == {"tp": 8, "pp": 12, "schedule": "1f1b"}
    line = "tp=8,pp=12,dp=4,mbs=1,v=1,schedule=1f1b,recompute=full,zero=1"
    assert Layout(**parse_layout(line)).line() == line
    with pytest.raises(SpecError, match="key=value pairs"):
        parse_layout("tp=8,bogus=1")
    with pytest.raises(SpecError, match="positive integer"):
        parse_layout("pp=x")


@pytest.mark.parametrize(("layout", "rule"), [
    (Layout(8, 2, 3, 1, 1, "1f1b", "full", 0), "tp x pp x dp"),
    (Layout(1, 1, 4, 3, 1, "1f1b", "full", 0), "divides into dp x mbs"),
    (Layout(1, 2, 2, 1, 1, "1f1b", "selective", 0), "recomputes"),
    (Layout(1, 2, 2, 1, 1, "1f1b", "full", 0, split="uniform"), None),
    (Layout(1, 4, 1, 1, 2, "zbv", "full", 0), None),
    (Layout(1, 4, 1, 1, 2, "zbv", "full", 0, split="uniform"), "divides the block count"),
])
def test_layout_rules_are_named(layout: Layout, rule: str | None) -> None:
    cluster = A100.with_gpus(4)
    if rule is None:
        check_layout(layout, SMALL, cluster, STACKS["lightning_pipe"], 16)
        return
    with pytest.raises(SpecError, match=rule):
        check_layout(layout, SMALL, cluster, STACKS["lightning_pipe"], 16)


def test_tensor_parallelism_stays_in_a_node() -> None:
    with pytest.raises(SpecError, match="divides gpus_per_node"):
        check_layout(Layout(3, 1, 8, 1, 1, "1f1b", "full", 0), SMALL, A100.with_gpus(24), STACKS["lightning_pipe"],
                     16)


def test_zero_with_tied_ends_on_one_rank_is_refused() -> None:
    with pytest.raises(SpecError, match="tied embeddings"):
        check_layout(Layout(1, 2, 2, 1, 2, "zbv", "full", 1), SMALL, A100.with_gpus(4), STACKS["lightning_pipe"], 16)


def test_model_files(tmp_path: Path) -> None:
    plain = tmp_path / "m.json"
    plain.write_text(json.dumps({"layers": 2, "hidden": 64, "heads": 4, "seq": 32, "vocab": 100}))
    m = load_model(str(plain))
    assert (m.kv_heads, m.ffn, m.activation, m.tied_embeddings) == (4, 256, "gelu", True)
    gpt = load_model(str(REPO / "configs/model/gpt2_124m.yaml"))
    assert (gpt.layers, gpt.hidden, gpt.seq, gpt.vocab) == (12, 768, 1024, 50304)
    assert gpt.params == pytest.approx(124.4e6, rel=0.01)  # GPT-2 small with its 50304-row table
    llama = load_model(str(REPO / "configs/model/llama_1b.yaml"))
    assert (llama.kv_heads, llama.ffn, llama.activation, llama.tied_embeddings) == (4, 5632, "swiglu", False)
    assert llama.params == pytest.approx(1.18e9, rel=0.01)  # the config's own comment
    hf = tmp_path / "config.json"
    hf.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
                              "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                              "max_position_embeddings": 8192, "vocab_size": 128256, "hidden_act": "silu",
                              "tie_word_embeddings": False}))
    llama3 = load_model(str(hf), seq=4096)
    assert (llama3.seq, llama3.kv_heads, llama3.activation) == (4096, 8, "swiglu")
    assert llama3.params == pytest.approx(8.03e9, rel=0.01)  # Llama 3 8B


def test_model_and_cluster_files_refuse_what_they_cannot_read(tmp_path: Path) -> None:
    bad = tmp_path / "m.json"
    bad.write_text(json.dumps({"layers": 2, "hidden": 64, "heads": 4, "seq": 32, "vocab": 100, "hiden": 3}))
    with pytest.raises(SpecError, match=r"unknown keys \['hiden'\]"):
        load_model(str(bad))
    bad.write_text(json.dumps({"layers": 2, "hidden": 64, "heads": 5, "seq": 32, "vocab": 100}))
    with pytest.raises(SpecError, match="hidden must divide by heads"):
        load_model(str(bad))
    with pytest.raises(SpecError, match="presets"):
        load_cluster("no-such-cluster")
    minimal = tmp_path / "c.json"
    minimal.write_text(json.dumps({"gpus": 16, "gpus_per_node": 8, "peak_tflops": 312, "memory_gib": 80,
                                   "nvlink_gbps": 300, "network_gbps": 25}))
    cluster = load_cluster(str(minimal))
    assert cluster.nodes == 2 and cluster.hbm == pytest.approx(312 * 6.5e9)
    minimal.write_text(json.dumps({"gpus": 16, "gpus_per_node": 8, "peak_tflops": 312}))
    with pytest.raises(SpecError, match="needs the keys"):
        load_cluster(str(minimal))


def test_presets_carry_their_documented_numbers() -> None:
    h100, eth = CLUSTERS["h100-80gb-ndr"], CLUSTERS["a100-80gb-100gbe"]
    assert (A100.peak_tflops, A100.nvlink_gbps, A100.network_gbps, A100.hbm_gbps) == (312, 300, 25, 2039)
    assert (h100.peak_tflops, h100.nvlink_gbps, h100.network_gbps, h100.hbm_gbps) == (989, 450, 50, 3350)
    assert eth.network_gbps == pytest.approx(100 / 8 / 8)


def test_slower_links_and_hidden_reductions_move_the_step() -> None:
    """Physics the search relies on: 100 GbE makes a data-parallel layout slower than HDR; the strategy's overlap
    hides part of the gradient reduction that Megatron 2021 ran after the schedule."""
    layout = Layout(1, 2, 8, 4, 1, "1f1b", "full", 0)
    fast = Projector(SMALL, A100.with_gpus(16), 256).predict(layout)
    slow = Projector(SMALL, CLUSTERS["a100-80gb-100gbe"].with_gpus(16), 256).predict(layout)
    assert slow.iteration_s > fast.iteration_s
    assert slow.extra_s["gradient_reduction"] > fast.extra_s["gradient_reduction"]
    after = dataclasses.replace(STACKS["lightning_pipe"], dp_overlap=False)
    exposed = Projector(SMALL, CLUSTERS["a100-80gb-100gbe"].with_gpus(16), 256, after).predict(layout)
    assert exposed.extra_s["gradient_reduction"] > slow.extra_s["gradient_reduction"]


def test_search_returns_the_models_exact_best() -> None:
    """The bound-ordered search agrees with predicting every layout (8 GPUs, a 12-layer model)."""
    projector = Projector(SMALL, A100.with_gpus(8), 64)
    found = search(projector, {"schedule": "1f1b"}, top=3)
    every = []
    for layout in layouts(projector, {"schedule": "1f1b"}):
        try:
            check_layout(layout, SMALL, projector.cluster, projector.stack, 64)
        except SpecError:
            continue
        every.append(projector.predict(layout))
    fitting = sorted((p for p in every if p.fits), key=lambda p: p.iteration_s)
    assert [p.layout for p in found.ranked] == [p.layout for p in fitting[:3]]
    assert found.replayed < len(every)
    assert all(found.ranked[i].iteration_s <= found.ranked[i + 1].iteration_s for i in range(2))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zbv",
                                      "dualpipev"])
def test_more_microbatches_never_hold_less(schedule: str) -> None:
    """What the search's memory floor assumes (``search.memory_floor``): with m a multiple of pp, no rank holds fewer
    micro-batches at once than with pp of them."""
    for pp in (2, 3, 4, 5):
        for v in (1,) if schedule in ("gpipe", "1f1b") else (2, 3) if schedule not in ("zbv", "dualpipev") else (2,):
            floor: list[float] | None = None
            for m in range(pp, 6 * pp + 1, pp):
                try:
                    order = compiled_order(schedule, pp, v, m)
                except SpecError:
                    continue
                peaks = peak_activations(order, [1.0] * order.num_stages)
                floor = floor or peaks
                assert all(a >= b for a, b in zip(peaks, floor)), (schedule, pp, v, m, peaks, floor)


def test_emitted_experiment_composes(tmp_path: Path) -> None:
    from hydra import compose, initialize_config_dir

    model = load_model(str(REPO / "configs/model/gpt_tiny.yaml"))
    cpu = ClusterSpec(gpus=2, gpus_per_node=2, peak_tflops=0.05, memory_gib=8, nvlink_gbps=1, network_gbps=1,
                      precision="fp32", accelerator="cpu", name="cpu")
    projector = Projector(model, cpu, 16)
    projection = projector.predict(Layout(1, 2, 1, 4, 1, "1f1b", "full", 0))
    path = tmp_path / "experiment" / "planned.yaml"
    path.parent.mkdir()
    path.write_text(experiment(projection, projector, path))
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=[f"hydra.searchpath=[file://{tmp_path}]", "experiment=planned"])
    assert cfg.model.n_layer == 4 and cfg.schedule.name == "1f1b" and cfg.schedule.microbatches == 4
    assert list(cfg.strategy.partition) == list(projection.counts) and cfg.strategy.recompute == "all"
    assert (cfg.trainer.accelerator, cfg.trainer.devices, cfg.trainer.precision) == ("cpu", 2, "32-true")
    assert cfg.data.batch_size == 16


def test_emitting_a_model_the_recipes_cannot_build_names_the_rule() -> None:
    odd = ModelSpec(layers=2, hidden=64, heads=4, seq=32, vocab=100, ffn=100)
    projector = Projector(odd, A100.with_gpus(2), 8)
    projection = projector.predict(Layout(1, 2, 1, 1, 1, "1f1b", "none", 0))
    with pytest.raises(SpecError, match="ffn = 4 x hidden"):
        experiment(projection, projector, Path("x.yaml"))


def test_project_command_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = str(REPO / "configs/model/gpt2_124m.yaml")
    full = "tp=1,pp=2,dp=8,mbs=64,v=1,schedule=gpipe,recompute=none,zero=0"
    assert main(["project", "--model", model, "--cluster", "a100-80gb-hdr", "--gpus", "16", "--global-batch",
                 "8192", "--layout", full, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["ranked"]) == 1 and out["ranked"][0]["fits"] is False  # a full layout: one entry, fitting or not
    keys = {"layout", "iteration_s", "model_tflops_per_gpu", "mfu", "memory_gib_per_gpu", "fits", "bubble_fraction"}
    assert keys <= set(out["ranked"][0])
    assert main(["project", "--model", model, "--cluster", "a100-80gb-hdr", "--gpus", "16", "--global-batch",
                 "256", "--layout", "pp=2,schedule=1f1b", "--top", "2", "--json"]) == 0
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    assert len(ranked) == 2 and all(r["fits"] and r["layout"]["pp"] == 2 for r in ranked)
    assert ranked[0]["iteration_s"] <= ranked[1]["iteration_s"]
    assert main(["project", "--model", model, "--cluster", "a100-80gb-hdr", "--global-batch", "255"]) == 2
    assert "divisible by dp x mbs" in capsys.readouterr().err


def test_the_analytic_source_feeds_the_profiled_planners_model() -> None:
    """On a described CPU machine, the analytic layer costs are a ModelProfile the measured-cost model replays."""
    from lightning_pipe.planner.cluster.machine import analytic_profile
    from lightning_pipe.planner.model import CostModel, predict

    cpu = ClusterSpec(gpus=2, gpus_per_node=2, peak_tflops=0.15, memory_gib=8, nvlink_gbps=2, network_gbps=2,
                      hbm_gbps=20, kernel_us=2, precision="fp32", accelerator="cpu")
    model = ModelSpec(layers=6, hidden=128, heads=4, seq=64, vocab=256)
    profile = analytic_profile(model, cpu, [2, 4])
    assert profile.num_layers == 9 and profile.link_bandwidth == pytest.approx(2e9)
    steps = [predict(CostModel(profile, b, [1.0, 1.0]), compiled_order("1f1b", 2, 1, 16 // b), (4, 5), 1).step_time
             for b in (2, 4)]
    assert 0 < steps[0] < steps[1] * 1.2  # twice the rows per micro-batch, half the micro-batches
    assert profile.layers[4][1].saved_bytes == pytest.approx(2 * profile.layers[2][1].saved_bytes)
