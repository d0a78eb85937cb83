"""The load side of :class:`~lightning_pipe.lightning.checkpointing.ShardedCheckpointer`: each rank reads its own
parameters (and their optimizer state) from a sharded directory written by any layout, or from an ordinary single
file; every check agreed by every rank ([Note: checkpoint format])."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_pipe._compat import lightning as _compat
from lightning_pipe.checkpoint import files, reading
from lightning_pipe.checkpoint.checksums import verify_checksums
from lightning_pipe.checkpoint.format import (
    MODEL_PREFIX,
    NAMES_KEY,
    CheckpointError,
    ModuleNames,
    build_local_optimizer_state,
    check_groups,
    merge_groups,
    name_mismatch_message,
    named_groups,
    names_from_positions,
    optimizer_entries,
    saved_layout,
    stage_state_key,
)
from lightning_pipe.config import PipelineConfig
from lightning_pipe.parallel.dtensor import shard_like, shard_optimizer_state, shard_state_like
from lightning_pipe.parallel.topology import Topology
from lightning_pipe.runtime import stage_state

NO_OPTIMIZER_STATE = ("The checkpoint holds no optimizer state (saved with weights_only=True), so training cannot "
                      "resume from it. Load its weights with `Model.load_from_checkpoint(...)` and start a new fit, "
                      "or use a full checkpoint.")


class CheckpointLoader:
    """What a load reads, on every rank; :class:`ShardedCheckpointer` adds the saves."""

    ranks: Any
    module: LightningModule
    optimizers: list[torch.optim.Optimizer]
    config: PipelineConfig
    topology: Topology
    stages: list[object]
    saved_layout: dict[str, Any] | None
    stage_state_complete: bool

    def names(self) -> ModuleNames:
        raise NotImplementedError

    def load(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Each rank reads its own parameters (and their optimizer state) from a sharded directory written by any
        layout, or from an ordinary single-file Lightning checkpoint; returns the rest of the checkpoint. Read as
        data unless ``weights_only=False`` ([Note: a checkpoint is data]): a refused object, like every other bad
        checkpoint, fails every rank with the same CheckpointError."""
        ranks = self.ranks
        if weights_only is None:  # what the user gave Trainer.fit, which Lightning 2.6 does not pass on here
            weights_only = _compat.requested_weights_only(self.module.trainer)
        path = Path(ranks.broadcast(str(checkpoint_path)))
        if ranks.rank == 0:
            files.recover(path)  # put back a checkpoint left aside by a save interrupted mid-swap
        ranks.barrier()
        if ranks.agree(lambda: reading.describe(path)) == "sharded":
            return self._load_sharded(path, weights_only)
        return self._load_file(path, weights_only)

    def _fitting(self) -> bool:
        return self.module.trainer.state.fn == TrainerFn.FITTING and bool(self.optimizers)

    def _load_file(self, path: Path, weights_only: bool | None) -> dict[str, Any]:
        """An ordinary single-file checkpoint: every rank reads it and keeps its own parameters."""
        module = self.module
        ckpt = self.ranks.agree(lambda: reading.load_file(path, weights_only))
        available, local_sd = ckpt["state_dict"], module.state_dict()
        shapes = {k: tuple(v.shape) for k, v in available.items() if isinstance(v, Tensor)}
        self._check_names(path, local_sd, available, shapes, module.strict_loading)
        module.load_state_dict(shard_state_like({k: available[k] for k in local_sd if k in available}, local_sd),
                               strict=False)
        if self._fitting():
            self._load_positional_optimizers(ckpt, self.names())
            self._restore_stage_state({})  # a single-file checkpoint holds none
        return {k: v for k, v in ckpt.items() if k not in ("state_dict", "optimizer_states")}

    def _load_sharded(self, path: Path, weights_only: bool | None) -> dict[str, Any]:
        """A sharded directory: the checks on every rank, then each rank reads only its own keys."""
        ranks, module = self.ranks, self.module
        ranks.agree(lambda: verify_checksums(path, ranks.rank, ranks.world_size))  # each rank checks 1/N
        md, meta = ranks.agree(lambda: reading.read_sharded_metadata(path, weights_only))
        available = {k[len(MODEL_PREFIX):]: v for k, v in md.state_dict_metadata.items() if k.startswith(MODEL_PREFIX)}
        local_sd = module.state_dict()
        shapes = {k: tuple(v.size) for k, v in available.items() if hasattr(v, "size")}
        self._check_names(path, local_sd, available, shapes, module.strict_loading)
        names, fitting = self.names(), self._fitting()
        saved_opts = meta["pipeline"].get("optimizers")
        if fitting:
            ranks.agree(lambda: self._check_optimizers(saved_opts, names))
        keys, kept = self._keys_to_read(md.state_dict_metadata, local_sd, available, names, fitting)
        loaded = ranks.agree(lambda: reading.load_flat(path, keys, md, weights_only))  # a failed read stops all
        module.load_state_dict(shard_state_like({k: loaded[MODEL_PREFIX + k] for k in local_sd if k in available},
                                                local_sd), strict=False)
        if fitting:
            for i, opt in enumerate(self.optimizers):
                entries = optimizer_entries(loaded, i)

                def state_of(name: str, e: dict[str, dict[str, str]] = entries) -> dict[str, Any] | None:
                    return {k: loaded[fk] for k, fk in e[name].items()} if name in e else None

                opt.load_state_dict(shard_optimizer_state(
                    opt, build_local_optimizer_state(opt, names, saved_opts[i], state_of)))
            self._restore_stage_state({(id(p), key): shard_like(loaded[k], p) for k, (p, key) in kept.items()})
        self.saved_layout = saved_layout(meta["pipeline"])
        return {k: v for k, v in meta.items() if k != "pipeline"}

    def _keys_to_read(self, saved: Mapping[str, Any], local_sd: dict[str, Any], available: Mapping[str, Any],
                      names: ModuleNames, fitting: bool) -> tuple[dict[str, Any], dict[str, tuple[Tensor, str]]]:
        """The flat keys this rank reads (-> a tensor to read into, or None), and the keys of what its stages keep
        across batches (-> the live parameter and its key)."""
        # (a sharded parameter reads its full tensor, then keeps its own shard: shard_state_like)
        keys: dict[str, Any] = {MODEL_PREFIX + k: None if isinstance(v, DTensor) else v for k, v in local_sd.items()
                                if k in available}
        kept: dict[str, tuple[Tensor, str]] = {}
        if not fitting:
            return keys, kept
        for i, opt in enumerate(self.optimizers):
            entries = optimizer_entries(saved, i)
            for p in (p for g in opt.param_groups for p in g["params"]):
                for flat_key in entries.get(names.name_of[id(p)], {}).values():
                    keys[flat_key] = None
        for p, key in stage_state.state_slots(self.stages):
            name = names.name_of.get(id(p))
            state_key = stage_state_key(name, key) if name is not None else None
            if state_key is not None and state_key in saved:
                keys[state_key] = None
                kept[state_key] = (p, key)
        return keys, kept

    def _restore_stage_state(self, values: dict[tuple[int, str], Tensor]) -> None:
        """Hand the stages what they keep across batches; whether every rank's found all of it (one gather)."""
        self.stage_state_complete = all(self.ranks.gather(stage_state.restore_state(self.stages, values)))

    def _check_names(self, path: Any, local_sd: dict[str, Any], available: Any, shapes: dict[str, tuple],
                     strict: bool) -> None:
        missing = [k for k in local_sd if k not in available]
        wrong = [f"{k}: checkpoint {list(shapes[k])} vs model {list(local_sd[k].shape)}" for k in local_sd
                 if k in shapes and tuple(local_sd[k].shape) != shapes[k]]
        gathered = self.ranks.gather((missing, list(local_sd), wrong))
        all_missing = sorted({k for m, _, _ in gathered for k in m})
        expected = {k for _, e, _ in gathered for k in e}
        unexpected = sorted(k for k in available if k not in expected)
        all_wrong = sorted({w for _, _, ws in gathered for w in ws})
        if all_wrong or (strict and (all_missing or unexpected)):  # names too: a shape alone reads as one bad tensor
            raise CheckpointError(name_mismatch_message(path, all_missing, unexpected, all_wrong))

    def _check_optimizers(self, saved_opts: Any, names: ModuleNames) -> None:
        if saved_opts is None:
            raise CheckpointError(NO_OPTIMIZER_STATE)
        if len(saved_opts) != len(self.optimizers):
            raise CheckpointError(f"The checkpoint has {len(saved_opts)} optimizer(s) but configure_optimizers "
                                  f"returned {len(self.optimizers)}.")
        for i, opt in enumerate(self.optimizers):
            error = check_groups(opt, names, saved_opts[i], i)
            if error:
                raise CheckpointError(error)

    def _load_positional_optimizers(self, ckpt: dict[str, Any], names: ModuleNames) -> None:
        """Optimizer state of a single-file checkpoint (ids by position) -> this rank's parameters, by name."""
        states = ckpt.get("optimizer_states")
        group_names = ckpt.get(NAMES_KEY)
        if group_names is None and states is not None:
            # A single-device run's checkpoint: its optimizer listed the parameters in model order, group by group.
            mine = [[[names.name_of[id(p)] for p in g["params"]] for g in opt.param_groups] for opt in self.optimizers]
            gathered = self.ranks.gather((mine, names.order))
            order: dict[str, Any] = {}
            for _, rank_order in gathered:
                order.update(rank_order)
            per_rank = [[[{"params": g} for g in opt] for opt in m] for m, _ in gathered]
            group_names = [[g["params"] for g in opt] for opt in merge_groups(per_rank, order)]

        def prepare() -> list[tuple[list[dict], dict]]:
            if states is None or group_names is None:  # (names are found whenever there are states)
                raise CheckpointError(NO_OPTIMIZER_STATE)
            out = [(named_groups(saved, group_names[i]), names_from_positions(saved, group_names[i], i))
                   for i, saved in enumerate(states)]
            self._check_optimizers([g for g, _ in out], names)
            return out

        prepared = self.ranks.agree(prepare)
        for opt, (groups, by_name) in zip(self.optimizers, prepared):
            def state_of(n: str, b: dict = by_name) -> Any:
                entries = b.get(n)
                return None if entries is None else {k: (v.clone() if isinstance(v, Tensor) else v)
                                                     for k, v in entries.items()}

            opt.load_state_dict(shard_optimizer_state(opt, build_local_optimizer_state(opt, names, groups, state_of)))


__all__ = ["CheckpointLoader", "NO_OPTIMIZER_STATE"]
