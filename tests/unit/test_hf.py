"""lightning_pipe.hf: transformers causal LMs as layer lists, checked against the models themselves (one process)."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_pipe.hf import (  # noqa: E402
    SafetensorsCheckpoint,
    causal_lm_layers,
    causal_lm_loss,
    causal_lm_loss_sum_count,
    hf_state_dict,
    init_layer_,
    layers_from_config,
    load_layer_weights_,
    load_layers,
    materialize_layers_,
)

VOCAB = 128
COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
          "num_key_value_heads": 2, "intermediate_size": 64, "max_position_embeddings": 64, "pad_token_id": 0,
          "bos_token_id": 1, "eos_token_id": 2}


def make_config(family: str):
    if family == "gpt2":
        return transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4, n_positions=64,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1,
                                       eos_token_id=2)
    if family == "llama":
        return transformers.LlamaConfig(**COMMON)
    if family == "llama_tied":
        return transformers.LlamaConfig(tie_word_embeddings=True, **COMMON)
    if family == "mistral":  # sliding window shorter than the sequence: every layer slides
        return transformers.MistralConfig(sliding_window=4, **COMMON)
    if family == "qwen2":  # layer 0 full attention, layers 1-2 sliding (per-layer mask types)
        return transformers.Qwen2Config(use_sliding_window=True, sliding_window=4, max_window_layers=1, **COMMON)
    if family == "qwen3":  # q/k norms inside attention, explicit head_dim
        return transformers.Qwen3Config(head_dim=8, **COMMON)
    raise ValueError(family)


FAMILIES = ["gpt2", "llama", "llama_tied", "mistral", "qwen2", "qwen3"]


def make_model(family: str, attn: str = "sdpa", seed: int = 0):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(make_config(family), attn_implementation=attn)


def padded_batch(seed: int = 1, batch: int = 4, length: int = 10):
    """Row 0 left-padded, row 1 right-padded, row 2 full, row 3 mostly padding; labels -100 on padding and on a
    'prompt' of row 2."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, 6:] = 0
    mask[3, 2:] = 0
    input_ids[mask == 0] = 0
    labels = input_ids.clone()
    labels[mask == 0] = -100
    labels[2, :4] = -100
    return input_ids, mask, labels


def run(layers, inputs):
    """In-process chaining: a tuple output handed on as ONE argument (the layers also take it unpacked, as
    run_layers and torch's stage boundaries pass it: see test_layers_run_under_the_layer_io_contract)."""
    hidden = inputs
    for layer in layers:
        hidden = layer(hidden)
    return hidden


def run_split(layers, inputs, cut: int):
    """Two 'stages': at the boundary the tuple is unpacked into positional arguments (what torch's pipeline does)."""
    hidden = run(layers[:cut], inputs)
    args = hidden if isinstance(hidden, tuple) else (hidden,)
    assert all(isinstance(a, torch.Tensor) for a in args), "only tensors may cross a stage boundary"
    assert all(a.shape[0] == inputs[0].shape[0] for a in args), "batch must be dim 0 of every boundary tensor"
    first, *rest = layers[cut:]
    hidden = first(*args)
    return run(rest, hidden)


def hf_name(layers, index: int, local: str) -> str:
    return layers[index].hf_keys[local][0]


