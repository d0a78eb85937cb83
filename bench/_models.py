"""Small models shared by the benchmarks (built inside the rank processes: imports are local)."""

from __future__ import annotations

from typing import Any


def residual_mlp(width: int, blocks: int) -> Any:
    """``blocks`` residual ``x + tanh(Linear(x))`` blocks of one width, MSE loss, SGD: equal cost per layer."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from lightning_pipe import PipelineModule

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.tanh(self.fc(x))

    class ResidualMLP(PipelineModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layers = nn.Sequential(*[Block() for _ in range(blocks)])

        def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(output, target)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    return ResidualMLP()
