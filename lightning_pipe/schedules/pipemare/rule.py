"""PipeMare's update rule as plain numbers: the delays, the learning-rate factor, the velocity decay and the options
that choose them. Shared by the stage (``stage.py``), the spec's checks (``spec.py``) and the tests' reference loop.

[Note: PipeMare]
Yang et al., "PipeMare: Asynchronous Pipeline Parallel DNN Training" (MLSys 2021). Like PipeDream
([Note: PipeDream weight stashing] in ``schedules/pipedream/stages.py``) every stage updates its weights after each
micro-batch's backward, in torch's 1F1B order (one stage per rank, ``w = min(m, p - s)`` warm-up forwards on stage
``s``, a flush per batch). Unlike PipeDream it keeps *one* weight version per stage: no stash. On stage ``s``, for
micro-batch ``j`` of batch ``b`` (``k`` counts the stage's updates; all stages count alike):

* the forward runs on the live weights ``W(v_f)`` after ``v_f = b*m + max(0, j - w + 1)`` updates (PipeDream's
  version formula: the forwards of the warm-up all see the batch's starting weights);
* the backward runs when the live weights are ``W(v_b)``, ``v_b = b*m + j`` (updates 0..j-1 of the batch were
  applied before it). Its delay is ``tau = v_b - v_f = min(j, w - 1)``; the stage's steady-state delay is
  ``tau_s = w - 1`` (``p - 1 - s`` when m >= p; 0 on the last stage, which is therefore synchronous);
* the gradient is PipeMare's ``grad f(u_fwd, u_bkwd)``: every activation autograd saved comes from the forward
  (``u_fwd = W(v_f)``), and every saved tensor that *is* a parameter (or a view of one: ``W.t()`` in a linear layer,
  a norm's scale) is read at backward time, as ``u_bkwd``. Without discrepancy correction ``u_bkwd = W(v_b)``, the
  weights in memory then; with it, ``u_bkwd = W(v_b) - tau * delta(v_b)`` (the paper's
  ``w_bkwd = w - (tau_fwd - tau_bkwd) * delta`` with ``tau_bkwd = 0``: the backward is not delayed against the
  live weights it reads). Tensors the forward *derived* from a weight (a cast copy under autocast, ``2 * W``) are
  the forward's; autocast is refused for that reason (``lightning/microbatch_updates.py``);
* update ``k = v_b`` applies that gradient (tied-copy sum, data-parallel mean, per-stage clipping as PipeDream)
  with the user's optimizer at the learning rate ``lr * factor(tau, k)`` (every param group scaled alike, restored
  right after the step, so schedulers and checkpoints see the user's rate). Learning-rate rescheduling (the
  paper's T1) with warm-up ``K``: ``factor(tau, k) = max(tau, 1) ** -(1 - min(k / K, 1))``: ``1/tau`` at the start,
  annealed geometrically to 1 over ``K`` updates. It uses the delay of the micro-batch whose gradient is applied
  (0 for the first micro-batch of a batch here, where the flush removed the delay), not a per-stage constant.
  Off: ``factor = 1``;
* after update ``k`` the velocity estimate (discrepancy correction, the paper's T2, decay ``D``) moves:
  ``delta(k+1) = gamma * delta(k) + (1 - gamma) * (W(k+1) - W(k))``, ``delta(0) = 0``,
  ``gamma = D ** (1 / tau_s)`` (an average over about ``tau_s`` updates keeps weight ``D``: the window the
  extrapolation spans). Stages with ``tau_s = 0`` keep no ``delta``.

Defaults (``DEFAULT_WARMUP``, ``DEFAULT_DECAY``): both techniques on, ``K = 1000`` updates, ``D = 0.1``. The form of
both rules is the paper's; the two numbers are our choice, not read from its text. Searched again on 2026-12-02
(the stored web pages, documentation and code corpora: queries on PipeMare's warm-up, annealing, discrepancy
correction, decay, arXiv 1910.05124): only its abstract and title turned up (a documents.pub copy's first page,
paperswithcode's method entry), no hyper-parameter, so nothing could be confirmed and ours stay: the paper
anneals over a warm-up it states in epochs of its ResNet/Transformer runs, which has no unit here, and 1000 updates
is a short warm-up for a small model (the tiny GPT recipe makes 1200 per stage); ``D = 0.1`` keeps the estimate
close to the last ``tau_s`` steps, the smallest window that still averages out one noisy step.

Memory: the live weights (one version) and, with correction, ``delta`` (one copy in fp32 or wider, not on the last
stage; updated in place around the step as ``delta <- gamma*delta - (1-gamma)*W(k)``, then ``+ (1-gamma)*W(k+1)``,
so no copy of the pre-step weights is needed: the cost is a rounding of the size of fp32's ulp of ``|W|`` in
``delta``). During a backward one corrected parameter exists at a time (``u_bkwd`` is built per saved tensor when
autograd unpacks it). PipeDream holds ``min(w, m - w + 1)`` stashes of the whole stage. The batch flush keeps what
PipeMare's no-flush pipeline buys in utilisation out of reach on this runtime (as for PipeDream); the update rule
and the memory are reproduced.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_pipe.config import config_error

DEFAULT_WARMUP = 1000
"""K: updates over which the learning-rate factor anneals from 1/tau to 1 ([Note: PipeMare])."""
DEFAULT_DECAY = 0.1
"""D: the velocity estimate's decay over a stage's delay ([Note: PipeMare])."""
OPTIONS = ("lr_reschedule", "discrepancy_correction")


def forward_version(stage: int, pipeline_size: int, microbatches: int, batch: int, microbatch: int) -> int:
    """Updates applied before the forward of ``microbatch`` of ``batch`` on ``stage``: [Note: PipeMare]."""
    warmup = min(microbatches, pipeline_size - stage)
    return batch * microbatches + max(0, microbatch - warmup + 1)


def backward_version(microbatches: int, batch: int, microbatch: int) -> int:
    """Updates applied before the backward of ``microbatch`` of ``batch`` (on every stage)."""
    return batch * microbatches + microbatch


def stage_delay(stage: int, pipeline_size: int, microbatches: int) -> int:
    """``tau_s``: the steady-state delay of ``stage``, ``min(m, p - s) - 1``."""
    return min(microbatches, pipeline_size - stage) - 1


@dataclass(frozen=True)
class PipeMareRule:
    """The two techniques' settings: ``warmup`` (K; ``None``: no learning-rate rescheduling) and ``decay`` (D;
    ``None``: no discrepancy correction)."""

    warmup: int | None = DEFAULT_WARMUP
    decay: float | None = DEFAULT_DECAY

    def lr_factor(self, delay: int, update: int) -> float:
        """The learning-rate factor of update ``update`` applying a gradient of delay ``delay``."""
        if self.warmup is None or delay <= 1:
            return 1.0
        return float(delay) ** -(1.0 - min(update / self.warmup, 1.0))

    def gamma(self, delay: int) -> float | None:
        """The velocity EMA's factor on a stage of steady-state delay ``delay``; ``None``: no estimate kept."""
        if self.decay is None or delay <= 0:
            return None
        return self.decay ** (1.0 / delay)