# ---------------------------------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_loss_match_the_model(family, attn):
    model = make_model(family, attn).eval()
    layers = causal_lm_layers(model)
    assert len(layers) == model.config.num_hidden_layers + 3
    input_ids, mask, labels = padded_batch()
    with torch.no_grad():
        ref = model(input_ids, attention_mask=mask, labels=labels)
        logits = run(layers, (input_ids, mask))
        torch.testing.assert_close(logits, ref.logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(causal_lm_loss(logits, labels), ref.loss, atol=1e-5, rtol=0)
        for cut in range(1, len(layers)):
            torch.testing.assert_close(run_split(layers, (input_ids, mask), cut), ref.logits, atol=1e-5, rtol=0)
        # No mask at all: the bare tensor flows through.
        torch.testing.assert_close(run(layers, input_ids), model(input_ids).logits, atol=1e-5, rtol=0)


def test_mask_and_position_ids_really_reach_every_layer():
    """Guards the parity test against passing vacuously: padding changes valid tokens' logits, and explicit
    position ids are used (for rotary and for GPT-2's learned positions alike)."""
    input_ids, mask, _ = padded_batch()
    for family in ("llama", "gpt2"):
        model = make_model(family).eval()
        layers = causal_lm_layers(model)
        with torch.no_grad():
            masked = run(layers, (input_ids, mask))
            unmasked = run(layers, (input_ids, torch.ones_like(mask)))
            assert (masked[0, 3:] - unmasked[0, 3:]).abs().max() > 1e-4  # left-padded row
            # Restarting positions (packed-style): not a uniform shift, which rotary attention would not notice.
            position_ids = torch.arange(input_ids.shape[1]).remainder(4).expand_as(input_ids).contiguous()
            with_pos = run(layers, (input_ids, mask, position_ids))
            ref = model(input_ids, attention_mask=mask, position_ids=position_ids).logits
            torch.testing.assert_close(with_pos, ref, atol=1e-5, rtol=0)
            assert (with_pos[0, 3:] - masked[0, 3:]).abs().max() > 1e-4
    layers = causal_lm_layers(make_model("qwen2"))
    assert [layer.attention_type for layer in layers[1:-2]] == ["full_attention", "sliding_attention",
                                                                 "sliding_attention"]


# ---------------------------------------------------------------------------------------------------------- training
@pytest.mark.parametrize("family", ["gpt2", "llama_tied", "mistral", "qwen2"])
def test_adamw_steps_match_the_model(family):
    model = make_model(family).train()
    reference = copy.deepcopy(model)
    layers = causal_lm_layers(copy.deepcopy(model)).train()
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(layers.parameters(), lr=1e-2)
    for step in range(3):
        input_ids, mask, labels = padded_batch(seed=10 + step)
        opt_ref.zero_grad()
        reference(input_ids, attention_mask=mask, labels=labels).loss.backward()
        opt_ref.step()
        opt.zero_grad()
        causal_lm_loss(run_split(layers, (input_ids, mask), cut=2), labels).backward()
        opt.step()
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    checked = 0
    for index, layer in enumerate(layers):
        for local, param in layer.named_parameters(remove_duplicate=False):
            torch.testing.assert_close(param, ref_params[hf_name(layers, index, local)], atol=1e-5, rtol=0)
            checked += 1
    assert checked == len(ref_params)
    # Back into a fresh transformers model under its own names: the same logits.
    exported = hf_state_dict(layers)
    assert set(exported) == set(dict(reference.named_parameters()))
    fresh = make_model(family, seed=123).eval()
    result = fresh.load_state_dict(exported, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}  # tied: stored once
    input_ids, mask, _ = padded_batch()
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids, attention_mask=mask).logits,
                                   reference.eval()(input_ids, attention_mask=mask).logits, atol=1e-5, rtol=0)


def test_loss_sum_count_weights_micro_batches_by_tokens():
    torch.manual_seed(0)
    logits = torch.randn(4, 10, VOCAB)
    _, _, labels = padded_batch()
    whole = causal_lm_loss(logits, labels)
    sums, counts = zip(*(causal_lm_loss_sum_count(logits[i:i + 2], labels[i:i + 2]) for i in (0, 2)))
    assert counts[0] != counts[1]  # unequal token counts: a mean of micro-batch means would differ
    torch.testing.assert_close(sum(sums) / sum(counts), whole)
    assert sum(counts).item() == (labels[:, 1:] != -100).sum().item()
    empty = torch.full((2, 10), -100)
    loss = causal_lm_loss(logits[:2].requires_grad_(), empty)
    assert loss.item() == 0.0 and loss.requires_grad  # transformers would give NaN here


