"""transformers causal LMs through ``HFCausalLM`` on the pipeline vs the transformers model itself on one device.

The reference is the ``*ForCausalLM`` model: same initial weights (``HFCausalLM(config=...)``'s seeded init, copied
into the model with ``hf_state_dict``, or the same ``save_pretrained`` directory), its own forward and ``.loss``, a
plain SGD loop over the batches in the order Lightning's DistributedSampler gives the pipeline. Batches are padded
unevenly (left and right, -100 labels on padding and on a random prompt), so micro-batches hold different token counts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, TypedDict

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader
from typing_extensions import NotRequired

from lightning_pipe import PipelineStrategy
from tests.distributed.scenarios.training import full_tensor
from tests.models import SameOrderAsDistributedSampler

VOCAB, LENGTH, SEED, LR = 96, 12, 5, 0.2
COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "intermediate_size": 64, "max_position_embeddings": 64, "pad_token_id": 0,
          "bos_token_id": 1, "eos_token_id": 2}


def make_config(family: str) -> Any:
    import transformers

    if family == "gpt2":  # embedding and head tied: across the two ranks under 1F1B, on rank 0 under ZB-V
        return transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
    if family == "llama":
        return transformers.LlamaConfig(**COMMON)
    if family == "mistral":  # a window shorter than the sequence: every layer slides
        return transformers.MistralConfig(sliding_window=4, **COMMON)
    if family == "qwen2":  # layer 0 full attention, layer 1 sliding
        return transformers.Qwen2Config(use_sliding_window=True, sliding_window=4, max_window_layers=1, **COMMON)
    raise ValueError(family)


@dataclass(frozen=True)
class HFCase:
    family: str = "llama"
    schedule: str = "1f1b"
    stages_per_rank: int | None = None
    microbatches: int = 4
    pretrained: str | None = None  # a save_pretrained directory: HFCausalLM(pretrained=...) instead of config=
    from_model: bool = False  # HFCausalLM(model): an instantiated model, whole on every rank until setup
    steps: int = 3
    batch: int = 8
    n_data: int = 32
    tp: int = 1  # tensor_parallel_size: decoder layers split by transformers' base_model_tp_plan
    tied: bool = False  # tie_word_embeddings (the embedding and head: one weight on the first and the last stage)
    sliced: bool = False  # the collator trims padding by slicing: every batch tensor is a strided view
    packed: bool = False  # packed rows (position_ids resets, no attention mask): the reference gets the same rows
    expect_error: bool = False


class HFResult(TypedDict):
    params: dict[str, torch.Tensor]  # under the model's own names (this rank's layers under the pipeline)
    losses: list[float]  # train loss per step
    val_loss: float  # after training, on the first batch
    topology: NotRequired[tuple[int, int]]
    keys_read: NotRequired[list[str]]  # pretrained: the checkpoint keys this rank read


def padded_data(n: int, seed: int = 3) -> list[dict[str, torch.Tensor]]:
    """Rows of 3..LENGTH real tokens, padded left or right; labels -100 on padding and on a random prompt."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        real = int(torch.randint(3, LENGTH + 1, (), generator=g))
        ids = torch.zeros(LENGTH, dtype=torch.long)
        mask = torch.zeros(LENGTH, dtype=torch.long)
        where = slice(LENGTH - real, LENGTH) if torch.rand((), generator=g) < 0.5 else slice(0, real)
        ids[where] = torch.randint(3, VOCAB, (real,), generator=g)
        mask[where] = 1
        labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
        prompt = int(torch.randint(0, real - 1, (), generator=g))
        labels[where.start:where.start + prompt] = -100
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return rows


def packed_data(n: int, seed: int = 3) -> list[dict[str, torch.Tensor]]:
    """``n`` rows of LENGTH tokens packed with documents of 2..8 tokens, as ``DataCollatorWithFlattening`` gives them:
    ``input_ids``, ``position_ids`` restarting per document (the tail padding counts as one more), ``labels`` -100
    on each document's first token (the shifted loss would predict it from the previous document) and on padding."""
    from lightning_pipe.layers.packing import pack_documents, plan_rows, positions_from_documents

    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(3, VOCAB, (int(k),), generator=g) for k in torch.randint(2, 9, (3 * n,), generator=g)]
    rows = plan_rows([len(d) for d in docs], LENGTH)
    rows = [rows[i] for i in torch.randperm(len(rows), generator=g)[:n]]
    ids, doc = pack_documents(docs, rows, LENGTH, pad_value=0)
    positions = positions_from_documents(doc)
    labels = torch.where((positions == 0) | (doc == 0), torch.full_like(ids, -100), ids)
    return [{"input_ids": i, "position_ids": p, "labels": y} for i, p, y in zip(ids, positions, labels)]


