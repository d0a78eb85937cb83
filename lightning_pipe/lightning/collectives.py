"""Lightning's collectives and prediction writers under the pipeline: over the ranks that read different data, as
on DDP.

[Note: collectives over the data ranks]
On DDP every process reads its own share of the data, so Lightning's collectives (``self.all_gather``,
``trainer.strategy.reduce`` / ``broadcast`` / ``barrier``, ``self.log(sync_dist=True)``) combine one value per
share. Under the pipeline the ranks of one replica (its stages, its tensor ranks) read the same batches and hold the
same values; only replicas and FSDP shards read different data (``Topology.dp_rank``, the *data ranks*). Gathered or
summed over the world, each share would count once per pipeline x tensor rank: the DDP idiom for an epoch total,
``self.all_gather(x).sum()``, gave 140 on 2 pipeline ranks where one device gives 70. So, without a ``group``:

- ``all_gather`` gathers over this rank's data group: ``[data ranks, ...]`` on every rank, as DDP gives
  ``[world, ...]`` (``[1, ...]`` with one replica, as DDP on one process);
- ``reduce`` reduces over it (``self.log(sync_dist=True)`` and torchmetrics too: lightning/metrics.py);
- ``broadcast(obj, src)`` reads ``src`` as a data rank, as DDP's ranks are: every rank of the job gets what the
  first rank of data rank ``src`` holds (pipeline rank 0, tensor rank 0), so the whole job ends with one value;
- ``barrier`` waits for every rank, as on DDP (a point in the program, not a reduction).

``group=torch.distributed.group.WORLD`` (``self.all_gather(x, group=...)``, ``trainer.strategy.reduce(x,
group=...)``, ``self.log(..., sync_dist_group=...)``) reaches every rank instead. A value one stage holds alone (a
quantity of a layer on another rank) reaches every rank with ``PipelineModule.layer_value`` (lightning/remote.py).

Prediction writers (``BasePredictionWriter``) write what their process predicted. Under the pipeline every rank of a
replica predicts the same samples, so a writer's hooks run on one rank per data rank (pipeline rank 0, tensor rank
0) and each sample is written once, as on DDP; the other ranks skip them. A collective inside ``write_on_*`` must
stay among those ranks: ``pl_module.all_gather`` and ``trainer.strategy.reduce`` without a group do (the writing
ranks are exactly one data group).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import Tensor

from lightning_pipe._compat import lightning as _compat
from lightning_pipe.config import PipelineConfigError
from lightning_pipe.lightning import world
from lightning_pipe.parallel.group_cache import shared_group
from lightning_pipe.parallel.topology import Topology


def data_group(topology: Topology) -> Any | None:
    """This rank's data group (the ranks of its pipeline and tensor position that read different data); ``None``
    with one data rank. The group the engine talks over for replicas, kept for the process (group_cache.py): every
    rank requests every data group in the same order, so this is collective like the engine's setup."""
    if topology.dp_degree == 1:
        return None
    mine = None
    for pp_rank in range(topology.pipeline_size):
        for t in range(topology.tensor_parallel_size):
            group = shared_group(topology.dp_group_ranks(pp_rank, t), "replicas")
            if pp_rank == topology.pp_rank and t == topology.tp_rank:
                mine = group
    return mine


def all_gather(tensor: Tensor, topology: Topology, group: Any | None, sync_grads: bool) -> Tensor:
    """``[data ranks, ...]``: ``tensor`` from every data rank ([Note: collectives over the data ranks]); with
    ``group``, over that group (Lightning's own gather)."""
    if group is not None:
        return _compat.all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)
    if topology.dp_degree == 1:
        with contextlib.nullcontext() if sync_grads else torch.no_grad():
            return torch.stack([tensor.contiguous()])  # what DDP on one process returns
    return _compat.all_gather_ddp_if_available(tensor, group=data_group(topology),
                                               sync_grads=sync_grads)


def reduce(tensor: Tensor | Any, topology: Topology, group: Any | None, reduce_op: Any | str | None) -> Tensor | Any:
    """``tensor`` reduced over the data ranks ([Note: collectives over the data ranks]), or over ``group``."""
    if group is not None:
        return world.reduce(tensor, group, reduce_op)
    if topology.dp_degree == 1:
        return tensor  # one data rank: every rank already holds the value
    return world.reduce(tensor, data_group(topology), reduce_op)


def broadcast_source(topology: Topology, src: int) -> int:
    """The global rank whose object ``broadcast(obj, src)`` hands every rank: the first rank of data rank ``src``."""
    if not 0 <= src < topology.dp_degree:
        raise PipelineConfigError(
            f"broadcast(obj, src={src}): under PipelineStrategy src is a data-parallel rank, as on DDP, where every "
            f"rank reads its own data; this run has {topology.dp_degree} (data_parallel_size x fsdp_size), so src is "
            f"0 to {topology.dp_degree - 1}. Every rank then gets what the first rank of that replica holds. To send "
            "from one particular process, use torch.distributed.broadcast_object_list(..., src=<global rank>).")
    return topology.rank_of(src, 0, 0)


class DataCollectives:
    """PipelineStrategy's ``broadcast`` / ``all_gather`` / ``reduce`` ([Note: collectives over the data ranks]);
    a mixin before Lightning's ``ParallelStrategy``, over the strategy's :class:`Topology`."""

    def _topology(self) -> Topology:
        raise NotImplementedError  # the strategy's

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Every rank gets the object of data rank ``src``'s first rank."""
        return world.broadcast(obj, broadcast_source(self._topology(), src))

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """``[data ranks, ...]`` unless ``group`` is given."""
        return all_gather(tensor, self._topology(), group, sync_grads)

    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any | str | None = "mean") -> Any:
        """Over the ranks that read different data unless ``group`` is given."""
        return reduce(tensor, self._topology(), group, reduce_op)


def writers_on_data_ranks(trainer: Trainer, topology: Topology) -> Callable[[], None]:
    """On ranks other than pipeline rank 0 / tensor rank 0, turn the prediction writers' hooks off until the
    returned undo runs ([Note: collectives over the data ranks])."""
    if topology.pp_rank == 0 and topology.tp_rank == 0:
        return lambda: None
    writers = [cb for cb in trainer.callbacks if isinstance(cb, BasePredictionWriter)]  # type: ignore[attr-defined]

    def skip(*args: Any, **kwargs: Any) -> None:
        return None

    for writer in writers:
        writer.on_predict_batch_end = skip  # type: ignore[method-assign]
        writer.on_predict_epoch_end = skip  # type: ignore[method-assign]

    def undo() -> None:
        for writer in writers:
            vars(writer).pop("on_predict_batch_end", None)
            vars(writer).pop("on_predict_epoch_end", None)

    return undo


__all__ = ["DataCollectives", "all_gather", "broadcast_source", "data_group", "reduce", "writers_on_data_ranks"]