# ---------------------------------------------------------------------------------------------------------- ties
@pytest.mark.parametrize("family", ["gpt2", "llama_tied", "llama"])
def test_tied_embeddings_are_one_parameter(family):
    def shared(layers):
        first = {id(p) for p in layers[0].parameters()}
        return [n for n, p in layers[-1].named_parameters() if id(p) in first]

    tied = family != "llama"
    layers = causal_lm_layers(make_model(family))
    assert shared(layers) == (["lm_head.weight"] if tied else [])
    assert shared(layers_from_config(make_config(family))) == shared(layers)
    meta = layers_from_config(make_config(family), device="meta")
    assert shared(meta) == shared(layers)
    materialize_layers_(meta, [0, len(meta) - 1])  # both ends on one rank: the tie is formed again
    assert shared(meta) == shared(layers)


def test_layers_run_under_the_layer_io_contract():
    from lightning_pipe.layers.stages import run_layers

    model = make_model("qwen2").eval()
    layers = causal_lm_layers(model)
    input_ids, mask, _ = padded_batch()
    with torch.no_grad():
        torch.testing.assert_close(run_layers(layers, (input_ids, mask)), model(input_ids, attention_mask=mask).logits,
                                   atol=1e-5, rtol=0)


@pytest.mark.parametrize("local_stage", [0, 1])
def test_meta_tie_nested_in_layers_whose_ends_are_on_other_ranks(local_stage):
    """Regression: re-tying after to_empty walked into a RemoteLayer (the head's `lm_head.weight` is nested in a
    layer), raising AttributeError: RemoteLayer has no attribute 'lm_head'."""
    from lightning_pipe.layers.stages import find_tied_parameters, localize_layers, materialize

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = layers_from_config(make_config("llama_tied"), device="meta")

    module = Holder()
    tied = find_tied_parameters(module, "layers")
    assert [t.names for t in tied] == [("layers.0.embed_tokens.weight", "layers.5.lm_head.weight")]
    stage_modules = localize_layers(module, "layers", [range(0, 3), range(3, 6)], [local_stage], lambda s: s)
    assert materialize(module, stage_modules, torch.device("cpu"))
    assert not any(t.is_meta for sm in stage_modules for t in sm.parameters())


# ---------------------------------------------------------------------------------------------------------- weights
class _SpySafeOpen:
    """Records every key whose tensor data is read through safetensors.safe_open(...).get_tensor."""

    def __init__(self, real):
        self.real, self.read = real, []

    def __call__(self, *args, **kwargs):
        spy = self

        class Handle:
            def __init__(self):
                self.inner = spy.real(*args, **kwargs)

            def __enter__(self):
                self.inner.__enter__()
                return self

            def __exit__(self, *exc):
                return self.inner.__exit__(*exc)

            def keys(self):
                return self.inner.keys()

            def get_tensor(self, key):
                spy.read.append(key)
                return self.inner.get_tensor(key)

        return Handle()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_load_layers_reads_only_the_selected_layers(family, tmp_path, monkeypatch):
    import safetensors

    model = make_model(family).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    spy = _SpySafeOpen(safetensors.safe_open)
    monkeypatch.setattr(safetensors, "safe_open", spy)
    reference = causal_lm_layers(model)

    layers = load_layers(tmp_path, only=[0, 1])
    expected = {keys[0] for i in (0, 1) for keys in reference[i].hf_keys.values()}
    assert set(spy.read) == expected and len(spy.read) == len(expected)
    for i in (0, 1):
        for (name, mine), (ref_name, ref) in zip(layers[i].state_dict().items(), reference[i].state_dict().items()):
            assert name == ref_name
            torch.testing.assert_close(mine, ref, atol=0, rtol=0)
    assert all(p.is_meta for layer in layers[2:] for p in layer.parameters())

    # The head alone (a last-stage rank): a tied checkpoint stores only the embedding, which is read instead.
    spy.read.clear()
    last = len(reference) - 1
    head_only = load_layers(tmp_path, only=[last])
    tied = model.config.tie_word_embeddings
    assert spy.read == ["transformer.wte.weight" if tied else "lm_head.weight"]
    torch.testing.assert_close(head_only[last].lm_head.weight, model.lm_head.weight, atol=0, rtol=0)

    # Everything: the loaded list computes the model's logits (eval: GPT-2's dropout off).
    full = load_layers(tmp_path).eval()
    input_ids, mask, _ = padded_batch()
    with torch.no_grad():
        torch.testing.assert_close(run(full, (input_ids, mask)), model(input_ids, attention_mask=mask).logits,
                                   atol=1e-5, rtol=0)


