"""Tiny models and data shared by the unit and multi-rank tests (and the reference single-device runs)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.utils.parametrizations import weight_norm
from torch.utils.data import DataLoader, Sampler, TensorDataset

from lightning_pipe import PipelineModule
from lightning_pipe.layers.stages import RemoteLayer

WIDTH = 8


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class TiedHead(nn.Module):
    """Output head that reuses the input projection's weight (transposed), like GPT-2's tied embedding."""

    def __init__(self, shared: nn.Parameter) -> None:
        super().__init__()
        self.weight = shared  # the same Parameter object: a tie the strategy must keep across stages
        self.bias = nn.Parameter(torch.zeros(shared.shape[1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.t(), self.bias)


class ToyRegressor(PipelineModule):
    """A residual MLP as a layer list; counts the hooks the strategy must keep firing."""

    def __init__(self, n_layers: int = 8, width: int = WIDTH, optimizer: str = "sgd", lr: float = 0.05,
                 tied: bool = False, seed: int = 0, inf_grad_at_step: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(seed)
        layers: list[nn.Module] = [nn.Linear(4, width)]
        layers += [Block(width) for _ in range(n_layers - 2)]
        layers.append(TiedHead(layers[0].weight) if tied else nn.Linear(width, 4))
        self.layers = nn.Sequential(*layers)
        self.optimizer_name, self.lr = optimizer, lr
        self.inf_grad_at_step = inf_grad_at_step  # fp16 tests: an overflow in one stage only
        self.calls: Counter = Counter()
        self.grad_norms_before_step: list[float] = []

    def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target)

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "adamw":
            opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    # hooks the strategy must keep firing as on one device
    def on_before_zero_grad(self, optimizer: Any) -> None:
        self.calls["on_before_zero_grad"] += 1

    def on_after_backward(self) -> None:
        self.calls["on_after_backward"] += 1
        if self.inf_grad_at_step is not None and self.trainer.global_step == self.inf_grad_at_step:
            layer = self.layers[len(self.layers) - 2]  # on the last stage only, under the pipeline
            fc = getattr(layer, "fc", None) or getattr(layer, "fc2", None)  # Block, or MLPBlock (tensor parallel)
            if not isinstance(layer, RemoteLayer) and fc is not None and fc.weight.grad is not None:
                grad = fc.weight.grad
                # FSDP / tensor parallel: write into this rank's part (item assignment on a sharded DTensor changes
                # nothing); with a row-wise split only tensor rank 0's part overflows: every rank must still skip
                local = grad.to_local() if isinstance(grad, DTensor) else grad
                if local.numel():
                    local.view(-1)[0] = float("inf")

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.calls["on_before_optimizer_step"] += 1
        sq = sum(float(p.grad.pow(2).sum()) for p in self.parameters() if p.grad is not None)
        self.grad_norms_before_step.append(sq)


class MetaBuiltRegressor(ToyRegressor):
    """Builds its layers in ``configure_model`` (on the meta device under the pipeline) and initialises each with a
    per-layer seed through ``reset_layer``, so one device and any pipeline layout start from the same values."""

    def __init__(self, n_layers: int = 8, tied: bool = False, **kwargs: Any) -> None:
        super().__init__(n_layers=n_layers, tied=tied, **kwargs)
        self.n_layers, self.tied = n_layers, tied
        self.layers = None  # built in configure_model

    def configure_model(self) -> None:
        if self.layers is not None:
            return
        first = nn.Linear(4, WIDTH)
        layers: list[nn.Module] = [first, *(Block(WIDTH) for _ in range(self.n_layers - 2))]
        layers.append(TiedHead(first.weight) if self.tied else nn.Linear(WIDTH, 4))
        self.layers = nn.Sequential(*layers)
        for index, layer in enumerate(self.layers):
            self.reset_layer(index, layer)

    def reset_layer(self, index: int, layer: nn.Module) -> None:
        g = torch.Generator().manual_seed(100 + index)
        with torch.no_grad():
            for name, p in layer.named_parameters():
                if p.is_meta or (isinstance(layer, TiedHead) and name == "weight"):
                    continue  # meta: nothing to fill yet; a tied weight is initialised by its first layer
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


class MLPBlock(nn.Module):
    """A pre-norm residual MLP: the column-wise / row-wise pair of Megatron's tensor-parallel MLP."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class TensorParallelRegressor(ToyRegressor):
    """Input projection, MLP blocks, head; ``parallelize_layer`` splits the projection column-wise (its output
    gathered) and each block's MLP column-wise then row-wise. The LayerNorms and the head stay replicated."""

    def __init__(self, n_layers: int = 8, width: int = WIDTH, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(n_layers=n_layers, width=width, seed=seed, **kwargs)
        if kwargs.get("tied"):
            raise ValueError("TensorParallelRegressor has no tied weights")
        torch.manual_seed(seed)
        layers: list[nn.Module] = [nn.Linear(4, width)]
        layers += [MLPBlock(width, 2 * width) for _ in range(n_layers - 2)]
        layers.append(nn.Linear(width, 4))
        self.layers = nn.Sequential(*layers)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        # whole gradients (a split DTensor gathered over the tensor group: collective, same order on every rank)
        self.calls["on_before_optimizer_step"] += 1
        grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                 for p in self.parameters() if p.grad is not None]
        self.grad_norms_before_step.append(sum(float(g.pow(2).sum()) for g in grads))

    def parallelize_layer(self, index: int, layer: nn.Module, tp_mesh: Any) -> None:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if isinstance(layer, MLPBlock):
            parallelize_module(layer, tp_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        elif index == 0:
            parallelize_module(layer, tp_mesh, ColwiseParallel(output_layouts=Replicate()))


def regression_data(n: int = 96, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = torch.sin(x) + 0.1 * torch.randn(n, 4, generator=g)
    return TensorDataset(x, y)


def loader(dataset: TensorDataset, batch_size: int, drop_last: bool = True) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, drop_last=drop_last)


class SameOrderAsDistributedSampler(Sampler):
    """For single-device references: the order in which Lightning's training DistributedSampler (shuffle=True,
    seed 0) walks the data, so batch k of the reference holds exactly the samples of batch k of every replica."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self) -> int:
        return self.n


def reference_train_loader(dataset: TensorDataset, batch_size: int) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, sampler=SameOrderAsDistributedSampler(len(dataset)),
                      drop_last=True)


# ------------------------------------------------------------------------------------------------ issue 14 (hardening)
class SkipIn(nn.Module):
    """First layer of :class:`SkipRegressor`: takes split_batch's two inputs as positional arguments."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc, self.aux = nn.Linear(4, width), nn.Linear(4, width)

    def forward(self, x: torch.Tensor, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fc(x), self.aux(aux)


class SkipBlock(nn.Module):
    """``forward(h, skip) -> (h, skip)``: a residual block that carries a skip tensor along."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, h: torch.Tensor, skip: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return h + torch.tanh(self.fc(h)), skip + 0.1 * h


class SkipOut(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 4)

    def forward(self, h: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.fc(h + skip)


class SkipRegressor(ToyRegressor):
    """Layers pass ``(h, skip)`` tuples (the next layer's positional arguments); the inputs are a pair too."""

    def __init__(self, n_layers: int = 8, width: int = WIDTH, **kwargs: Any) -> None:
        super().__init__(n_layers=n_layers, width=width, **kwargs)
        torch.manual_seed(0)
        self.layers = nn.Sequential(SkipIn(width), *(SkipBlock(width) for _ in range(n_layers - 2)), SkipOut(width))

    def split_batch(self, batch: Any) -> tuple[Any, Any]:
        x, y = batch
        return (x, x.flip(-1)), y


class TrainingStepLoss(SkipRegressor):
    """A ``training_step`` that changes what it returns ([Note: the loss a training step returns]): ``"scaled"``
    returns 3 x compute_loss's loss, ``"twice"`` calls compute_loss twice, ``"dict"`` returns ``{"loss": loss, ...}``
    (the one allowed change: the same tensor under "loss")."""

    def __init__(self, returns: str = "dict", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.returns = returns

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = self.compute_loss(batch)
        self.log("train_loss", loss)
        if self.returns == "scaled":
            return loss * 3
        if self.returns == "twice":
            return (loss + self.compute_loss(batch)) / 2
        return {"loss": loss, "doubled": loss.detach() * 2}


class MetricsRegressor(SkipRegressor):
    """Validation logs sums and a max reduced across ranks: ``self.log(..., reduce_fx="sum", sync_dist=True)`` of
    the rows and of the outputs, and torchmetrics' ``SumMetric`` / ``MeanMetric`` of the outputs ([Note: what
    sync_dist reduces over]): on one device, the sums over the validation data."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from torchmetrics import MeanMetric, SumMetric

        self.out_sum, self.out_mean = SumMetric(), MeanMetric()

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        out = self.compute_output(batch)
        rows = torch.tensor(float(out.shape[0]))
        self.log("val_rows", rows, reduce_fx="sum", sync_dist=True, batch_size=out.shape[0])
        self.log("val_out_total", out.sum(), reduce_fx="sum", sync_dist=True, batch_size=out.shape[0])
        self.log("val_out_max", out.max(), reduce_fx="max", sync_dist=True, batch_size=out.shape[0])
        self.out_sum.update(out)
        self.out_mean.update(out)
        self.log("val_metric_sum", self.out_sum, batch_size=out.shape[0])
        self.log("val_metric_mean", self.out_mean, batch_size=out.shape[0])
        loss = self.compute_loss(batch)
        self.log("val_loss", loss, sync_dist=True)
        return loss


class Flatten(nn.Module):
    """``[batch, 4] -> [batch * 4]``: an output without the batch in dim 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1)


class FlatOutRegressor(ToyRegressor):
    """The last layer flattens its output (``[batch * 4]``), ``loss_fn`` reshapes it back: trains as on one device;
    evaluation joins outputs along dim 0, so it is refused there ([Note: evaluation outputs are joined along
    dim 0])."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.layers = nn.Sequential(*self.layers, Flatten())

    def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output.reshape(-1, 4), target)


class CarryIn(nn.Module):
    """First layer of :class:`SavedOutputRegressor`."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(4, width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(x)
        return h, h


class CarryBlock(nn.Module):
    """``forward(h, carry) -> (tanh(fc(f)), f)`` with ``f = h + carry / 2``: the carried output ``f`` is also what
    ``fc`` saved for its weight gradient (a residual stream passed along as Mamba-style blocks do)."""

    def __init__(self, width: int, out: int | None = None) -> None:
        super().__init__()
        self.fc = nn.Linear(width, out or width)

    def forward(self, h: torch.Tensor, carry: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = h + 0.5 * carry
        return torch.tanh(self.fc(f)), f


class SavedOutputRegressor(ToyRegressor):
    """Every stage's outputs include a tensor saved inside the stage for a weight gradient, the last stage's too
    (its output is ``(prediction, f)``; the loss reads both). A split backward detaches stage outputs in place after
    the input gradient ([Note: split backward detaches stage outputs] in lightning_pipe/runtime/stage.py)."""

    def __init__(self, n_layers: int = 8, width: int = WIDTH, **kwargs: Any) -> None:
        super().__init__(n_layers=n_layers, width=width, **kwargs)
        torch.manual_seed(0)
        self.layers = nn.Sequential(CarryIn(width), *(CarryBlock(width) for _ in range(n_layers - 2)),
                                    CarryBlock(width, 4))

    def loss_fn(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        prediction, f = output
        return F.mse_loss(prediction, target) + 0.01 * f.pow(2).mean()


class FrozenFrontRegressor(ToyRegressor):
    """Its first two layers frozen: with two layers per stage, stage 1's inputs need no gradient ([Note: a split
    backward with no input grad] in lightning_pipe/runtime/stage.py)."""

    def __init__(self, n_layers: int = 8, width: int = WIDTH, **kwargs: Any) -> None:
        super().__init__(n_layers=n_layers, width=width, **kwargs)
        for layer in list(self.layers)[:2]:
            layer.requires_grad_(False)


class Repeat(nn.Module):
    """``(B, 4) -> (B, width)`` without parameters: the input repeated."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.times = width // 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.repeat(1, self.times)


class ParamFreeFrontRegressor(ToyRegressor):
    """Its first two layers hold no parameter (a repeat, a tanh): a first stage with nothing to train."""

    def __init__(self, n_layers: int = 8, width: int = WIDTH, **kwargs: Any) -> None:
        super().__init__(n_layers=n_layers, width=width, **kwargs)
        torch.manual_seed(0)
        self.layers = nn.Sequential(Repeat(width), nn.Tanh(), *(Block(width) for _ in range(n_layers - 3)),
                                    nn.Linear(width, 4))


class NormedBlock(nn.Module):
    """A residual block whose weight is reparametrised with ``weight_norm``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = weight_norm(nn.Linear(width, width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(h))


class WeightNormRegressor(ToyRegressor):
    """Every layer's weight reparametrised with ``torch.nn.utils.parametrizations.weight_norm`` (as audio models'
    convolutions are): the trained parameters (``parametrizations.weight.original0/1``) are not the weights the
    layers use, which are computed in each forward, so inside the weight half of a split backward too."""

    def __init__(self, n_layers: int = 8, width: int = WIDTH, **kwargs: Any) -> None:
        super().__init__(n_layers=n_layers, width=width, **kwargs)
        torch.manual_seed(0)
        self.layers = nn.Sequential(weight_norm(nn.Linear(4, width)), *(NormedBlock(width) for _ in range(n_layers - 2)),
                                    weight_norm(nn.Linear(width, 4), dim=None))


class ToSequence(nn.Module):
    """``(B, 4) -> (B, 4, width)``: four time steps for the recurrent layers of :class:`RecurrentRegressor`."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc, self.width = nn.Linear(4, 4 * width), width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).view(x.shape[0], 4, self.width)


class LSTMBlock(nn.Module):
    """An LSTM with a residual; its ``(h, c)`` state stays inside the layer."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(width, width, batch_first=True)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(h)
        return out + h


class GRUSummary(nn.Module):
    """A bidirectional GRU: its outputs and its final states as one ``(B, width)`` summary, two tensors onward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gru = nn.GRU(width, width // 2, batch_first=True, bidirectional=True)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, last = self.gru(h)
        return out, last.transpose(0, 1).reshape(h.shape[0], -1)


class SummaryMix(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, h: torch.Tensor, summary: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h + self.fc(summary)[:, None])


class SequenceHead(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 4)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc(h.mean(1))


class RecurrentRegressor(ToyRegressor):
    """LSTM and bidirectional-GRU layers (torch's fused recurrent kernels, on meta tensors for the stage shapes too)
    over four time steps; the GRU hands the next layer its outputs and a summary of its final states."""

    def __init__(self, n_layers: int = 8, width: int = WIDTH, **kwargs: Any) -> None:
        super().__init__(n_layers=n_layers, width=width, **kwargs)
        torch.manual_seed(0)
        blocks = [LSTMBlock(width) for _ in range(n_layers - 4)]
        self.layers = nn.Sequential(ToSequence(width), blocks[0], GRUSummary(width), SummaryMix(width), *blocks[1:],
                                    SequenceHead(width))


class ViewIn(nn.Module):
    """First layer of :class:`ViewsRegressor`: a strided input in, the (expanded) mask passed along unchanged."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(4, width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fc(x) * mask, mask


class ViewBlock(nn.Module):
    """Consumes its input transposed (its input gradient is a transpose) and returns a column-major output."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        projected = torch.mm(self.fc.weight, h.t()).t() + self.fc.bias  # fc(h), as a transposed view
        out = h + torch.tanh(projected) * mask
        return out.t().contiguous().t(), mask  # same values, not contiguous


class ViewOut(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 4)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.fc(h * mask)


class ViewsRegressor(ToyRegressor):
    """Non-contiguous tensors everywhere a stage boundary can see them: split_batch's inputs are a strided slice and
    an expanded mask (stride 0, carried through every layer like a transformers attention mask), and each block's
    output is column-major. One device trains on them as they are."""

    def __init__(self, n_layers: int = 8, width: int = WIDTH, **kwargs: Any) -> None:
        super().__init__(n_layers=n_layers, width=width, **kwargs)
        torch.manual_seed(0)
        self.layers = nn.Sequential(ViewIn(width), *(ViewBlock(width) for _ in range(n_layers - 2)), ViewOut(width))
        self.width = width

    def split_batch(self, batch: Any) -> tuple[Any, Any]:
        x, y = batch
        strided = torch.cat([x, x], dim=1)[:, ::2]  # == x, stride (8, 2)
        mask = torch.ones(1, self.width, device=x.device).expand(x.shape[0], -1)
        return (strided, mask), y


class DictOut(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"h": x}


class DictOutRegressor(ToyRegressor):
    """Layer 2 returns a dict: refused, naming the layer."""

    def __init__(self, n_layers: int = 8, **kwargs: Any) -> None:
        super().__init__(n_layers=n_layers, **kwargs)
        self.layers[2] = DictOut()


class DictInputsRegressor(ToyRegressor):
    """split_batch returns its inputs as a dict: refused on every rank before any waits."""

    def split_batch(self, batch: Any) -> tuple[Any, Any]:
        return {"x": batch[0]}, batch[1]


class DictTargetRegressor(ToyRegressor):
    """split_batch returns its target as a dict (values and per-row weights): trains on one device and under the
    pipeline alike, each micro-batch's loss getting its own rows of both."""

    def split_batch(self, batch: Any) -> tuple[Any, Any]:
        x, y = batch
        return x, {"y": y, "weight": 1.0 + x[:, :1].abs()}

    def loss_fn(self, output: torch.Tensor, target: Any) -> torch.Tensor:
        return ((output - target["y"]) ** 2 * target["weight"]).mean()


class OwnForwardDictInputsRegressor(DictInputsRegressor):
    """Dict inputs with a forward that would take them: still refused on one device (the pipeline never calls
    forward, so the rule must not depend on it)."""

    def forward(self, inputs: Any) -> Any:
        return super().forward(inputs["x"])


class BNRegressor(ToyRegressor):
    """BatchNorm in both halves; the second half starts with one (fed stand-in inputs by torch's shape inference)."""

    def __init__(self, n_layers: int = 8, width: int = WIDTH, **kwargs: Any) -> None:
        super().__init__(n_layers=n_layers, width=width, **kwargs)
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(4, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, width),
                                    nn.BatchNorm1d(width), nn.Tanh(), nn.Linear(width, width), nn.Linear(width, 4))


class CausalMix(nn.Module):
    """A per-token MLP plus the running mean over earlier positions: causal, so right padding changes nothing."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc, self.mix = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(1, h.shape[1] + 1, device=h.device, dtype=h.dtype).view(1, -1, 1)
        return h + torch.tanh(self.fc(h) + self.mix(h.cumsum(1) / steps))


class TinyLM(ToyRegressor):
    """Token model for variable sequence lengths; ``loss="sum_count"`` is token-weighted (labels -100 ignored)."""

    def __init__(self, n_layers: int = 6, vocab: int = 32, width: int = 16, loss: str = "mean", **kwargs: Any) -> None:
        super().__init__(n_layers=n_layers, width=width, **kwargs)
        torch.manual_seed(0)
        self.vocab, self.loss_kind = vocab, loss
        self.layers = nn.Sequential(nn.Embedding(vocab, width), *(CausalMix(width) for _ in range(n_layers - 2)),
                                    nn.Linear(width, vocab))

    def loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> Any:
        flat_logits, flat_labels = logits.reshape(-1, self.vocab), labels.reshape(-1)
        if self.loss_kind == "sum_count":
            return F.cross_entropy(flat_logits, flat_labels, reduction="sum"), (flat_labels != -100).sum()
        return F.cross_entropy(flat_logits, flat_labels)


class TrimmedLM(TinyLM):
    """TinyLM whose micro-batches drop the padding columns none of their sequences needs (labels -100 to the end):
    exact against the untrimmed batch on one device, since the model is causal and padding is on the right."""

    def trim_microbatch(self, tokens: torch.Tensor, labels: torch.Tensor | None) -> Any:
        if labels is None:  # predict: nothing tells padding apart
            return tokens, labels
        used = (labels != -100).any(0).nonzero()
        length = int(used.max()) + 1 if used.numel() else 1
        return tokens[:, :length], labels[:, :length]


def varlen_tokens(n: int, vocab: int = 32, seed: int = 1, min_len: int = 3, max_len: int = 12,
                  mask_prob: float = 0.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` (tokens, labels) sequences of random lengths; ``mask_prob`` of the labels set to -100 (masked LM)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (), generator=g))
        seq = torch.randint(0, vocab, (length + 1,), generator=g)
        labels = seq[1:].clone()
        labels[torch.rand(length, generator=g) < mask_prob] = -100
        out.append((seq[:-1], labels))
    return out


def pad_collate(pad_label: int) -> Any:
    """Pad each batch to its own longest sequence: tokens with 0, labels with ``pad_label``."""

    def collate(items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        length = max(x.shape[0] for x, _ in items)
        x = torch.zeros(len(items), length, dtype=torch.long)
        y = torch.full((len(items), length), pad_label, dtype=torch.long)
        for i, (tokens, labels) in enumerate(items):
            x[i, :tokens.shape[0]], y[i, :labels.shape[0]] = tokens, labels
        return x, y

    return collate
