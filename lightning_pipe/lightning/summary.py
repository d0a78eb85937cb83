"""Lightning's model summary of the whole pipeline: every layer, with the stage and the pipeline rank holding it.

[Note: the model summary of a split model]
Each rank keeps only its own layers (the others are parameter-less ``RemoteLayer`` stand-ins), so Lightning's
``ModelSummary`` callback, which counts the module it is given, showed rank 0's stage only ("1.3 K Total params" for
a 2.4 K model). At setup, when a summary callback will print, every rank sends the rows of its layers (name, type,
parameter counts, train/eval mode) in one object gather over the world (replica 0, tensor rank 0 and FSDP shard 0
send; a DTensor counts its whole size); the callback is then handed a :class:`PipelineSummary` built from them. It
prints what Lightning prints for the unsplit model, plus a stage and a rank column, and always lists the layers of
the layer list one by one (with ``max_depth=1`` too: that is where the stages are). Totals count a tied weight once,
as one device does. FLOPs are not counted (Lightning measures them by running an example input, which a split model
cannot take in one process), nor input / output sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelSummary as ModelSummaryCallback
from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count
from torch import nn

from lightning_pipe._compat import lightning as _compat

_BITS = {"64": 64, "32": 32, "16": 16, "bf16": 16, "16-true": 16, "bf16-true": 16, "32-true": 32, "64-true": 64}
"""Bits per parameter for the size estimate, as Lightning's summary reads ``trainer.precision`` (else 32)."""


@dataclass(frozen=True)
class ModuleRow:
    """One module of a layer: what the summary shows of it."""

    name: str
    type: str
    params: int
    trainable: int
    training: bool
    stage: int
    pp_rank: int


@dataclass(frozen=True)
class LayerTable:
    """Every rank's layer rows, and each parameter of the layer list once (by name: tied copies under their first
    name only), gathered at setup."""

    rows: tuple[ModuleRow, ...]
    params: dict[str, tuple[int, bool]]
    """name -> (elements, requires_grad) of every parameter of the layer list, a tied weight once."""


def _counts(module: nn.Module) -> tuple[int, int]:
    params = list(module.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def local_rows(module: nn.Module, engine: Any, attr: str, stage_ids: Sequence[int], pp_rank: int) -> list[ModuleRow]:
    """The rows of this rank's layers (every submodule, named as in the whole model)."""
    rows = []
    for stage, stage_module in zip(stage_ids, engine.stage_modules):
        for position, index in enumerate(stage_module.layer_indices):
            for name, sub in stage_module.layers[position].named_modules(prefix=f"{attr}.{index}"):
                total, trainable = _counts(sub)
                rows.append(ModuleRow(name, type(sub).__name__, total, trainable, sub.training, stage, pp_rank))
    return rows


def gather_layer_table(module: nn.Module, engine: Any, attr: str, tied_aliases: set[str]) -> LayerTable:
    """Every rank's rows and parameters ([Note: the model summary of a split model]). Collective over the world."""
    topology = engine.groups.topology
    stage_ids = engine.plan.stages_of_rank(topology.pp_rank)
    sends = topology.dp_rank == 0 and topology.tp_rank == 0
    rows = local_rows(module, engine, attr, stage_ids, topology.pp_rank) if sends else []
    params = ({n: (p.numel(), p.requires_grad) for n, p in module.named_parameters()
               if n.startswith(f"{attr}.") and n not in tied_aliases} if sends else {})
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (rows, params))
    seen: dict[str, ModuleRow] = {}
    every: dict[str, tuple[int, bool]] = {}
    for rank_rows, rank_params in gathered:
        for row in rank_rows:
            seen.setdefault(row.name, row)  # a layer two ranks hold (Chimera): the first
        every.update(rank_params)
    return LayerTable(tuple(sorted(seen.values(), key=lambda r: _order(r.name, attr))), every)


def _order(name: str, attr: str) -> tuple[int, str]:
    index = name[len(attr) + 1:].split(".", 1)[0]
    return int(index), name


