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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, overload

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule

from lightning_pipe._compat import lightning as _compat
from lightning_pipe.checkpoint import files
from lightning_pipe.checkpoint.convert import consolidate
from lightning_pipe.checkpoint.format import (
    DCP_METADATA,
    FORMAT,
    META_FILENAME,
    MODEL_PREFIX,
    STAGE_STATE_PREFIX,
    CheckpointError,
    ModuleNames,
    ShardedOptimizerState,
    flatten_optimizer,
    merge_groups,
    optimizer_prefix,
    stage_state_key,
)
from lightning_pipe.config import PipelineConfig
from lightning_pipe.lightning import same_call
from lightning_pipe.lightning.async_checkpoint import AsyncSaver, staged, write_group, write_in_background
from lightning_pipe.lightning.checkpoint_loading import CheckpointLoader
from lightning_pipe.parallel.dtensor import full_values
from lightning_pipe.parallel.experts import is_expert
from lightning_pipe.parallel.topology import Topology
from lightning_pipe.runtime import stage_state

T = TypeVar("T")
P = TypeVar("P")
_NOTHING: Any = object()

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


class ShardedCheckpointer(CheckpointLoader):
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


def _failed_save(error: BaseException, tmp: Path, path: Path, needed: int) -> None:
    """A save failed: remove what it wrote (the earlier checkpoints stay as they are) and raise its error, as
    "no space left" when that is what it was."""
    files.remove(tmp)
    full = files.no_space_error(error, path, needed)
    if full is not None:
        raise full from error
    raise error
