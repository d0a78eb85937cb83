"""Compiled layers: ``PipelineStrategy(compile=...)`` runs each layer of a stage through ``torch.compile``.

[Note: compiled layers]
Regional compilation, as torchtitan compiles per transformer block: every layer of this rank's stages is compiled on
its own, after it was materialised (and moved), never the stage as a whole. So a stage boundary stays an eager
boundary, the layer I/O contract ([Note: the layer I/O contract]) is still checked between layers, and remote
layers stay placeholders (they are never called).

- **Where the compiled code lives.** ``torch.compile(layer, **options)`` returns an ``OptimizedModule`` that calls
  the layer itself; the stage module keeps it in a plain list beside its layers (:class:`CompiledLayers`), not in
  the module tree. So parameter and state-dict names stay the user's (``layers.3.fc.weight``, never
  ``_orig_mod.``): checkpoints saved compiled load eager and back, the optimizer sees the usual names, and
  torch's ``_check_torch_compile_compatibility`` (which looks for an ``OptimizedModule`` among the stage's
  modules) has nothing to find -- the split-backward refusal is ours (below). ``layer.compile()`` in place would
  keep the names too, but on torch 2.13 Dynamo skips the frame of a module whose ``forward`` lives in torch
  (``nn.Linear``, ``nn.Sequential``): in place, such a layer would silently stay eager.
- **A layer the user compiled** (``torch.compile(layer)`` in the list, or ``layer.compile()``) is called as it is:
  wrapping it again would compile it twice.
- **Rebuilt, never carried.** The wrappers are derived state: pickling or deep-copying a stage drops them and the
  copy compiles its own on first use. Dynamo's cache is keyed by code, so a new engine over the same layers (a
  second Trainer, validate after fit) reuses the compiled graphs.
- **Recompute and offload compose.** A recomputed layer is ``checkpoint(compiled_layer, ...)`` (non-reentrant: the
  recomputation runs the compiled forward again); offload's saved-tensor hooks sit outside the compiled call and see
  what the compiled graph saves. Both measured exact against eager (tests/distributed/test_compile.py).
- **Split backward is refused** (``zb_h1``, ``zbv``, ``dualpipev``, ``v_half``, ``v_min``, custom lists with I/W).
  torch runs a stage's input gradient (I) and weight gradient (W) as two ``autograd.grad`` calls over one graph
  (``stage_backward_input`` / ``stage_backward_weight``); a compiled layer's backward is one fused autograd node
  computing both, so the W call runs each compiled layer's whole backward a second time -- what a zero-bubble
  schedule exists to avoid. Measured on a two-block stage (2026-12-02, CPU, inductor): torch 2.11 raises in the W
  call ("Attribute '_input_metadata' is invalid for this instance of _C._FunctionBase"), 2.13 in the I call ("This
  backward function was compiled with non-empty donated buffers which requires create_graph=False and
  retain_graph=False"); with ``torch._functorch.config.donated_buffer=False`` (2.13), or by default on 2.15, both
  calls run and the gradients match eager (1.2e-7). Exact there, but twice the backward compute: refused on every
  torch until that is worth having (torch itself refuses an ``OptimizedModule`` in these schedules' stages since
  2.11, ``_check_torch_compile_compatibility``; ours are outside the module tree, so the refusal is ours).
- **Only the standard stage and engine** (gpipe, 1f1b, interleaved_1f1b, looped_bfs, custom F/B lists): schedules
  with their own stage class or engine (PipeDream's weight versions, PipeMare, Chimera's two pipelines) are refused
  until verified.
- **Not with FSDP or tensor parallelism yet**: their hooks and DTensor parameters under Dynamo are untested here.
- **Not with rebalancing yet**: its per-layer timing hooks would run inside the compiled region.
- **Shapes are planned eagerly.** The meta-tensor forwards that plan a new batch shape's transfers ([Note: shapes
  without re-inference] in runtime/shapes.py) run the layers themselves, a user-compiled one's original module
  included (:meth:`CompiledLayers.eager`, entered as the stage's ``meta_forward_context``): through the compiled
  wrappers they would cost Dynamo a recompile per shape on the ``Meta`` dispatch key (its recompile limit counts
  them) and fail in inductor for some layers (a tuple-returning layer: "Argument 'empty_strided_default' ... was
  used before it has been defined"), which switched planning off for the run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn


def compiled_by_user(layer: nn.Module) -> bool:
    """Whether the user compiled ``layer`` already: ``torch.compile(layer)`` or ``layer.compile()``."""
    return isinstance(layer, torch._dynamo.eval_frame.OptimizedModule) or (
        getattr(layer, "_compiled_call_impl", None) is not None)


def _uncompiled(layer: nn.Module) -> Callable[..., Any]:
    """What ``layer`` runs without Dynamo: a user's ``torch.compile(layer)`` its original module, a layer compiled
    in place (``layer.compile()``) its own forward."""
    if isinstance(layer, torch._dynamo.eval_frame.OptimizedModule):
        return layer._orig_mod
    if getattr(layer, "_compiled_call_impl", None) is not None:
        return layer._call_impl
    return layer


class CompiledLayers:
    """What a stage calls for each of its layers: the compiled wrapper, or the layer itself ([Note: compiled layers]).

    Built on first use, so layers materialised or moved after the stage module was made are compiled as they are
    when they first run; ``None`` options: the layers themselves.
    """

    def __init__(self, options: Mapping[str, Any] | None) -> None:
        self.options = None if options is None else dict(options)
        self._calls: list[Callable[..., Any]] | None = None
        self._eager = False

    def calls(self, layers: Sequence[nn.Module]) -> Sequence[Callable[..., Any]]:
        if self._eager:
            return [_uncompiled(layer) for layer in layers]
        if self.options is None:
            return layers
        if self._calls is None or len(self._calls) != len(layers):
            self._calls = [layer if compiled_by_user(layer) else torch.compile(layer, **self.options)
                           for layer in layers]
        return self._calls

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        """Every layer runs uncompiled inside (the meta forwards that plan shapes: [Note: compiled layers])."""
        before, self._eager = self._eager, True
        try:
            yield
        finally:
            self._eager = before

    def __getstate__(self) -> dict[str, Any]:
        return {"options": self.options, "_calls": None, "_eager": False}  # derived state: a copy compiles its own

    def __deepcopy__(self, memo: dict[int, Any]) -> CompiledLayers:
        return CompiledLayers(self.options)
