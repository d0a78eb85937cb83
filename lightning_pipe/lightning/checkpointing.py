"""The strategy's side of sharded checkpoints: what PipelineStrategy's save/load hooks call.

The format and the file operations live in :mod:`lightning_pipe.checkpoint` ([Note: checkpoint format],
[Note: never half-written], [Note: checkpoint checksums]); :class:`ShardedCheckpointer` adapts them to Lightning's
Strategy hooks (as Lightning's ModelParallelStrategy calls fabric's checkpoint helpers) and makes every check run on
all ranks, so that a bad checkpoint fails everywhere at once instead of leaving peers in a collective.
"""

from __future__ import annotations

import copy
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, overload

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_pipe._compat import lightning as _compat
from lightning_pipe.checkpoint import files, reading
from lightning_pipe.checkpoint.checksums import verify_checksums
from lightning_pipe.checkpoint.convert import consolidate
from lightning_pipe.checkpoint.format import (
    DCP_METADATA,
    FORMAT,
    META_FILENAME,
    MODEL_PREFIX,
    NAMES_KEY,
    STAGE_STATE_PREFIX,
    CheckpointError,
    ModuleNames,
    ShardedOptimizerState,
    build_local_optimizer_state,
    check_groups,
    flatten_optimizer,
    merge_groups,
    name_mismatch_message,
    named_groups,
    names_from_positions,
    optimizer_entries,
    optimizer_prefix,
    saved_layout,
    stage_state_key,
)
from lightning_pipe.config import PipelineConfig
from lightning_pipe.lightning import same_call
from lightning_pipe.lightning.async_checkpoint import AsyncSaver, staged, write_group, write_in_background
from lightning_pipe.parallel.dtensor import full_values, shard_like, shard_optimizer_state, shard_state_like
from lightning_pipe.parallel.experts import is_expert
from lightning_pipe.parallel.topology import Topology
from lightning_pipe.runtime import stage_state

T = TypeVar("T")
P = TypeVar("P")
_NOTHING: Any = object()
NO_OPTIMIZER_STATE = ("The checkpoint holds no optimizer state (saved with weights_only=True), so training cannot "
                      "resume from it. Load its weights with `Model.load_from_checkpoint(...)` and start a new fit, "
                      "or use a full checkpoint.")


def save_on_every_rank(strategy: Any, checkpoint: dict[str, Any], filepath: Any, storage_options: Any) -> None:
    """``PipelineStrategy.save_checkpoint``: every rank's part, sharded or consolidated ([Note: consolidated
    checkpoints]), once every rank is known to be saving ([Note: every rank saves] in same_call.py)."""
    if strategy._failed:
        # A run that failed (here or on a peer: reported before any on_exception checkpoint) cannot write a
        # sharded checkpoint: every rank writes its part together, and the ranks are stopping. Said, not
        # attempted: the attempt would wait on a peer that is gone and end in the transport's error.
        warnings.warn(f"lightning_pipe: no checkpoint written at {str(filepath)!r} on rank {strategy.global_rank}: "
                      "the run failed, and a sharded checkpoint needs every rank to write its part (an "
                      "OnExceptionCheckpoint saves on an agreed SIGTERM stop, not after an error). The last "
                      "complete checkpoint stays.", stacklevel=3)
        return
    if not same_call.strategy_meet(strategy, "save", f"Trainer.save_checkpoint({str(filepath)!r})"):
        return  # a peer failed meanwhile: as above, the ranks are stopping
    checkpointer = strategy._checkpointer()
    if strategy._save_consolidated:
        strategy.wait_for_checkpoint()
        checkpointer.save_consolidated(checkpoint, filepath, storage_options)
    else:
        checkpointer.save(checkpoint, filepath, storage_options, saver=strategy._saver)


@dataclass(frozen=True)
class RankGroup:
    """The collectives a checkpoint needs: the strategy's broadcast and barrier, and object gathers."""

    rank: int
    world_size: int
    broadcast: Callable[[Any], Any]
    barrier: Callable[[], None]

    def gather(self, obj: Any) -> list[Any]:
        if not _compat.distributed_is_initialized():
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    @overload
    def agree(self, fn: Callable[[], T]) -> T: ...

    @overload
    def agree(self, fn: Callable[[], Any], payload: P) -> list[P]: ...

    def agree(self, fn: Callable[[], Any], payload: Any = _NOTHING) -> Any:
        """Run a check on every rank; if it fails anywhere, raise the same CheckpointError everywhere (no hang).
        Returns the check's result, or with ``payload`` every rank's payload (gathered along, no extra collective)."""
        try:
            result, error = fn(), None
        except CheckpointError as err:
            result, error = None, str(err)
        gathered = self.gather((error, None if payload is _NOTHING else payload))
        first = next((e for e, _ in gathered if e), None)
        if first is not None:
            raise CheckpointError(first)
        return result if payload is _NOTHING else [p for _, p in gathered]


