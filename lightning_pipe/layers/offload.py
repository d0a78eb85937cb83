"""Activation offload: a layer's saved tensors live in host memory between its forward and its backward.

[Note: activation offload]
Autograd keeps, per micro-batch in flight, the tensors each op saved for its backward; a pipeline holds several
micro-batches at once (1F1B: up to the number of stages on the first one), so those tensors are most of a stage's
activation memory. ``PipelineStrategy(offload=...)`` wraps the chosen layers' forward in saved-tensor hooks
(:class:`HostOffload`): *pack* copies each saved tensor into pinned host memory (``non_blocking`` on CUDA) and
autograd keeps only that copy; *unpack* copies it back to its device when the backward needs it. The device copy
is then free as soon as nothing else holds it, so an offloaded layer costs the device no activation memory between
its forward and its backward, and costs two host transfers per saved byte instead.

- **Exact.** Unpack returns the values pack saw, so gradients are bit-identical; split backward (ZB-V, ZB-H1,
  DualPipeV: input gradient I first, weight gradient W later) unpacks the same host copy twice, and autograd keeps
  it until the W step has run, like any saved tensor.
- **Not moved**: trainable leaves (parameters: weights are saved by matmuls but live on the device anyway; a
  non-first stage's received input, which the stage keeps for its own backward) and views of them; the layer's own
  buffers and frozen weights (by storage); tensor subclasses (DTensor under tensor parallelism); empty and
  non-strided tensors. Copying any of them would cost transfers and free nothing.
- **Aliases, never the saved tensor object**: what pack returns for a tensor it keeps in place is ``t.detach()``
  (the same memory). A saved output returned as itself would hold its own grad_fn, which holds it: a cycle through
  C++ that no garbage collector sees, so a forward dropped without backward (shape inference) would leak, and the
  parameters its graph holds could no longer be swapped by ``Module.to`` (DTensor parameters are).
- **One copy per tensor**: a tensor saved by several ops of one layer call (a normalised input feeding q, k and v,
  often through a fresh view per op) is copied once. The cache holds the device tensor until the layer's forward
  returns (so its memory cannot be reused by another tensor meanwhile and mistaken for it), then lets it go.
- **With recomputation** (a layer both recomputed and offloaded): the checkpoint's own hooks replace ours inside the
  layer, so what stays in host memory is what recomputation keeps -- the layer's inputs (torch saves them as saved
  tensors outside its hooks) -- and the recomputed activations live on the device during that layer's backward only.
- **When the device is the CPU** the host *is* the device: pack keeps the tensor's memory where it is (an alias),
  so offload changes nothing but still runs every rule above, the cache and the bookkeeping
  (:class:`OffloadStats`); ``copy=True`` forces a real copy, which the tests use to prove that backward reads only
  what pack returned.
- **Streams**: copies run on the current stream (as ``torch.autograd.graph.save_on_cpu(pin_memory=True)``): safe
  with the caching allocators without events, but not overlapped with compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class OffloadStats:
    """What offload moved (bytes of unique tensors): totals since creation, and host bytes held now / at most."""

    tensors: int = 0
    bytes: int = 0
    live_bytes: int = 0
    peak_bytes: int = 0

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes


class _Packed:
    """A saved tensor's host copy and its device; returns its bytes to the stats when autograd drops it."""

    __slots__ = ("device", "host", "nbytes", "stats")

    def __init__(self, device: torch.device, host: torch.Tensor, stats: OffloadStats | None) -> None:
        self.device, self.host, self.stats = device, host, stats
        self.nbytes = host.nelement() * host.element_size()
        if stats is not None:
            stats.tensors += 1
            stats.bytes += self.nbytes
            stats.live_bytes += self.nbytes
            stats.peak_bytes = max(stats.peak_bytes, stats.live_bytes)

    def __del__(self) -> None:
        if self.stats is not None:
            self.stats.live_bytes -= self.nbytes


def _plain(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, nn.Parameter)


def _storages(module: nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())
            if _plain(t) and not t.is_meta}


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that keep ``module``'s saved activations in host memory ([Note: activation offload]).

    One instance per layer call: its de-duplication cache is emptied when that forward ends."""

    def __init__(self, module: nn.Module, stats: OffloadStats | None = None, copy: bool = False) -> None:
        own = _storages(module)
        self._cache: dict[tuple[Any, ...], tuple[torch.Tensor, _Packed]] = {}
        cache = self._cache

        def pack(t: torch.Tensor) -> Any:
            root = t._base if t._base is not None else t
            if (not _plain(t) or t.layout != torch.strided or t.numel() == 0
                    or (root.requires_grad and root.grad_fn is None)
                    or t.untyped_storage().data_ptr() in own):
                return t.detach()  # kept where it is, as an alias (see the Note for why each, and why an alias)
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            hit = cache.get(key)
            if hit is not None:  # the same memory, held alive by the cache since: the same values
                return hit[1]
            if t.device.type == "cpu":
                host = t.detach().clone() if copy else t.detach()  # the device is the host: nothing to move
            else:
                host = torch.empty_like(t, device="cpu", pin_memory=True)
                host.copy_(t, non_blocking=True)
            packed = _Packed(t.device, host, stats)
            cache[key] = (t, packed)
            return packed

        def unpack(packed: Any) -> torch.Tensor:
            if not isinstance(packed, _Packed):
                return packed
            return packed.host.to(packed.device, non_blocking=True)

        super().__init__(pack, unpack)

    def __exit__(self, *args: object) -> None:
        super().__exit__(*args)
        self._cache.clear()  # the device tensors may go now: autograd holds only the host copies