def rule_from_options(options: Mapping[str, Any]) -> PipeMareRule:
    """``schedule_options`` -> rule. ``lr_reschedule``: true (K = DEFAULT_WARMUP), false, or K >= 1 updates;
    ``discrepancy_correction``: true (D = DEFAULT_DECAY), false, or D in [0, 1)."""
    warmup: int | None = DEFAULT_WARMUP
    decay: float | None = DEFAULT_DECAY
    if "lr_reschedule" in options:
        value = options["lr_reschedule"]
        if isinstance(value, bool) or value is None:
            warmup = DEFAULT_WARMUP if value else None
        elif isinstance(value, int) and value >= 1:
            warmup = value
        else:
            raise config_error(
                "PipeMare's lr_reschedule is true (anneal over the default K = "
                f"{DEFAULT_WARMUP} updates), false (off), or the warm-up K as a whole number of updates >= 1.",
                f"schedule_options lr_reschedule={value!r}", "schedule_options",
                "e.g. schedule.options.lr_reschedule=500")
    if "discrepancy_correction" in options:
        value = options["discrepancy_correction"]
        if isinstance(value, bool) or value is None:
            decay = DEFAULT_DECAY if value else None
        elif isinstance(value, (int, float)) and 0 <= value < 1:
            decay = float(value)
        else:
            raise config_error(
                "PipeMare's discrepancy_correction is true (decay D = "
                f"{DEFAULT_DECAY}), false (off), or the decay D as a number in [0, 1).",
                f"schedule_options discrepancy_correction={value!r}", "schedule_options",
                "e.g. schedule.options.discrepancy_correction=0.1")
    return PipeMareRule(warmup, decay)