class ShardedCheckpointer:
    """Save and load one PipelineStrategy's sharded checkpoints; every method runs on every rank."""

    def __init__(self, ranks: RankGroup, module: LightningModule, optimizers: Sequence[torch.optim.Optimizer],
                 config: PipelineConfig, topology: Topology, stages: Sequence[object] = ()) -> None:
        self.ranks, self.module, self.optimizers = ranks, module, list(optimizers)
        self.config, self.topology = config, topology
        self.stages = list(stages)  # this rank's pipeline stages: [Note: stage state in checkpoints]
        self.saved_layout: dict[str, Any] | None = None
        """After :meth:`load` of a sharded checkpoint: the layout it was saved with (schedule, sizes, stages)."""
        self.stage_state_complete = True
        """After :meth:`load` for fitting: whether every rank's stages found all they keep across batches."""

    def names(self) -> ModuleNames:
        layout = getattr(self.module, "_pipeline_layout", None)
        return ModuleNames(self.module, self.config.layers_attr, layout.tied if layout is not None else ())

    def _layout_ranges(self) -> list[range]:
        layout = getattr(self.module, "_pipeline_layout", None)  # set by the strategy's setup
        return list(layout.ranges) if layout is not None else []

    def optimizer_state(self, optimizer: Any) -> ShardedOptimizerState:
        """This rank's optimizer state keyed by parameter name (see ``checkpoint.format.flatten_optimizer``)."""
        optimizer = _compat.unwrap_optimizer(optimizer)
        index = next(i for i, o in enumerate(self.optimizers) if o is optimizer)
        return flatten_optimizer(optimizer, self.names(), index)

    # ------------------------------------------------------------------ save
    def save(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None,
             saver: AsyncSaver | None = None) -> None:
        """A sharded directory checkpoint, written in a temporary place and renamed into place when complete; with
        ``saver``, written on a thread ([Note: asynchronous checkpoints])."""
        if storage_options is not None:
            raise TypeError("`PipelineStrategy.save_checkpoint(..., storage_options=...)` is not supported: the "
                            "pipeline writes with torch.distributed.checkpoint, not the CheckpointIO plugin.")
        ranks = self.ranks
        path = Path(ranks.broadcast(str(filepath)))
        token = ranks.broadcast(uuid.uuid4().hex[:8])

        def check_target() -> None:
            if ranks.rank == 0 and path.is_dir() and not path.is_symlink() and not (
                    (path / META_FILENAME).exists() or (path / DCP_METADATA).exists()):
                raise CheckpointError(
                    f"Refusing to save a checkpoint over {str(path)!r}: it is a directory that is not a checkpoint.")

        # replicas hold the same values: replica 0 alone writes; tensor ranks gather the same whole tensors: rank 0
        writes = self.topology.dp_rank == 0 and self.topology.tp_rank == 0
        # sharded experts: the first holder of each, under its global name ([Note: expert parallelism])
        experts = {n for n, p in self.module.named_parameters() if is_expert(p)}
        writes_experts = bool(experts) and self.topology.dp_rank < self.config.expert_parallel_size

        def written(name: str) -> bool:
            return writes_experts if name in experts else writes

        # FSDP-sharded / tensor-parallel stages: every rank of the mesh gathers full tensors, so the format does not
        # depend on the layout.
        model_sd = full_values(checkpoint.pop("state_dict", None) or {})
        opt_states = checkpoint.pop("optimizer_states", None)
        state: dict[str, Any] = {}
        for i, opt_state in enumerate(opt_states or []):
            flat = full_values(opt_state["flat"])
            prefix = optimizer_prefix(i)
            state.update({k: v for k, v in flat.items() if written(k.removeprefix(prefix).rpartition(".")[0])})
        state.update({MODEL_PREFIX + k: v for k, v in model_sd.items() if written(k)})
        if opt_states is not None:  # what the stages keep across batches, with the training state it belongs to
            names = self.names()
            # every tensor rank gathers (a collective), then the writers keep theirs, as for the module's state
            kept = full_values({stage_state_key(names.name_of[id(p)], key): value
                                for p, key, value in stage_state.checkpoint_state(self.stages)
                                if id(p) in names.owned})
            state.update({k: v for k, v in kept.items()
                          if written(k.removeprefix(STAGE_STATE_PREFIX).rpartition(".")[0])})
        groups = [s["groups"] for s in opt_states] if opt_states is not None else None
        # the target check and every rank's size in one gather (the size names what a full disk lacked)
        needed = sum(ranks.agree(check_target, payload=files.state_bytes(state)))
        tmp = files.partial_path(path, token)
        if saver is not None:
            self._write_later(saver, path, tmp, token, state, checkpoint, groups, needed)
            return
        try:
            self._write(ranks, path, tmp, token, state, checkpoint, groups, needed)
        except BaseException as err:  # DCP's CheckpointException is a BaseException
            _failed_save(err, tmp, path, needed)

    # [Note: consolidated checkpoints]
    # PipelineStrategy(save_consolidated=True) writes every checkpoint as one ordinary Lightning ``.ckpt`` file at the
    # path Lightning asks for, so ``torch.load(path)``, ``Model.load_from_checkpoint(path)`` and any strategy's resume
    # read it as they read a single device's. Every rank writes its shards into a hidden directory beside it, as for a
    # sharded save; rank 0 then reads them back, writes the one file atomically (the previous checkpoint stays until
    # the new one is whole) and removes the directory. Rank 0 holds the whole model and its optimizer state in
    # memory while it writes, and a save costs one more read and write of every byte; a resume reads the whole file
    # on every rank. A failure on rank 0 is raised on every rank (one gather after the write).
    def save_consolidated(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """One ``.ckpt`` file at ``filepath`` ([Note: consolidated checkpoints]); every rank calls it."""
        ranks = self.ranks
        path = Path(ranks.broadcast(str(filepath)))
        sharded = path.parent / f".{path.name}.sharded-{ranks.broadcast(uuid.uuid4().hex[:8])}"
        self.save(checkpoint, sharded, storage_options)

        def write() -> None:
            if ranks.rank != 0:
                return
            try:
                consolidate(sharded, path)
            except CheckpointError:
                raise
            except Exception as err:  # (a full disk, say): raised on every rank, not only here
                raise CheckpointError(f"Writing the consolidated checkpoint {str(path)!r} failed: "
                                      f"{type(err).__name__}: {err}") from err
            finally:
                files.remove(sharded)

        ranks.agree(write)

    def _write(self, ranks: RankGroup, path: Path, tmp: Path, token: str, state: dict[str, Any],
               checkpoint: dict[str, Any], groups: list[Any] | None, needed: int) -> None:
        if ranks.rank == 0:
            tmp.mkdir(parents=True, exist_ok=True)
        ranks.barrier()
        shard_checksums = files.write_shards(state, tmp)  # module attribute: tests replace it to die mid-save
        gathered = ranks.gather((groups, self.names().order, shard_checksums))
        every_shard: dict[str, Any] = {}
        meta = None
        if ranks.rank == 0:
            for _, _, rank_checksums in gathered:
                every_shard.update(rank_checksums)
            meta = self._meta(checkpoint, [(g, o) for g, o, _ in gathered], groups is not None)

        def finish() -> None:  # rank 0's part; its failure (a full disk) stops every rank with the same error
            if meta is not None:
                files.seal_and_commit(tmp, path, token, meta, every_shard, needed)

        ranks.agree(finish)

    def _write_later(self, saver: AsyncSaver, path: Path, tmp: Path, token: str, state: dict[str, Any],
                     checkpoint: dict[str, Any], groups: list[Any] | None, needed: int) -> None:
        """[Note: asynchronous checkpoints]: what ``meta.pt`` needs is gathered and the state copied now; the
        shards, the checksums, ``meta.pt`` and the rename follow on the saver's thread."""
        ranks = self.ranks
        if ranks.rank == 0:
            tmp.mkdir(parents=True, exist_ok=True)
        gathered = ranks.gather((groups, self.names().order))  # also the barrier: tmp exists for every rank
        meta = self._meta(copy.deepcopy(checkpoint), gathered, groups is not None) if ranks.rank == 0 else None
        group = write_group(ranks.world_size) if _compat.distributed_is_initialized() else None
        copied = staged(state)

        def write() -> None:
            try:
                write_in_background(copied, tmp, path, token, meta, needed, group, ranks.world_size)
            except BaseException as err:
                _failed_save(err, tmp, path, needed)

        saver.submit(str(path), write)

    def _meta(self, checkpoint: dict[str, Any], gathered: Sequence[tuple[Any, Any]],
              with_optimizers: bool) -> dict[str, Any]:
        """``meta.pt`` (rank 0): the rest of Lightning's checkpoint, with the layout and the optimizers' groups
        of every rank (``gathered``: each rank's groups and parameter order)."""
        order: dict[str, Any] = {}
        for _, rank_order in gathered:
            order.update(rank_order)
        optimizers = merge_groups([g for g, _ in gathered], order) if with_optimizers else None
        topo = self.topology
        checkpoint["pipeline"] = {
            "format": FORMAT,
            "optimizers": optimizers,
            "layout": {"pipeline_size": topo.pipeline_size, "data_parallel_size": topo.data_parallel_size,
                       "schedule": self.config.schedule,
                       "stages": [list(r) for r in self._layout_ranges()],
                       # the split was the rebalancer's: a resumed run that rebalances goes back to it
                       "rebalance_every_n_steps": self.config.rebalance_every_n_steps},
        }
        return checkpoint

    # ------------------------------------------------------------------ load
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


def _failed_save(error: BaseException, tmp: Path, path: Path, needed: int) -> None:
    """A save failed: remove what it wrote (the earlier checkpoints stay as they are) and raise its error, as
    "no space left" when that is what it was."""
    files.remove(tmp)
    full = files.no_space_error(error, path, needed)
    if full is not None:
        raise full from error
    raise error
