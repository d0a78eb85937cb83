"""Issue 25: transformers mixture-of-experts models through ``HFCausalLM`` on one device: the layer list's loss
(main + ``router_aux_loss_coef`` x the load-balancing loss, [Note: the load-balancing loss across stages]) and every
gradient equal the model's own, on a padded batch; families without an entry are still refused at construction."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_pipe import HFCausalLM  # noqa: E402
from lightning_pipe.hf import SUPPORTED_MODEL_TYPES  # noqa: E402
from lightning_pipe.hf.families import MOE_MODEL_TYPES, is_mixture_of_experts  # noqa: E402
from tests.moe_configs import moe_config as shared_moe_config  # noqa: E402


def moe_config(model_type: str, aux: bool = True) -> object:
    """The multi-rank tests' tiny config of each family, two layers (three for Qwen2-MoE, whose first is dense)."""
    return shared_moe_config(model_type, aux, vocab_size=64, max_position_embeddings=32,
                             num_hidden_layers=3 if model_type == "qwen2_moe" else 2)


def padded_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, (4, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, 7:] = 0
    labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    labels[1, :4] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("model_type", MOE_MODEL_TYPES)
def test_a_moe_model_matches_transformers_loss_and_gradients(model_type: str) -> None:
    torch.manual_seed(0)
    config = moe_config(model_type)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    batch = padded_batch()
    ref = model(**batch)
    ref.loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    module = HFCausalLM(model)
    loss = module.compute_loss(batch)
    torch.testing.assert_close(loss, ref.loss)
    loss.backward()
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == expected.keys()
    for name, grad in got.items():
        torch.testing.assert_close(grad, expected[name], atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    if getattr(ref, "aux_loss", None) is not None:  # logged as train_aux_loss/load_balancing (coef x aux)
        values = module.aux_loss_values
        torch.testing.assert_close(values["load_balancing"], 0.5 * ref.aux_loss.detach())
    else:
        assert module.aux_loss_values == {}


def test_without_output_router_logits_no_term_is_added() -> None:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(moe_config("mixtral", aux=False))
    batch = padded_batch()
    torch.testing.assert_close(HFCausalLM(model).compute_loss(batch), model(**batch).loss)


def test_an_unknown_moe_family_is_refused_at_construction() -> None:
    config = transformers.AutoConfig.for_model("dbrx") if hasattr(transformers, "DbrxConfig") else None
    if config is None:
        pytest.skip("no DBRX in this transformers")
    assert is_mixture_of_experts(config)
    with pytest.raises(NotImplementedError, match=r"mixture-of-experts model_type='dbrx'.*hf.families"):
        HFCausalLM(config=config)


def test_the_moe_families_are_supported_and_dense_ones_are_not_moe() -> None:
    assert set(MOE_MODEL_TYPES) <= set(SUPPORTED_MODEL_TYPES)
    dense = set(SUPPORTED_MODEL_TYPES) - set(MOE_MODEL_TYPES)
    assert not any(is_mixture_of_experts(transformers.AutoConfig.for_model(t)) for t in dense)


@pytest.mark.parametrize("model_type", MOE_MODEL_TYPES)
def test_a_moe_model_loads_from_local_safetensors(model_type: str, tmp_path: object) -> None:
    """``HFCausalLM(pretrained=dir)``: every expert, router and shared-expert tensor read from the saved
    safetensors (nothing left at its init), the loss equal to the saved model's."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(moe_config(model_type), attn_implementation="eager")
    model.save_pretrained(str(tmp_path), safe_serialization=True)
    batch = padded_batch()
    expected = model(**batch).loss
    torch.manual_seed(1)  # another init: a tensor not read from the file would show
    module = HFCausalLM(pretrained=str(tmp_path), attn_implementation="eager")
    module.configure_model()
    torch.testing.assert_close(module.compute_loss(batch), expected)
    assert module.checkpoint_reader is not None
    from lightning_pipe.hf.weights import SafetensorsCheckpoint

    on_disk = SafetensorsCheckpoint(str(tmp_path)).keys()  # per-expert keys: [Note: expert tensors on disk]
    assert any(".experts.0." in k for k in on_disk)
    assert on_disk == set(module.checkpoint_reader.keys_read)


@pytest.mark.parametrize("model_type", MOE_MODEL_TYPES)
def test_a_moe_stage_plans_its_shapes_on_meta_tensors(model_type: str) -> None:
    """Variable lengths without re-inference ([Note: shapes without re-inference]): torch's grouped_mm has no fp32
    meta kernel, so the decoder layers' meta forward runs transformers' batched_mm experts; the planned shapes are
    the real forward's, and the model's experts implementation is left as it was."""
    import contextlib

    from lightning_pipe.layers.stages import StageModule
    from lightning_pipe.runtime.shapes import ShapePlanner

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(moe_config(model_type), attn_implementation="eager")
    before = model.config._experts_implementation
    layers = StageModule(list(HFCausalLM(model).layers), range(len(model.model.layers) + 3))
    stage = type("Stage", (), {"submod": layers, "stage_index": 0, "is_first": True, "is_last": True})()
    planner = ShapePlanner([stage], lambda s: 0, None, torch.device("cpu"), contextlib.nullcontext)
    plan = planner.plan("key", [(((2, 7), torch.int64), ((2, 7), torch.int64)),
                                (((2, 5), torch.int64), ((2, 5), torch.int64))])
    with torch.no_grad():
        real = layers(torch.randint(3, 64, (2, 5)), torch.ones(2, 5, dtype=torch.long))
    real = real if isinstance(real, tuple) else (real,)
    assert plan[0].outputs[1] == tuple((tuple(t.shape), t.dtype) for t in real)
    assert plan[0].outputs[0][0][0] == (2, 7, 64)
    assert model.config._experts_implementation == before
