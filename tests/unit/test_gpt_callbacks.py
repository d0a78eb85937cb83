"""TokensPerSecond: tokens per batch x data-parallel replicas / step time; model FLOP/s and MFU."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from recipes.gpt.callbacks import (
    TokensPerSecond,
    attention_shape,
    batch_tokens,
    data_parallel_replicas,
    flops_per_token,
    known_peak_tflops,
    model_parameter_count,
)


class _Module:
    def __init__(self) -> None:
        self.logged: dict[str, float] = {}

    def log(self, name: str, value: float, **kwargs: object) -> None:
        self.logged[name] = value


def test_batch_tokens() -> None:
    x = torch.zeros(4, 32, dtype=torch.long)
    assert batch_tokens((x, x)) == 128 and batch_tokens([x, x]) == 128 and batch_tokens(x) == 128
    assert batch_tokens({"input": x, "target": x}) == 128  # the library's default dict layout
    assert batch_tokens({"input_ids": x, "labels": x}) == 128  # transformers' collators
    assert batch_tokens({"tokens": x}) == 0  # unknown layouts count nothing rather than guess


def test_replicas_come_from_the_sampler_settings() -> None:
    assert data_parallel_replicas(SimpleNamespace(strategy=SimpleNamespace())) == 1  # one device
    pipeline = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": 0})
    assert data_parallel_replicas(SimpleNamespace(strategy=pipeline)) == 2


def test_logs_throughput_and_averages_after_warmup() -> None:
    cb, module = TokensPerSecond(skip_steps=1), _Module()
    trainer = SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 3}))
    batch = (torch.zeros(2, 8), torch.zeros(2, 8))
    for i in range(3):
        cb.on_train_batch_start(trainer, module, batch, i)
        cb.on_train_batch_end(trainer, module, None, batch, i)
    assert module.logged["tokens_per_s"] > 0
    assert cb._tokens == 2 * 16 * 3  # two steps after the skipped one, 16 tokens x 3 replicas each
    assert cb.mean_tokens_per_s > 0
    assert TokensPerSecond().mean_tokens_per_s != TokensPerSecond().mean_tokens_per_s  # nan before any step


def test_peak_table_matches_device_names() -> None:
    assert known_peak_tflops("NVIDIA H200") == 989.0
    assert known_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert known_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert known_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0  # not the A10's
    assert known_peak_tflops("NVIDIA L40S") == 362.0  # not the L4's
    assert known_peak_tflops("Some CPU") is None


def test_flops_per_token_is_6n_plus_attention() -> None:
    assert flops_per_token(1000, None, 64) == 6000.0
    assert flops_per_token(1000, (2, 32), None) == 6000.0
    assert flops_per_token(1000, (2, 32), 64) == 6000.0 + 12 * 2 * 32 * 64


def test_gpt_parameters_counted_once_and_attention_from_hparams() -> None:
    from recipes.gpt.model import GPT

    gpt = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    assert model_parameter_count(gpt) == sum(p.numel() for p in gpt.parameters())  # the tie once
    assert attention_shape(gpt) == (2, 32)


def test_a_tie_held_by_two_stages_is_counted_by_its_first_use_only() -> None:
    class Rank1(torch.nn.Module):  # holds the head (a tie's later use) and one block
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 8, bias=False)])
            self._pipeline_layout = SimpleNamespace(tied=[SimpleNamespace(names=("emb.weight", "layers.1.weight"))])

    assert model_parameter_count(Rank1()) == 4 * 4 + 4  # dist not initialised: this rank's share


def test_logs_tflops_and_mfu_given_a_peak() -> None:
    cb, module = TokensPerSecond(skip_steps=0, peak_tflops=1e-9), _Module()
    module.device, module.hparams = torch.device("cpu"), {"n_layer": 2, "n_embd": 8}
    module.named_parameters = torch.nn.Linear(10, 10).named_parameters  # 110 parameters
    trainer = SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2}), world_size=4)
    cb.on_train_start(trainer, module)
    batch = {"input": torch.zeros(2, 8, dtype=torch.long), "target": torch.zeros(2, 8, dtype=torch.long)}
    cb.on_train_batch_start(trainer, module, batch, 0)
    cb.on_train_batch_end(trainer, module, None, batch, 0)
    assert cb.n_params == 110 and cb.flops_per_token == 6 * 110 + 12 * 2 * 8 * 8
    tokens_per_s = module.logged["tokens_per_s"]
    torch.testing.assert_close(module.logged["tflops_per_s"], cb.flops_per_token * tokens_per_s / 1e12)
    torch.testing.assert_close(module.logged["mfu"], module.logged["tflops_per_s"] / (1e-9 * 4))  # 4 devices
    assert cb.mean_mfu > 0 and TokensPerSecond().mean_mfu != TokensPerSecond().mean_mfu  # nan without a peak


def test_no_mfu_without_a_peak_on_cpu() -> None:
    cb, module = TokensPerSecond(skip_steps=0), _Module()
    module.device, module.hparams = torch.device("cpu"), {}
    module.named_parameters = torch.nn.Linear(2, 2).named_parameters
    trainer = SimpleNamespace(strategy=SimpleNamespace(), world_size=1)
    cb.on_train_start(trainer, module)
    batch = (torch.zeros(2, 8), torch.zeros(2, 8))
    cb.on_train_batch_start(trainer, module, batch, 0)
    cb.on_train_batch_end(trainer, module, None, batch, 0)
    assert "tflops_per_s" in module.logged and "mfu" not in module.logged
