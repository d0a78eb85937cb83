"""One random stream per pipeline stage, derived from the user's seed.

[Note: random streams per stage]
Every process of a pipeline is usually seeded alike (``seed_everything`` in a script, as our recipes do), so without
care every rank draws the same numbers: stage 1's dropout masks repeat stage 0's (a tester counted 52 of 117 masks
equal across the two ranks of a 1F1B run). On one device those draws are independent. Megatron offsets the seed per
pipeline rank; we give each *stage* its own stream (a rank of an interleaved or V schedule holds several), so that
only the layout's stage count, not its rank placement, decides the draws:

* at engine build, after the tensor ranks agreed on one state (``parallel.tensor_parallel.sync_random_state``), the
  stream of stage ``s`` is seeded with a hash of (this process's torch CPU generator state, ``s``): tensor ranks of a
  stage get the same stream (they must: one tensor, split), data-parallel replicas get the same stream when their
  processes were seeded alike — what Lightning's DDP does (each rank draws from its own seeded generator, so
  identically seeded replicas drop the same positions of different samples) — and different ones when each process
  is seeded differently (likewise Chimera's two copies of a stage, which run different micro-batches). The base
  generator is not advanced: code outside the stages sees the draws it would see;
* every forward / backward of a stage (``forward_one_chunk``, ``backward_one_chunk``, ``backward_weight_one_chunk``)
  runs with the stage's stream as torch's default generator (CPU, and the stage's CUDA device), which is saved back
  and the base restored afterwards;
* a rank that holds one stage enters that stage's stream once per training step instead (:meth:`StageStream.hold`
  around the schedule's step: two generator swaps per step, not four per micro-batch; the swaps were the largest
  part of the strategy's host work per micro-batch). Everything the step runs then draws from it, the loss function
  included; so that this holds for every layout, the loss function draws from the last stage's stream on a rank that
  holds several stages too (the engine enters it around each loss call);
* activation checkpointing replays exactly: the checkpoint saves the generator state it found at the forward (the
  stage's) and restores it around the recomputation; torch's shape inference draws from the stage's stream without
  advancing it (:meth:`StageStream.peek`, in the engine's inference guard: [Note: shape inference has no side
  effects] in engine.py), so the first real forward draws what it drew.

Reproducible therefore means: the same seed and the same layout (stage count) give bit-identical runs; another
layout draws other masks, statistically equivalent (as one device with another seed). See docs/module-contract.md.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch


def stage_seed(state: torch.Tensor, stage: int) -> int:
    """A 63-bit seed from a generator state and a stage index (stable across processes and runs)."""
    digest = hashlib.blake2b(state.numpy().tobytes() + b"lightning_pipe stage %d" % stage, digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class StageStream:
    """The random stream of one stage on this rank: entered around each of its forwards and backwards."""

    def __init__(self, stage: int, device: torch.device) -> None:
        self.cuda = device if device.type == "cuda" else None
        self.held = False
        """Entered for a whole training step (:meth:`hold`): the per-micro-batch swaps are skipped."""
        seed = stage_seed(torch.get_rng_state(), stage)
        self.cpu_state = torch.Generator().manual_seed(seed).get_state()
        self.cuda_state: torch.Tensor | None = None
        if self.cuda is not None:
            base = torch.cuda.get_rng_state(self.cuda)
            with torch.cuda.device(self.cuda):
                torch.cuda.manual_seed(seed)
            self.cuda_state = torch.cuda.get_rng_state(self.cuda)
            torch.cuda.set_rng_state(base, self.cuda)

    def enter(self) -> torch.Tensor:
        """Make this stream torch's CPU generator (and the stage's CUDA one); returns what :meth:`leave` restores.
        The per-micro-batch form of :meth:`active` (two calls, no context-manager object)."""
        if self.cuda is not None:
            return self._enter_cuda()
        generator = torch.default_generator
        base = generator.get_state()
        generator.set_state(self.cpu_state)
        return base

    def leave(self, base: Any) -> None:
        """Save this stream's advanced state and put back ``base`` (from :meth:`enter`)."""
        if self.cuda is not None:
            return self._leave_cuda(base)
        generator = torch.default_generator
        self.cpu_state = generator.get_state()
        generator.set_state(base)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` drawing from this stream (as it already does while :meth:`hold` is in force).
        Enter / leave rather than a context manager: this runs per micro-batch, and only swaps two generator states."""
        if self.held:
            return fn(*args, **kwargs)
        base = self.enter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.leave(base)

    def hold(self) -> Any:
        """:meth:`enter` for a whole training step (a rank with one stage); returns what :meth:`release` restores."""
        base = self.enter()
        self.held = True
        return base

    def release(self, base: Any) -> None:
        """End :meth:`hold`: save the stream's advanced state, put back ``base``."""
        self.held = False
        self.leave(base)

    def _enter_cuda(self) -> Any:
        activation = self.active()
        activation.__enter__()
        return activation

    def _leave_cuda(self, activation: Any) -> None:
        activation.__exit__(None, None, None)

    @contextlib.contextmanager
    def active(self, advance: bool = True) -> Iterator[None]:
        """Torch's default generator(s) draw from this stream inside the context; the base is restored after.
        ``advance=False``: the stream is left as it was (what was drawn inside will be drawn again)."""
        cuda = self.cuda
        generator = torch.default_generator  # torch.{get,set}_rng_state without their wrappers (per micro-batch)
        base_cpu = generator.get_state()
        base_cuda = torch.cuda.get_rng_state(cuda) if cuda is not None else None
        generator.set_state(self.cpu_state)
        if cuda is not None and self.cuda_state is not None:
            torch.cuda.set_rng_state(self.cuda_state, cuda)
        try:
            yield
        finally:
            if advance:
                self.cpu_state = generator.get_state()
            generator.set_state(base_cpu)
            if cuda is not None and base_cuda is not None:
                if advance:
                    self.cuda_state = torch.cuda.get_rng_state(cuda)
                torch.cuda.set_rng_state(base_cuda, cuda)

    def peek(self) -> contextlib.AbstractContextManager:
        """Draw from this stream without advancing it (torch's shape inference: no side effects)."""
        if self.held:  # the stream is torch's generator right now: draw from it, then put its state back
            return self._forked()
        return self.active(advance=False)

    @contextlib.contextmanager
    def _forked(self) -> Iterator[None]:
        device = self.cuda
        cpu = torch.default_generator.get_state()
        cuda = torch.cuda.get_rng_state(device) if device is not None else None
        try:
            yield
        finally:
            torch.default_generator.set_state(cpu)
            if device is not None and cuda is not None:
                torch.cuda.set_rng_state(cuda, device)


class RankStreams:
    """The random streams of one rank's stages, as its training steps use them ([Note: random streams per stage]):
    held for the whole step where the rank has one stage; otherwise entered per action, and by the loss function
    around each call (the last stage's stream)."""

    def __init__(self, stages: Sequence[Any], device: torch.device) -> None:
        for stage in stages:
            stage.random_stream = StageStream(stage.stage_index, device)
        self.held = stages[0].random_stream if len(stages) == 1 else None
        self.loss = next((st.random_stream for st in stages if st.is_last), None) if len(stages) > 1 else None
        """The stream the loss function runs in (the last stage's) where it must be entered around each call; None
        where the held stream already is that one (or no stage here is last)."""

    def hold(self) -> Any:
        """Before the schedule's training step: what :meth:`release` takes."""
        return self.held.hold() if self.held is not None else None

    def release(self, base: Any) -> None:
        if self.held is not None:
            self.held.release(base)