def test_meta_construction_then_reset_layer(tmp_path):
    """The configure_model / reset_layer path: build on meta, allocate some layers, fill them per layer."""
    config = make_config("llama_tied")
    model = make_model("llama_tied").eval()
    model.save_pretrained(tmp_path, safe_serialization=True)

    # Seeded random init: the same values whichever layers a 'rank' holds, rotary buffers recomputed.
    one_device = layers_from_config(config, device="meta")
    materialize_layers_(one_device, range(len(one_device)))
    for i, layer in enumerate(one_device):
        init_layer_(layer, seed=100 + i)
    rank = layers_from_config(config, device="meta")
    materialize_layers_(rank, [2, 3])
    for i in (2, 3):
        init_layer_(rank[i], seed=100 + i)
        for a, b in zip(rank[i].state_dict().values(), one_device[i].state_dict().values()):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    torch.testing.assert_close(rank[2].rotary_emb.inv_freq, model.model.rotary_emb.inv_freq, atol=0, rtol=0)
    weight = one_device[0].embed_tokens.weight
    assert 0.015 < weight.std().item() < 0.025  # transformers' init (initializer_range=0.02)
    assert torch.equal(weight[config.pad_token_id], torch.zeros_like(weight[0]))  # padding row zeroed, as HF does
    before = weight.detach().clone()
    init_layer_(one_device[-1], seed=999)  # the head does not re-initialise the embedding it shares
    assert torch.equal(one_device[-1].lm_head.weight, before)

    # From the checkpoint: each allocated layer reads its own tensors (a meta layer must be allocated first).
    loaded = layers_from_config(config, device="meta")
    with pytest.raises(ValueError, match="meta"):
        load_layer_weights_(loaded[1], tmp_path)
    materialize_layers_(loaded, range(len(loaded)))
    checkpoint = SafetensorsCheckpoint(tmp_path)
    for layer in loaded:
        load_layer_weights_(layer, checkpoint)
    input_ids, mask, _ = padded_batch()
    with torch.no_grad():
        torch.testing.assert_close(run(loaded, (input_ids, mask)), model(input_ids, attention_mask=mask).logits,
                                   atol=1e-5, rtol=0)


def test_unsupported_family_is_named():
    config = transformers.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                        intermediate_size=64)
    with pytest.raises(NotImplementedError, match="gpt_neox"):
        layers_from_config(config, device="meta")