class PipelineSummary:
    """What Lightning's ``ModelSummary`` callback reads from its summary object, for the whole pipeline."""

    def __init__(self, model: LightningModule, table: LayerTable, attr: str, max_depth: int) -> None:
        self._model, self._table, self._attr, self._max_depth = model, table, attr, max_depth
        local = [(n, m) for n, m in model.named_modules() if n and not n.startswith(f"{attr}.")]
        self._local = local
        self._rows = self._build_rows()

    def _keep(self, name: str) -> bool:
        depth = name.count(".")
        return self._max_depth == -1 or depth < self._max_depth

    def _build_rows(self) -> list[tuple[str, str, int, bool, str, str]]:
        rows = []
        for name, sub in self._local:
            if name == self._attr:
                total = sum(n for n, _ in self._table.params.values())
                rows.append((name, type(sub).__name__, total, sub.training, "", ""))
                rows += [(r.name, r.type, r.params, r.training, str(r.stage), str(r.pp_rank))
                         for r in self._table.rows if r.name.count(".") == 1 + self._attr.count(".")
                         or self._keep(r.name)]
            elif self._keep(name):
                rows.append((name, type(sub).__name__, _counts(sub)[0], sub.training, "", ""))
        return rows

    def _get_summary_data(self) -> list[tuple[str, list[str]]]:
        rows = self._rows
        return [(" ", [str(i) for i in range(len(rows))]), ("Name", [r[0] for r in rows]),
                ("Type", [r[1] for r in rows]), ("Params", [get_human_readable_count(r[2]) for r in rows]),
                ("Mode", ["train" if r[3] else "eval" for r in rows]), ("Stage", [r[4] for r in rows]),
                ("Pipeline rank", [r[5] for r in rows])]

    def _outside_layers(self) -> list[nn.Parameter]:
        return [p for n, p in self._model.named_parameters() if not n.startswith(f"{self._attr}.")]

    @property
    def total_parameters(self) -> int:
        return sum(n for n, _ in self._table.params.values()) + sum(p.numel() for p in self._outside_layers())

    @property
    def trainable_parameters(self) -> int:
        return (sum(n for n, grad in self._table.params.values() if grad)
                + sum(p.numel() for p in self._outside_layers() if p.requires_grad))

    @property
    def model_size(self) -> float:
        try:
            bits = _BITS.get(str(self._model.trainer.precision), 32)
        except RuntimeError:  # no trainer attached
            bits = 32
        return self.total_parameters * bits / 8.0 * 1e-6

    @property
    def total_training_modes(self) -> dict[str, int]:
        modes = [m.training for _, m in self._local] + [r.training for r in self._table.rows]
        return {"train": modes.count(True), "eval": modes.count(False)}

    @property
    def total_flops(self) -> int:
        return 0

    def __str__(self) -> str:
        return _compat.format_summary_table(self.total_parameters, self.trainable_parameters, self.model_size,
                                            self.total_training_modes, 0, *self._get_summary_data())


def _summary_of(table: LayerTable, attr: str, depth: int) -> Callable[[Trainer, LightningModule], PipelineSummary]:
    def summary(trainer: Trainer, pl_module: LightningModule) -> PipelineSummary:
        return PipelineSummary(pl_module, table, attr, depth)

    return summary


def summaries_of_whole_model(trainer: Trainer, module: LightningModule, engine: Any, attr: str,
                             tied_aliases: set[str]) -> Callable[[], None]:
    """Hand every ``ModelSummary`` callback (and ``RichModelSummary``) a :class:`PipelineSummary` ([Note: the model
    summary of a split model]); returns the undo. Collective when such a callback will print (every rank alike)."""
    callbacks = [cb for cb in trainer.callbacks  # type: ignore[attr-defined]
                 if isinstance(cb, ModelSummaryCallback) and _compat.summary_depth(cb)]
    if not callbacks:
        return lambda: None
    table = gather_layer_table(module, engine, attr, tied_aliases)
    for cb in callbacks:
        setattr(cb, "_summary", _summary_of(table, attr, _compat.summary_depth(cb)))  # noqa: B010  (an override)

    def undo() -> None:
        for cb in callbacks:
            vars(cb).pop("_summary", None)

    return undo


__all__ = ["LayerTable", "ModuleRow", "PipelineSummary", "gather_layer_table", "summaries_of_whole_model"]
