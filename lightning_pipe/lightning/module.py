"""The module contract: what a LightningModule gives the pipeline, and how it still runs without one.

A pipeline can only split a model it can see as a chain. :class:`PipelineModule` asks for exactly that:

* ``self.layers`` — an ordered ``nn.Sequential`` / ``nn.ModuleList``; the output of layer ``i`` is the input of
  layer ``i + 1``. Every layer returns a tensor or a tuple of tensors, and a tuple is the next layer's *positional
  arguments* — on one device, inside a stage and across stages alike (``forward(self, h, skip)`` takes the
  ``(h, skip)`` its predecessor returned). Dicts, ``None`` and other objects cannot cross a stage boundary and are
  refused wherever they appear, naming the layer. Embedding and head are layers too.
* :meth:`loss_fn` — ``loss_fn(last_layer_output, target)`` returns either a scalar tensor, the *mean* over the
  samples of the batch (the default reduction of torch's losses: the average of equal micro-batches' means is the
  batch mean), or a pair ``(sum, count)`` — the summed loss and the number of items it sums over (e.g. tokens whose
  label is not -100); the batch loss is then the global sum over the global count across micro-batches and
  data-parallel replicas, as on one device (``sum / max(count, 1)``).
* :meth:`split_batch` — ``batch -> (inputs, target)``; ``inputs`` is a tensor or a tuple of tensors (the first
  layer's positional arguments), each with the batch in dim 0 — a dict of inputs is refused, on one device too
  (checked in :meth:`compute_loss` / :meth:`compute_output`, whatever ``forward`` does): return its values as a
  tuple in the order the first layer's ``forward`` takes them. The target may be a tensor or a dict / tuple of
  tensors with the batch in dim 0 (``loss_fn`` gets each micro-batch's rows in the same structure); the default
  takes ``(x, y)`` pairs and bare tensors.

``training_step`` stays the place where the user logs. It gets its loss from :meth:`compute_loss`, which runs the
layers and the loss on one device, and the whole pipeline schedule (forward *and* backward) under
:class:`~lightning_pipe.PipelineStrategy`, returning the micro-batch-averaged loss on every rank.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import lightning.pytorch as pl
from lightning.fabric.utilities.apply_func import convert_to_tensors
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn

from lightning_pipe._compat import lightning as _compat
from lightning_pipe.checkpoint.convert import as_file
from lightning_pipe.layers.aux import AuxLossContext, attach_layer_penalty, aux_loss_context
from lightning_pipe.layers.batches import input_args, loss_parts
from lightning_pipe.layers.stages import run_layers
from lightning_pipe.lightning import grad_norms, remote

# [Note: the loss a training step returns]
# Under PipelineStrategy, ``compute_loss`` runs the backward of every micro-batch itself; the loss it returns is a
# report, detached, and Lightning's backward of what ``training_step`` returns only hands those gradients over. A
# term added to that loss, a scaling of it, or a second ``compute_loss`` in the same step would therefore change the
# logged value but not the gradients: one device trains on the changed loss, the pipeline silently would not. So a
# training step must return exactly the tensor ``compute_loss`` returned (or a dict whose "loss" it is), and may
# call it once; anything else stops the run with the rule. Terms that belong in the loss go where the schedule sees
# them: ``loss_fn`` (the last stage's output and the target), or ``attach_aux_loss`` inside a layer (any stage).


def check_returned_loss(returned: Any, loss: Tensor | None, owner: str) -> None:
    """Refuse a ``training_step`` result whose loss is not the tensor its ``compute_loss`` returned ([Note: the loss
    a training step returns]). ``loss``: what ``compute_loss`` returned this step (``None``: not called, left to
    the backward's own error); ``None`` from ``training_step`` is Lightning's to handle."""
    value = returned.get("loss") if isinstance(returned, dict) else returned
    if loss is None or value is None or value is loss:
        return
    seen = f"{float(value):.6g}" if isinstance(value, Tensor) and value.numel() == 1 else type(value).__name__
    raise RuntimeError(
        f"{owner}.training_step returned a loss other than the one compute_loss returned ({seen} against "
        f"{float(loss):.6g}). Rule: under PipelineStrategy compute_loss already ran the backward of every "
        "micro-batch, so a term added to its loss or a scaling of it after the call would not reach the gradients "
        "(one device would train on it). Return compute_loss's loss unchanged (or {'loss': loss, ...}); put extra "
        "loss terms in loss_fn, or in a layer with lightning_pipe.layers.aux.attach_aux_loss.")


def _detached(output: Any) -> Any:
    return tuple(o.detach() for o in output) if isinstance(output, (tuple, list)) else output.detach()


def default_split_batch(batch: Any) -> tuple[Any, Any]:
    """``(x, y)`` / ``[x, y]`` -> ``(x, y)``; a bare tensor -> ``(tensor, None)``; a dict with ``input``/``target``."""
    if isinstance(batch, Tensor):
        return batch, None
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    if isinstance(batch, (tuple, list)) and len(batch) == 1:
        return batch[0], None
    if isinstance(batch, dict) and "input" in batch:
        return batch["input"], batch.get("target")
    raise TypeError(
        f"Cannot split a batch of type {type(batch).__name__} into (inputs, target). The default "
        "`split_batch` takes `(x, y)` pairs, bare tensors and dicts with 'input'/'target' keys; "
        "override `split_batch(self, batch)` in your LightningModule to return `(inputs, target)`."
    )


class PipelineEngineHandle(Protocol):
    """What :class:`PipelineModule` needs from the strategy's engine (:class:`lightning_pipe.runtime.engine.PipelineEngine`)."""

    def loss(self, module: pl.LightningModule, batch: Any, return_outputs: bool = False) -> Any: ...

    def output(self, module: pl.LightningModule, batch: Any) -> Any: ...

    @property
    def aux(self) -> Any: ...  # lightning_pipe.runtime.aux_step.AuxLossStep: the last step's aux values


class PipelineModule(pl.LightningModule):
    """A LightningModule whose model is a layer list; trains unchanged on one device, DDP, or the pipeline.

    Subclasses set ``self.layers`` and implement :meth:`loss_fn`. The default steps log ``train_loss``,
    ``val_loss`` and ``test_loss``; override them freely, as long as they take the loss from
    :meth:`compute_loss` (and predictions from :meth:`compute_output`).

    Optional hooks the strategy calls when present: ``layer_penalty(index, layer) -> Tensor | None`` (a term over
    the layer's parameters added to the training loss, e.g. ``1e-4 * sum(p.pow(2).sum() for p in
    layer.parameters())``: computed where the layer lives, exact against one device, logged as
    ``train_aux_loss/penalty``: [Note: a penalty over every stage's parameters] in layers/aux.py),
    ``trim_microbatch(inputs, target) -> (inputs, target)`` (each
    micro-batch, cut from the batch as torch cuts it, may be trimmed to its own length, e.g. its padding columns
    dropped: [Note: micro-batches of their own length] in lightning_pipe/runtime/microbatches.py),
    ``reset_layer(index, layer)`` (initialise a layer built on the meta device) and ``parallelize_layer(index, layer, tp_mesh)`` (required with ``tensor_parallel_size > 1``):
    split layer ``index`` of the layer list in place over the 1-D ``tp_mesh`` (DTensor ``parallelize_module`` with
    ``ColwiseParallel`` / ``RowwiseParallel``); the layer's inputs and outputs must stay plain whole tensors
    (``use_local_output=True``), so the pipeline's P2P is unchanged (lightning_pipe/parallel/tensor_parallel.py).

    Example::

        class Regressor(PipelineModule):
            def __init__(self):
                super().__init__()
                self.layers = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

            def loss_fn(self, output, target):
                return F.mse_loss(output, target)

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)
    """

    # Set by PipelineStrategy.setup; None on one device / DDP.
    _pipeline_engine: PipelineEngineHandle | None = None

    # ---------------------------------------------------------------- contract
    def loss_fn(self, output: Any, target: Any) -> Tensor | tuple[Tensor, Tensor | int]:
        """The loss of the last layer's output against the target: a scalar mean over the batch's samples, or a
        ``(sum, count)`` pair for a loss weighted by items (tokens), see the module docstring."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement `loss_fn(self, output, target)`: the loss of the last layer's "
            "output against the target, averaged over the samples of the batch (or a (sum, count) pair)."
        )

    def split_batch(self, batch: Any) -> tuple[Any, Any]:
        """Return ``(inputs, target)`` for a batch; ``target`` may be ``None`` (predict)."""
        return default_split_batch(batch)

    # ---------------------------------------------------------------- running
    def forward(self, inputs: Any) -> Any:
        """Run the layer list as a chain; a tuple of ``inputs`` is the first layer's positional arguments."""
        layers: Any = self.layers  # (nn.Module.__getattr__ types it loosely)
        out = run_layers(layers, inputs)
        penalty = getattr(self, "layer_penalty", None)
        if penalty is None:
            return out
        # joins the loss here as on each stage ([Note: a penalty over every stage's parameters] in layers/aux.py)
        return attach_layer_penalty(out, list(layers), range(len(layers)), penalty)

    def compute_loss(self, batch: Any, return_outputs: bool = False) -> Any:
        """The batch loss (a mean, or ``sum / max(count, 1)``). Under the pipeline strategy during training this runs
        the whole schedule (forward and backward of every micro-batch) and returns this replica's batch loss,
        detached, identical on every rank of the pipeline.

        ``return_outputs=True``: ``(loss, outputs)``, the last layer's outputs for the batch, detached, on every rank
        (to update a metric in ``training_step``; it costs a broadcast of the outputs per step under the pipeline:
        [Note: a training step's outputs] in lightning_pipe/runtime/step_outputs.py)."""
        engine = self._pipeline_engine
        if engine is not None:
            return engine.loss(self, batch, return_outputs)
        inputs, target = self.split_batch(batch)
        if target is None:
            raise ValueError(
                f"compute_loss needs a target, but {type(self).__name__}.split_batch returned None for it; "
                "return `(inputs, target)` from split_batch for training/validation batches. None usually means "
                "the batch holds no target at all: a dict batch without its 'labels' (transformers' collators, "
                "HFCausalLM) or 'target' key."
            )
        input_args(inputs, type(self).__name__)  # the pipeline's rule on one device too, even under an own forward
        # aux terms (attach_aux_loss) join the loss as graph terms: Lightning's accumulation / AMP scale them
        with aux_loss_context(AuxLossContext()) as aux:
            output = self(inputs)
            loss = loss_parts(self.loss_fn(output, target), type(self).__name__).reduced()
        self._aux_values = {name: v.float() for name, v in sorted(aux.values.items())}
        loss = loss + sum(aux.terms) if aux.terms else loss
        return (loss, _detached(output)) if return_outputs else loss

    @property
    def aux_loss_values(self) -> dict[str, Tensor]:
        """The last training :meth:`compute_loss`'s aux terms per name ([Note: auxiliary losses] in
        lightning_pipe/layers/aux.py): mean over micro-batches, summed over layers and stages; the same on every
        rank of a pipeline. Empty without aux terms."""
        engine = self._pipeline_engine
        if engine is not None:
            return dict(engine.aux.values)
        return dict(getattr(self, "_aux_values", {}))

    def log_aux_losses(self, prefix: str = "train_aux_loss") -> None:
        """Log ``prefix`` (the total) and ``prefix/<name>`` per name, if the model has aux terms."""
        values = self.aux_loss_values
        if values:
            self.log(prefix, sum(values.values()), prog_bar=True)
            for name, value in values.items():
                self.log(f"{prefix}/{name}", value)

    def layer_value(self, index: int, fn: Callable[[nn.Module], Any]) -> Any:
        """``fn(layer)`` for layer ``index`` of the layer list, the same value on every rank, e.g.
        ``self.log("w6", self.layer_value(6, lambda layer: layer.weight.norm()))``. Under the pipeline it runs where
        the layer lives and reaches every rank of its pipeline: a collective, so call it on every rank (in a hook, or
        after ``fit``: [Note: a value one stage holds] in lightning/remote.py). Under ``no_grad``; detached."""
        return remote.layer_value(self, index, fn)

    def compute_output(self, batch: Any) -> Any:
        """The last layer's output for the batch's inputs (on every rank of the pipeline)."""
        engine = self._pipeline_engine
        if engine is not None:
            return engine.output(self, batch)
        inputs, _ = self.split_batch(batch)
        input_args(inputs, type(self).__name__)
        return self(inputs)

    # ---------------------------------------------------------------- collectives
    def all_gather(self, data: Any, group: Any | None = None, sync_grads: bool = False) -> Any:
        """Lightning's ``all_gather``; under PipelineStrategy, without a ``group``, over the ranks that read different
        data, as on DDP (``[data ranks, ...]``); ``group=torch.distributed.group.WORLD`` gathers from every rank
        ([Note: collectives over the data ranks] in lightning/collectives.py)."""
        strategy = self.trainer.strategy
        if not hasattr(strategy, "pipeline_config"):
            return super().all_gather(data, group, sync_grads)
        # (Lightning's own turns a missing group into WORLD before the strategy sees it)
        return apply_to_collection(convert_to_tensors(data, device=self.device), Tensor, strategy.all_gather,
                                   group=group, sync_grads=sync_grads)

    # ---------------------------------------------------------------- logging
    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        """Lightning's ``log``; under the pipeline a gradient-norm total of Lightning's ``grad_norm`` warns once
        ([Note: gradient norms in hooks] in lightning/grad_norms.py)."""
        if self._pipeline_engine is not None and name.startswith("grad_"):
            grad_norms.check_logged(name, value, self._pipeline_engine)
        super().log(name, value, *args, **kwargs)

    # ---------------------------------------------------------------- checkpoints
    @_compat.restricted_classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        """Lightning's ``load_from_checkpoint``, which also reads a sharded pipeline checkpoint directory (what
        ``ModelCheckpoint`` writes under PipelineStrategy) on one process: it is first consolidated in memory
        (``lightning_pipe.checkpoint.as_file``). Single files load as Lightning loads them."""
        if isinstance(checkpoint_path, (str, os.PathLike)) and Path(checkpoint_path).is_dir():
            checkpoint_path = as_file(checkpoint_path)  # a directory that is no checkpoint: CheckpointError says so
        return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)

    # ---------------------------------------------------------------- default steps
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.compute_loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        self.log_aux_losses()
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.compute_loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.compute_loss(batch)
        self.log("test_loss", loss, sync_dist=True)
        return loss

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self.compute_output(batch)
