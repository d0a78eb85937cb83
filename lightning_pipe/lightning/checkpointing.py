"""The strategy's side of sharded checkpoints: Lightning's save/load hooks for :class:`PipelineStrategy`.

The format and the file operations live in :mod:`lightning_pipe.checkpoint` ([Note: checkpoint format],
[Note: never half-written]); this mixin only adapts them to Lightning's Strategy hooks, and makes every check run on
all ranks so that a bad checkpoint fails everywhere at once instead of leaving peers in a collective.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from typing_extensions import override

from lightning_pipe.checkpoint import format as ckpt_lib
from lightning_pipe._compat import lightning as _compat


class PipelineCheckpointing:
    """Mixed into :class:`~lightning_pipe.PipelineStrategy` (uses its topology, config and collectives)."""

    # [Note: checkpoint format] and [Note: never half-written] in lightning_pipe/checkpoint.py.
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Each rank can only load its own layers, which exist once setup() has split the model.
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores the optimizers by parameter name

    def _checkpoint_names(self) -> Any:
        module = self.lightning_module
        layout = getattr(module, "_pipeline_layout", None)
        return ckpt_lib.ModuleNames(module, self.pipeline_config.layers_attr, layout.tied if layout is not None else ())

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's parameters and buffers under their original names (the other stages hold the rest)."""
        assert self.lightning_module is not None
        return self.lightning_module.state_dict()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """This rank's optimizer state keyed by parameter name (see ``checkpoint.flatten_optimizer``)."""
        optimizer = _compat.unwrap_optimizer(optimizer)
        index = next(i for i, o in enumerate(self.optimizers) if o is optimizer)
        return ckpt_lib.flatten_optimizer(optimizer, self._checkpoint_names(), index)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # done in load_checkpoint, where each rank reads only its own layers

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # done in load_checkpoint

    def _agree(self, fn: Any) -> Any:
        """Run a check on every rank; if it fails anywhere, raise the same CheckpointError everywhere (no hang)."""
        try:
            result, error = fn(), None
        except ckpt_lib.CheckpointError as err:
            result, error = None, str(err)
        errors: list[Any] = [None] * self.world_size
        if _compat.distributed_is_initialized():
            dist.all_gather_object(errors, error)
        else:
            errors = [error]
        first = next((e for e in errors if e), None)
        if first is not None:
            raise ckpt_lib.CheckpointError(first)
        return result

    def _gather(self, obj: Any) -> list[Any]:
        if not _compat.distributed_is_initialized():
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """A sharded directory checkpoint, written in a temporary place and renamed into place when complete."""
        if storage_options is not None:
            raise TypeError(f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported: "
                            "the pipeline writes with torch.distributed.checkpoint, not the CheckpointIO plugin.")
        path = Path(self.broadcast(str(filepath)))
        token = self.broadcast(uuid.uuid4().hex[:8])

        def check_target() -> None:
            if self.global_rank == 0 and path.is_dir() and not path.is_symlink() and not (
                    (path / ckpt_lib.META_FILENAME).exists() or (path / ckpt_lib.DCP_METADATA).exists()):
                raise ckpt_lib.CheckpointError(
                    f"Refusing to save a checkpoint over {str(path)!r}: it is a directory that is not a checkpoint.")

        self._agree(check_target)
        writes = self._topology().dp_rank == 0  # replicas hold the same values: replica 0 alone writes
        model_sd = checkpoint.pop("state_dict", None) or {}
        opt_states = checkpoint.pop("optimizer_states", None)
        state: dict[str, Any] = {}
        if writes:
            state.update({ckpt_lib.MODEL_PREFIX + k: v for k, v in model_sd.items()})
            for opt_state in opt_states or []:
                state.update(opt_state["flat"])
        groups = [s["groups"] for s in opt_states] if opt_states is not None else None
        gathered = self._gather((groups, self._checkpoint_names().order))
        tmp = ckpt_lib.partial_path(path, token)
        if self.global_rank == 0:
            tmp.mkdir(parents=True, exist_ok=True)
        self.barrier()
        ckpt_lib.write_shards(state, tmp)
        if self.global_rank == 0:
            order: dict[str, Any] = {}
            for _, rank_order in gathered:
                order.update(rank_order)
            optimizers = ckpt_lib.merge_groups([g for g, _ in gathered], order) if groups is not None else None
            topo = self._topology()
            checkpoint["pipeline"] = {
                "format": ckpt_lib.FORMAT,
                "optimizers": optimizers,
                "layout": {"pipeline_size": topo.pipeline_size, "data_parallel_size": topo.data_parallel_size,
                           "schedule": self.pipeline_config.schedule,
                           "stages": [list(r) for r in self.lightning_module._pipeline_layout.ranges]},
            }
            torch.save(checkpoint, tmp / ckpt_lib.META_FILENAME)
            ckpt_lib.commit(tmp, path, token)
        self.barrier()

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            ckpt_lib._remove(Path(filepath))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Each rank reads its own parameters (and their optimizer state) from a sharded directory written by any
        layout, or from an ordinary single-file Lightning checkpoint."""
        path = Path(self.broadcast(str(checkpoint_path)))
        if self.global_rank == 0:
            ckpt_lib._recover(path)
        self.barrier()
        module = self.lightning_module
        assert module is not None
        kind = self._agree(lambda: ckpt_lib.describe(path))
        names = self._checkpoint_names()
        local_sd = module.state_dict()
        fitting = module.trainer.state.fn == TrainerFn.FITTING and bool(self.optimizers)
        if kind == "sharded":
            md, meta = self._agree(lambda: ckpt_lib.read_sharded_metadata(path))
            available = {k[len(ckpt_lib.MODEL_PREFIX):]: v for k, v in md.state_dict_metadata.items()
                         if k.startswith(ckpt_lib.MODEL_PREFIX)}
            shapes = {k: tuple(v.size) for k, v in available.items() if hasattr(v, "size")}
        else:
            ckpt = self._agree(lambda: ckpt_lib.load_file(path))
            available = ckpt["state_dict"]
            shapes = {k: tuple(v.shape) for k, v in available.items() if isinstance(v, Tensor)}
        self._check_names(path, local_sd, available, shapes, module.strict_loading)

        rest: dict[str, Any]
        if kind == "sharded":
            saved_opts = meta["pipeline"].get("optimizers")
            keys: dict[str, Any] = {ckpt_lib.MODEL_PREFIX + k: v for k, v in local_sd.items() if k in available}
            if fitting:
                self._agree(lambda: self._check_optimizers(saved_opts, names))
                for i, opt in enumerate(self.optimizers):
                    entries = ckpt_lib.optimizer_entries(md.state_dict_metadata, i)
                    for p in (p for g in opt.param_groups for p in g["params"]):
                        for flat_key in entries.get(names.name_of[id(p)], {}).values():
                            keys[flat_key] = None
            loaded = ckpt_lib.load_flat(path, keys, md)
            module.load_state_dict({k: loaded[ckpt_lib.MODEL_PREFIX + k] for k in local_sd if k in available},
                                   strict=False)
            if fitting:
                for i, opt in enumerate(self.optimizers):
                    entries = ckpt_lib.optimizer_entries(loaded, i)
                    opt.load_state_dict(ckpt_lib.build_local_optimizer_state(
                        opt, names, saved_opts[i],
                        lambda n, e=entries: {k: loaded[fk] for k, fk in e[n].items()} if n in e else None))
            rest = {k: v for k, v in meta.items() if k != "pipeline"}
        else:
            module.load_state_dict({k: available[k] for k in local_sd if k in available}, strict=False)
            if fitting:
                self._load_positional_optimizers(ckpt, names)
            rest = {k: v for k, v in ckpt.items() if k not in ("state_dict", "optimizer_states")}
        return rest

    def _check_names(self, path: Any, local_sd: dict[str, Any], available: Any, shapes: dict[str, tuple],
                     strict: bool) -> None:
        missing = [k for k in local_sd if k not in available]
        wrong = [f"{k}: checkpoint {list(shapes[k])} vs model {list(local_sd[k].shape)}" for k in local_sd
                 if k in shapes and tuple(local_sd[k].shape) != shapes[k]]
        gathered = self._gather((missing, list(local_sd), wrong))
        all_missing = sorted({k for m, _, _ in gathered for k in m})
        expected = {k for _, e, _ in gathered for k in e}
        unexpected = sorted(k for k in available if k not in expected)
        all_wrong = sorted({w for _, _, ws in gathered for w in ws})
        if all_wrong:
            raise ckpt_lib.CheckpointError(f"The checkpoint {str(path)!r} does not match the model: shapes differ for "
                                  f"{all_wrong[:8]}{' ...' if len(all_wrong) > 8 else ''}.")
        if strict and (all_missing or unexpected):
            raise ckpt_lib.CheckpointError(ckpt_lib.name_mismatch_message(path, all_missing, unexpected))

    def _check_optimizers(self, saved_opts: Any, names: Any) -> None:
        if saved_opts is None:
            raise ckpt_lib.CheckpointError("The checkpoint holds no optimizer state (saved with weights_only=True), so "
                                  "training cannot resume from it. Load its weights with "
                                  "`Model.load_from_checkpoint(...)` and start a new fit, or use a full checkpoint.")
        if len(saved_opts) != len(self.optimizers):
            raise ckpt_lib.CheckpointError(f"The checkpoint has {len(saved_opts)} optimizer(s) but configure_optimizers "
                                  f"returned {len(self.optimizers)}.")
        for i, opt in enumerate(self.optimizers):
            error = ckpt_lib.check_groups(opt, names, saved_opts[i], i)
            if error:
                raise ckpt_lib.CheckpointError(error)

    def _load_positional_optimizers(self, ckpt: dict[str, Any], names: Any) -> None:
        """Optimizer state of a single-file checkpoint (ids by position) -> this rank's parameters, by name."""
        states = ckpt.get("optimizer_states")
        group_names = ckpt.get(ckpt_lib.NAMES_KEY)
        if group_names is None and states is not None:
            # A single-device run's checkpoint: its optimizer listed the parameters in model order, group by group.
            mine = [[[names.name_of[id(p)] for p in g["params"]] for g in opt.param_groups] for opt in self.optimizers]
            gathered = self._gather((mine, names.order))
            order: dict[str, Any] = {}
            for _, rank_order in gathered:
                order.update(rank_order)
            per_rank = [[[{"params": g} for g in opt] for opt in m] for m, _ in gathered]
            group_names = [[g["params"] for g in opt] for opt in ckpt_lib.merge_groups(per_rank, order)]

        def prepare() -> list[tuple[list[dict], dict]]:
            if states is None:
                self._check_optimizers(None, names)
            out = []
            for i, saved in enumerate(states):
                by_name = ckpt_lib.names_from_positions(saved, group_names[i], i)
                groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(n)}
                          for g, n in zip(saved["param_groups"], group_names[i])]
                out.append((groups, by_name))
            self._check_optimizers([g for g, _ in out], names)
            return out

        prepared = self._agree(prepare)
        for opt, (groups, by_name) in zip(self.optimizers, prepared):
            def state_of(n: str, b: dict = by_name) -> Any:
                entries = b.get(n)
                return None if entries is None else {k: (v.clone() if isinstance(v, Tensor) else v)
                                                     for k, v in entries.items()}

            opt.load_state_dict(ckpt_lib.build_local_optimizer_state(opt, names, groups, state_of))