def hf_params(layers: Any) -> dict[str, torch.Tensor]:
    """The parameters of the layers held here, under the model's names (a tie's copies under its first name);
    tensor-parallel parts gathered whole (collective over the tensor group, same order on each of its ranks)."""
    out: dict[str, torch.Tensor] = {}
    for layer in layers:
        keys = getattr(layer, "hf_keys", None)  # RemoteLayer placeholders have none
        if keys is None:
            continue
        for local, p in layer.named_parameters(remove_duplicate=False):
            out[keys[local][0]] = full_tensor(p)
    return out


def sliced_collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Pads each field 4 columns wider, then trims back by slicing (``v[:, :longest]``, as collators that trim
    padding do): the same values, as non-contiguous views."""
    from torch.utils.data import default_collate

    batch = default_collate(rows)
    return {k: torch.cat([v, v[:, :4]], dim=1)[:, :LENGTH] for k, v in batch.items()}


def _loader(case: HFCase, data: Any, **kwargs: Any) -> DataLoader:
    return DataLoader(data, batch_size=case.batch, collate_fn=sliced_collate if case.sliced else None, **kwargs)


class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def _config(case: HFCase) -> Any:
    config = make_config(case.family)
    if case.tied:
        config.tie_word_embeddings = True
    return config


def _model(case: HFCase) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    return AutoModelForCausalLM.from_config(_config(case), attn_implementation="sdpa")


def _module(case: HFCase) -> Any:
    from lightning_pipe import HFCausalLM

    def sgd(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=LR)

    if case.pretrained is not None:
        return HFCausalLM(pretrained=case.pretrained, attn_implementation="sdpa", optimizer=sgd)
    if case.from_model:
        return HFCausalLM(_model(case), optimizer=sgd)
    return HFCausalLM(config=_config(case), seed=SEED, attn_implementation="sdpa", optimizer=sgd)


def _data(case: HFCase) -> list[dict[str, torch.Tensor]]:
    return packed_data(case.n_data) if case.packed else padded_data(case.n_data)


def run_pipeline(case: HFCase) -> HFResult:
    """The scenario a launched rank runs."""
    data = _data(case)
    module = _module(case)
    recorder = _Losses()
    strategy = PipelineStrategy(schedule=case.schedule, microbatches=case.microbatches,
                                stages_per_rank=case.stages_per_rank, tensor_parallel_size=case.tp)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=int(os.environ["TEST_WORLD_SIZE"]),
                        max_steps=case.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[recorder])
    trainer.fit(module, _loader(case, data, shuffle=False, drop_last=True))
    val = trainer.validate(module, _loader(case, data[:case.batch]), verbose=False)
    out = HFResult(params=hf_params(module.layers), losses=recorder.losses, val_loss=float(val[0]["val_loss"]),
                   topology=(trainer.strategy.topology.dp_rank, trainer.strategy.topology.pp_rank))
    if module.checkpoint_reader is not None:
        out["keys_read"] = list(module.checkpoint_reader.keys_read)
    return out


def run_reference(case: HFCase) -> tuple[HFResult, dict[str, torch.Tensor]]:
    """The transformers model on one process: its forward, its loss, SGD; and its named parameters (deduplicated)."""
    from transformers import AutoModelForCausalLM

    from lightning_pipe.hf import hf_state_dict

    if case.pretrained is not None:
        model = AutoModelForCausalLM.from_pretrained(case.pretrained, attn_implementation="sdpa")
    elif case.from_model:
        model = _model(case)
    else:
        config = _config(case)
        start = _module(case)
        start.configure_model()  # seeded per layer, as every pipeline rank initialises its own layers
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        missing, unexpected = model.load_state_dict(hf_state_dict(start.layers), strict=False)
        tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
        assert not unexpected and set(missing) <= tied, (missing, unexpected)
    data = _data(case)
    loader = _loader(case, data, sampler=SameOrderAsDistributedSampler(len(data)), drop_last=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _, batch in zip(range(case.steps), loader):
        optimizer.zero_grad()
        loss = model(**batch, use_cache=False).loss  # packed rows are detected only without a cache
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    first = next(iter(_loader(case, data[:case.batch])))
    with torch.no_grad():
        val_loss = float(model(**first, use_cache=False).loss)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    full = {n: t.detach().clone() for n, t in model.state_dict().items()}
    return HFResult(params=params, losses=losses, val_loss=val_loss), full
