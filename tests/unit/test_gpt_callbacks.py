"""TokensPerSecond: tokens per batch x data-parallel replicas / step time."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from recipes.gpt.callbacks import TokensPerSecond, batch_tokens, data_parallel_replicas


class _Module:
    def __init__(self) -> None:
        self.logged: dict[str, float] = {}

    def log(self, name: str, value: float, **kwargs: object) -> None:
        self.logged[name] = value


def test_batch_tokens() -> None:
    x = torch.zeros(4, 32, dtype=torch.long)
    assert batch_tokens((x, x)) == 128 and batch_tokens([x, x]) == 128 and batch_tokens(x) == 128
    assert batch_tokens({"input": x}) == 0  # unknown layouts count nothing rather than guess


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