# ---------------------------------------------------------------------------------------------------------- module
def test_module_splits_collator_batches_and_builds_from_a_directory(tmp_path):
    from lightning_pipe import HFCausalLM

    model = make_model("qwen2").eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    input_ids, mask, labels = padded_batch()
    batch = {"input_ids": input_ids, "attention_mask": mask, "labels": labels}

    module = HFCausalLM(pretrained=tmp_path)
    module.configure_model()
    module.eval()
    inputs, target = module.split_batch(batch)
    assert isinstance(inputs, tuple) and inputs[0] is input_ids and inputs[1] is mask and target is labels
    with torch.no_grad():
        ref = model(**batch)
        torch.testing.assert_close(module.compute_loss(batch), ref.loss, atol=1e-5, rtol=0)
        torch.testing.assert_close(module.compute_output(batch), ref.logits, atol=1e-5, rtol=0)
    # labels of another length than the tokens: refused on every rank, before any schedule runs
    with pytest.raises(ValueError, match=r"'labels' must have the shape of its 'input_ids'.*labels \(\d+, \d+\)"):
        module.split_batch({**batch, "labels": labels[:, :-2]})
    # so are a mask of another length, and a dict without input_ids (its keys named); a batch without labels trains
    # nowhere, and the error says what None means
    with pytest.raises(ValueError, match=r"'attention_mask' must have the shape.*attention_mask \(\d+, \d+\)"):
        module.split_batch({**batch, "attention_mask": torch.ones(mask.shape[0], mask.shape[1] + 3)})
    with pytest.raises(TypeError, match=r"a dict with 'input_ids'.*keys \['ids', 'labels', 'mask'\]"):
        module.split_batch({"ids": input_ids, "mask": mask, "labels": labels})
    with pytest.raises(ValueError, match="without its 'labels'"):
        module.compute_loss({"input_ids": input_ids, "attention_mask": mask})

    seeded = [HFCausalLM(config=make_config("gpt2"), seed=3) for _ in range(2)]
    for m in seeded:
        m.configure_model()
    for a, b in zip(seeded[0].state_dict().values(), seeded[1].state_dict().values()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("family,attn", [("llama", "sdpa"), ("llama", "eager"), ("gpt2", "sdpa"), ("qwen2", "sdpa")])
def test_packed_rows_match_the_model_and_each_document_alone(family, attn):
    """[Note: packed rows]: position ids that restart and no attention mask (DataCollatorWithFlattening's rows) —
    the layer list, split anywhere, computes what ``model(ids, position_ids=..., use_cache=False)`` computes, which is
    each document run alone; the loss with -100 on each document's first label is the model's own."""
    from lightning_pipe import HFCausalLM
    from lightning_pipe.layers.packing import documents_from_positions

    torch.manual_seed(0)
    model = make_model(family, attn).eval()
    docs = [torch.randint(3, VOCAB, (n,)) for n in (5, 7, 4)]
    input_ids = torch.cat(docs).unsqueeze(0).repeat(2, 1)
    position_ids = torch.cat([torch.arange(len(d)) for d in docs]).unsqueeze(0).repeat(2, 1)
    labels = input_ids.clone()
    labels[:, [0, 5, 12]] = -100  # each document's first token: no prediction across the boundary
    batch = {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}
    module = HFCausalLM(model)
    inputs, target = module.split_batch(batch)
    assert len(inputs) == 4 and torch.equal(inputs[3], documents_from_positions(position_ids)) and target is labels
    with torch.no_grad():
        ref = model(**batch, use_cache=False)
        alone = torch.cat([model(d.unsqueeze(0)).logits[0] for d in docs])
        torch.testing.assert_close(ref.logits[0], alone, atol=1e-5, rtol=0)
        torch.testing.assert_close(module.compute_output(batch), ref.logits, atol=1e-6, rtol=0)
        torch.testing.assert_close(module.compute_loss(batch), ref.loss, atol=1e-6, rtol=0)
        layers = module.layers
        for cut in range(1, len(layers)):
            torch.testing.assert_close(run_split(layers, inputs, cut), ref.logits, atol=1e-6, rtol=0)
        # a 2-D mask (ones) makes transformers attend across the documents: packing really changes the result
        crossing = model(input_ids, attention_mask=torch.ones_like(input_ids), position_ids=position_ids).logits
        assert (crossing[0, 5:] - alone[5:]).abs().max() > 1e-4


def test_planner_profiles_a_transformers_model_built_on_meta() -> None:
    """schedule='auto' / partition='time' on a model we did not write: its layers pass tuples, its loss is a
    (sum, count) pair and some outputs are views (torch's split backward detaches outputs in place)."""
    from lightning_pipe import HFCausalLM
    from lightning_pipe.planner.profile import profile_model

    config = transformers.GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    model = HFCausalLM(config=config)
    with torch.device("meta"):
        model.configure_model()
    ids = torch.randint(0, 97, (4, 16))
    costs = profile_model(model, {"input_ids": ids, "labels": ids}, [2], repeats=1, passes=1).at(2)
    assert len(costs) == len(model.layers)
    assert all(c.forward > 0 and c.backward > 0 for c in costs)
    assert all(c.input_grad > 0 and c.weight_grad > 0 for c in costs[1:])  # the split backward ran (not stage 0's)
    assert all(t.is_meta for t in model.parameters())  # profiled on copies: the module is untouched


def test_tensor_parallel_plan_comes_from_transformers_and_refuses_what_it_cannot_split() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from lightning_pipe import PipelineConfigError
    from lightning_pipe.hf.tensor_parallel import decoder_layer_plan

    llama = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
    plan = decoder_layer_plan(llama, 2)
    assert {k: type(v) for k, v in plan.items()} == {
        "self_attn.q_proj": ColwiseParallel, "self_attn.k_proj": ColwiseParallel, "self_attn.v_proj": ColwiseParallel,
        "self_attn.o_proj": RowwiseParallel, "mlp.gate_proj": ColwiseParallel, "mlp.up_proj": ColwiseParallel,
        "mlp.down_proj": RowwiseParallel}
    with pytest.raises(PipelineConfigError, match=r"divisible.*num_key_value_heads': 2.*tensor_parallel_size"):
        decoder_layer_plan(llama, 4)
    with pytest.raises(PipelineConfigError, match=r"gpt2 has none.*parallelize_layer"):
        decoder_layer_plan(transformers.GPT2Config(), 2)
    with pytest.raises(PipelineConfigError, match=r"replicated_with_grad_allreduce"):
        decoder_layer_plan(transformers.Qwen3Config(num_attention_heads=4, num_key_value_heads=2), 2)


# ------------------------------------------------------------------------------------- masks: the family's own rule
_LAYER_TYPES = ["full_attention", "sliding_attention", "full_attention"]


def _ignored_keys_config(case: str):
    """Configs carrying keys their model's forward never reads ([Note: which mask a family's forward builds] in
    lightning_pipe/hf/families.py), and one whose layer types really differ per layer; windows shorter than the
    sequence, so a wrong mask shows in the logits."""
    from tests.moe_configs import moe_config

    per_layer = {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}
    moe = {"num_hidden_layers": 3, "vocab_size": VOCAB}
    return {
        "llama+sliding_window": lambda: transformers.LlamaConfig(sliding_window=4, **COMMON),
        "gpt2+sliding_window": lambda: transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4, n_positions=64, sliding_window=4, bos_token_id=1,
            eos_token_id=2),
        "mistral+layer_types": lambda: transformers.MistralConfig(sliding_window=4, layer_types=_LAYER_TYPES,
                                                                  **COMMON),
        "qwen3 per layer": lambda: transformers.Qwen3Config(head_dim=8, **per_layer, **COMMON),
        "mixtral+layer_types": lambda: moe_config("mixtral", sliding_window=4, layer_types=_LAYER_TYPES, **moe),
        "qwen3_moe+layer_types": lambda: moe_config("qwen3_moe", sliding_window=4, layer_types=_LAYER_TYPES, **moe),
        "qwen2_moe per layer": lambda: moe_config("qwen2_moe", **per_layer, **moe),
        "olmoe+sliding_window": lambda: moe_config("olmoe", sliding_window=4, **moe),
    }[case]()


