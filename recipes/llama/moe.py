"""The Llama recipe's mixture-of-experts feed-forward: token-choice top-k routing over SwiGLU experts, an optional
shared expert, a load-balancing loss, and the expert load kept for logging.

The experts sit in :class:`lightning_pipe.parallel.experts.RoutedExperts`, so ``strategy.expert_parallel_size``
can shard them over a stage's data-parallel ranks without a change here ([Note: expert parallelism]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_pipe.parallel.experts import RoutedExperts


class SwiGLU(nn.Module):
    def __init__(self, n_embd: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(n_embd, hidden, bias=False)  # gate
        self.w3 = nn.Linear(n_embd, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, n_embd, bias=False)  # down

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def balance_loss(probs: Tensor, index: Tensor, num_experts: int) -> Tensor:
    """Switch / Mixtral load-balancing loss of one layer and micro-batch: ``n * sum_e f_e * P_e``, with ``f_e`` the
    fraction of (token, choice) pairs routed to expert ``e`` (no gradient) and ``P_e`` its mean router probability.
    1.0 when routing is uniform."""
    counts = torch.bincount(index.reshape(-1), minlength=num_experts).to(probs.dtype)
    fraction = counts / index.numel()
    return num_experts * (fraction * probs.mean(0)).sum()


class MoEFeedForward(nn.Module):
    """``[B, T, C] -> ([B, T, C], balance loss)``: each token goes to its ``top_k`` experts by router probability
    (renormalised over the chosen ones), plus the shared expert if there is one.

    ``expert_load`` (a non-persistent buffer) counts the (token, choice) pairs each expert received in training
    forwards since the module last read it (:meth:`take_load`): counting needs no host sync, so the schedule is
    not stalled; the recipe reads it once per step.
    """

    def __init__(self, n_embd: int, hidden: int, num_experts: int, top_k: int, shared_expert: bool) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"moe_top_k must be in [1, moe_experts]; got moe_top_k={top_k}, "
                             f"moe_experts={num_experts}. Change model.moe_top_k or model.moe_experts.")
        self.num_experts, self.top_k = num_experts, top_k
        self.router = nn.Linear(n_embd, num_experts, bias=False)
        self.experts = RoutedExperts([SwiGLU(n_embd, hidden) for _ in range(num_experts)])
        self.shared = SwiGLU(n_embd, hidden) if shared_expert else None
        self.register_buffer("expert_load", torch.zeros(num_experts), persistent=False)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        b, t, c = x.shape
        flat = x.reshape(-1, c)
        probs = F.softmax(self.router(flat).float(), dim=-1)
        weight, index = probs.topk(self.top_k, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        out = self.experts(flat, index, weight.to(x.dtype))
        if self.shared is not None:
            out = out + self.shared(flat)
        if self.training:
            with torch.no_grad():
                self.expert_load += torch.bincount(index.reshape(-1), minlength=self.num_experts).to(
                    self.expert_load.dtype)
        return out.view(b, t, c), balance_loss(probs, index, self.num_experts)

    def take_load(self) -> Tensor:
        """The counts since the last call (a copy), and start counting again."""
        load = self.expert_load.clone()
        self.expert_load.zero_()
        return load
