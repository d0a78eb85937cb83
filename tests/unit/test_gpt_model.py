"""The GPT recipe's model on one device: shapes, tied weights, init loss, optimizer on a partial model, learning."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from recipes.gpt.model import GPT, Embedding, FinalNorm, Head, warmup_cosine

TINY = dict(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32, warmup_steps=2, max_steps=50)


@pytest.fixture
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(**TINY)


def batch(b: int = 4, t: int = 16, vocab: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (b, t + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def test_layer_list_and_shapes(model: GPT) -> None:
    layers = model.layers
    assert isinstance(layers, nn.Sequential) and len(layers) == TINY["n_layer"] + 3
    assert isinstance(layers[0], Embedding) and isinstance(layers[-2], FinalNorm) and isinstance(layers[-1], Head)
    x, _ = batch()
    hidden = layers[0](x)
    assert hidden.shape == (4, 16, 32)
    for layer in layers[1:-1]:  # every layer maps one tensor to one tensor
        hidden = layer(hidden)
        assert hidden.shape == (4, 16, 32)
    assert layers[-1](hidden).shape == (4, 16, 256)
    assert model(x).shape == (4, 16, 256)


def test_shorter_sequences_and_too_long(model: GPT) -> None:
    assert model(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, 256)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_head_is_tied_to_token_embedding(model: GPT) -> None:
    wte = model.layers[0].wte.weight
    assert model.layers[-1].head.weight is wte
    # One parameter for the optimizer; the second name is visible with remove_duplicate=False,
    # which is how the pipeline finds the pair.
    names = [n for n, p in model.named_parameters(remove_duplicate=False) if p is wte]
    assert names == ["layers.0.wte.weight", f"layers.{len(model.layers) - 1}.head.weight"]
    assert sum(p is wte for p in model.parameters()) == 1


def test_causal(model: GPT) -> None:
    """Changing a later token must not change earlier logits."""
    model.eval()
    x, _ = batch(b=1)
    y = x.clone()
    y[0, 10] = (y[0, 10] + 1) % 256
    assert torch.allclose(model(x)[:, :10], model(y)[:, :10], atol=1e-6)
    assert not torch.allclose(model(x)[:, 10:], model(y)[:, 10:])


def test_init_loss_is_about_uniform(model: GPT) -> None:
    loss = model.compute_loss(batch(b=8))
    assert abs(loss.item() - math.log(256)) < 0.3


def test_residual_projections_use_scaled_init() -> None:
    torch.manual_seed(0)
    m = GPT(vocab_size=256, block_size=16, n_layer=8, n_head=4, n_embd=128)
    proj = m.layers[1].attn.c_proj.weight.std().item()
    fc = m.layers[1].mlp.c_fc.weight.std().item()
    assert fc == pytest.approx(0.02, rel=0.1)
    assert proj == pytest.approx(0.02 / math.sqrt(16), rel=0.1)


def _groups(opt: torch.optim.Optimizer) -> dict[float, int]:
    return {g["weight_decay"]: sum(p.numel() for p in g["params"]) for g in opt.param_groups}


def test_configure_optimizers_groups(model: GPT) -> None:
    cfg = model.configure_optimizers()
    opt = cfg["optimizer"]
    assert cfg["lr_scheduler"]["interval"] == "step"
    n_params = sum(p.numel() for p in model.parameters())
    groups = _groups(opt)
    assert sum(groups.values()) == n_params
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    for name, p in model.named_parameters():
        assert (id(p) in decayed) == (p.dim() >= 2), name


def test_configure_optimizers_on_a_stage_subset(model: GPT) -> None:
    """Under the pipeline a rank keeps its layers; the others become parameter-less placeholders."""
    n = len(model.layers)
    last_stage = [i for i in range(n) if i < n - 2]  # this rank holds only FinalNorm and Head
    for i in last_stage:
        model.layers[i] = nn.Identity()
    opt = model.configure_optimizers()["optimizer"]
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert held == {id(p) for p in model.parameters()}
    assert model.layers[-1].head.weight in [p for g in opt.param_groups for p in g["params"]]

    # Only matrices (no biases, no norms): the empty no-decay group is skipped, not passed to AdamW.
    head_only = GPT(**TINY)
    for i in range(len(head_only.layers) - 1):
        head_only.layers[i] = nn.Identity()
    opt = head_only.configure_optimizers()["optimizer"]
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["weight_decay"] > 0


def test_configure_optimizers_without_parameters_says_so(model: GPT) -> None:
    for i in range(len(model.layers)):
        model.layers[i] = nn.Identity()
    with pytest.raises(ValueError, match="no trainable parameters"):
        model.configure_optimizers()


def test_warmup_cosine_schedule() -> None:
    assert warmup_cosine(0, 10, 100) < warmup_cosine(5, 10, 100) < 1.0
    assert warmup_cosine(10, 10, 100) == pytest.approx(1.0)
    assert warmup_cosine(55, 10, 100) == pytest.approx(0.55)
    assert warmup_cosine(100, 10, 100) == pytest.approx(0.1)
    assert warmup_cosine(1000, 10, 100) == pytest.approx(0.1)


def test_a_few_steps_reduce_loss(model: GPT) -> None:
    """Overfit one small batch on one device with the model's own optimizer and schedule."""
    cfg = model.configure_optimizers()
    opt, sched = cfg["optimizer"], cfg["lr_scheduler"]["scheduler"]
    x, y = batch(b=4)
    y = (x + 1) % 256  # a learnable rule: next byte = this byte + 1
    first = None
    for _ in range(30):
        loss = model.compute_loss((x, y))
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    assert loss.item() < first - 1.0
    assert model.layers[-1].head.weight is model.layers[0].wte.weight  # still tied after updates


def test_generate(model: GPT) -> None:
    torch.manual_seed(0)
    idx = torch.zeros(2, 3, dtype=torch.long)
    out = model.generate(idx, max_new_tokens=20, temperature=0.8, top_k=5)  # runs past block_size (16)
    assert out.shape == (2, 23) and torch.equal(out[:, :3], idx)
    assert int(out.max()) < 256 and int(out.min()) >= 0


def test_hparams_are_plain() -> None:
    from omegaconf import ListConfig

    m = GPT(**{**TINY, "betas": ListConfig([0.9, 0.99])})
    assert m.hparams.betas == (0.9, 0.99) and type(m.hparams.betas) is tuple