@pytest.mark.parametrize("case", ["llama+sliding_window", "gpt2+sliding_window", "mistral+layer_types",
                                  "qwen3 per layer", "mixtral+layer_types", "qwen3_moe+layer_types",
                                  "qwen2_moe per layer", "olmoe+sliding_window"])
def test_each_layer_masks_as_its_family_forward_does_whatever_else_the_config_holds(case):
    from lightning_pipe import HFCausalLM

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_ignored_keys_config(case), attn_implementation="eager")
    model.eval()
    input_ids, mask, labels = padded_batch()
    batch = {"input_ids": input_ids, "attention_mask": mask, "labels": labels}
    with torch.no_grad():
        torch.testing.assert_close(HFCausalLM(model).compute_output(batch), model(**batch, use_cache=False).logits,
                                   atol=1e-5, rtol=0)


def test_a_sequence_longer_than_gpt2_positions_names_n_positions():
    """GPT-2's learned positions: torch's bare IndexError from the position embedding becomes the rule and the
    setting (transformers' own forward gives the bare error)."""
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=8)
    layers = causal_lm_layers(transformers.AutoModelForCausalLM.from_config(config))
    with pytest.raises(ValueError, match=r"Sequence length 10 exceeds the 8 learned positions .*n_positions=8"):
        run(layers, torch.randint(3, VOCAB, (2, 10)))
    assert run(layers, torch.randint(3, VOCAB, (2, 8))).shape == (2, 8, VOCAB)
