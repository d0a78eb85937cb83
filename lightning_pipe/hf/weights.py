"""Layer weights of a transformers causal LM's layer list: allocate from meta, seeded init, local safetensors.

[Note: HF names] (in :mod:`lightning_pipe.hf.layers`): each layer knows the checkpoint keys of its tensors, so
:func:`load_layer_weights_` reads exactly those keys with ``safetensors.safe_open`` — a rank reads only the tensors of
its own layers (:attr:`SafetensorsCheckpoint.keys_read` records them).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor, nn

from lightning_pipe._compat import transformers as _compat
from lightning_pipe.hf.expert_weights import fuse, fused_sources, router_alias
from lightning_pipe.hf.layers import HFLayer, _state_tensors, layers_from_config
from lightning_pipe.layers.stages import allocate_layers, on_meta

__all__ = [
    "SafetensorsCheckpoint",
    "hf_state_dict",
    "init_layer_",
    "load_layer_weights_",
    "load_layers",
    "materialize_layers_",
]


def _init_weights_function(layer: nn.Module) -> Callable[[nn.Module], None] | None:
    """The layer's model class's own ``_init_weights(module)`` (:func:`_compat.init_weights_function`)."""
    return _compat.init_weights_function(getattr(layer, "hf_model_class", None), getattr(layer, "hf_config", None))


def materialize_layers_(layers: nn.ModuleList | Sequence[nn.Module], indices: Iterable[int],
                        device: torch.device | str = "cpu") -> None:
    """Allocate (``to_empty``) the listed layers if they are on the meta device, keeping ties between them
    (:func:`~lightning_pipe.layers.stages.allocate_layers`: a tie between two listed layers, embedding and head on
    one rank, is formed again). Values are garbage until :func:`init_layer_` / :func:`load_layer_weights_`.
    """
    allocate_layers([layers[i] for i in indices if on_meta(layers[i])], device)


def _rng_devices(layer: nn.Module) -> list[int]:
    return sorted({t.device.index or 0 for t in layer.parameters() if t.device.type == "cuda"})


@torch.no_grad()
def init_layer_(layer: nn.Module, seed: int) -> None:
    """Random init of one layer with the model class's own ``_init_weights``, seeded: the same on every rank and on
    one device (use ``seed = base_seed + layer index``). A tie's second use (the head's weight) is left to the
    layer that owns it. No-op for meta tensors; recomputes the rotary buffers."""
    if any(t.is_meta for t in layer.parameters()):
        return
    init_fn = _init_weights_function(layer)
    skip = {id(p) for n, p in layer.named_parameters() if n in getattr(layer, "tied", ())}
    saved = {id(p): p.detach().clone() for p in layer.parameters() if id(p) in skip}
    _compat.clear_initialized_flags([*layer.parameters(), *layer.modules()])
    with torch.random.fork_rng(devices=_rng_devices(layer)):
        torch.manual_seed(seed)
        if init_fn is not None:
            layer.apply(init_fn)  # post-order, like transformers: GPT-2's scaled c_proj init wins over Conv1D's
        else:
            for sub in layer.modules():
                reset = getattr(sub, "reset_parameters", None)
                if callable(reset):
                    reset()
    for p in layer.parameters():
        if id(p) in saved:
            p.copy_(saved[id(p)])
    if isinstance(layer, HFLayer):
        layer.reset_buffers()


# ------------------------------------------------------------------------------------------------ checkpoints
class SafetensorsCheckpoint:
    """A local checkpoint directory (``model.safetensors`` or a sharded ``*.safetensors.index.json``), read by key.

    Only the requested tensors are read (``safetensors.safe_open(...).get_tensor(key)``).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        path = os.fspath(path)
        self.directory = path if os.path.isdir(path) else os.path.dirname(path)
        self.weight_map: dict[str, str] = {}
        self.keys_read: list[str] = []
        """Every key :meth:`read` has read, in order (what this process took from the checkpoint)."""
        if os.path.isfile(path) and path.endswith(".safetensors"):
            files = [path]
        else:
            index = [f for f in sorted(os.listdir(path)) if f.endswith(".safetensors.index.json")]
            if index:
                with open(os.path.join(path, index[0])) as fh:
                    self.weight_map = {k: os.path.join(path, v) for k, v in json.load(fh)["weight_map"].items()}
                files = []
            else:
                files = [os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(".safetensors")]
                if not files:
                    raise FileNotFoundError(
                        f"No safetensors weights in {path!r}: expected model.safetensors or "
                        "model.safetensors.index.json (save with `save_pretrained(dir, safe_serialization=True)`)."
                    )
        if files:
            import safetensors
            for file in files:
                with safetensors.safe_open(file, framework="pt") as fh:
                    for key in fh.keys():  # a safetensors handle, not a dict
                        self.weight_map[key] = file

    def keys(self) -> set[str]:
        return set(self.weight_map)

    def resolve(self, candidates: Sequence[str], base_prefix: str = "") -> str | None:
        for key in candidates:
            if key in self.weight_map:
                return key
        if base_prefix:
            for key in candidates:
                if key.startswith(base_prefix) and key[len(base_prefix):] in self.weight_map:
                    return key[len(base_prefix):]
        return None

    def read(self, keys: Iterable[str], device: torch.device | str = "cpu") -> dict[str, Tensor]:
        """The tensors of ``keys``, one ``safe_open`` per file."""
        import safetensors

        by_file: dict[str, list[str]] = {}
        for key in keys:
            by_file.setdefault(self.weight_map[key], []).append(key)
        out: dict[str, Tensor] = {}
        for file, file_keys in by_file.items():
            with safetensors.safe_open(file, framework="pt", device=str(device)) as fh:
                for key in file_keys:
                    out[key] = fh.get_tensor(key)
                    self.keys_read.append(key)
        return out


@torch.no_grad()
def load_layer_weights_(layer: nn.Module, checkpoint: SafetensorsCheckpoint | str | os.PathLike[str]) -> None:
    """Copy one layer's tensors from a local checkpoint into it (in place; the layer must not be on meta).

    Reads only this layer's keys. Usable as the body of a LightningModule's ``reset_layer(index, layer)``.
    """
    if not isinstance(checkpoint, SafetensorsCheckpoint):
        checkpoint = SafetensorsCheckpoint(checkpoint)
    hf_keys: Mapping[str, Sequence[str]] = getattr(layer, "hf_keys", {})
    targets = dict(_state_tensors(layer))
    wanted: dict[str, str] = {}
    fused: dict[str, list[list[str]]] = {}  # local name -> per-expert keys ([Note: expert tensors on disk])
    missing = []
    base_prefix = getattr(layer, "base_prefix", "")
    for local, candidates in hf_keys.items():
        key = checkpoint.resolve(candidates, base_prefix)
        if key is None:  # a per-expert checkpoint of a fused MoE tensor, or Mixtral's router name
            key = checkpoint.resolve([a for a in map(router_alias, candidates) if a], base_prefix)
        if key is None and local in targets:
            sources = fused_sources(candidates, base_prefix, targets[local].shape[0],
                                    checkpoint.weight_map.__contains__)
            if sources is not None:
                fused[local] = sources
                continue
        if key is None:
            missing.append(f"{local} (looked for {list(candidates)})")
        else:
            wanted[local] = key
    if missing:
        raise KeyError(f"{type(layer).__name__}: tensors missing from the checkpoint in "
                       f"{checkpoint.directory!r}: {missing}")
    device = next((t.device for t in targets.values()), torch.device("cpu"))
    if device.type == "meta":
        raise ValueError(f"{type(layer).__name__} is on the meta device: allocate it first (materialize_layers_, or "
                         "the pipeline strategy's setup) and then load its weights.")
    tensors = checkpoint.read(sorted(set(wanted.values()) | {k for s in fused.values() for g in s for k in g}),
                              device=device)
    for local, sources in fused.items():
        tensors[local] = fuse(sources, tensors)
        wanted[local] = local
    for local, key in wanted.items():
        target, value = targets[local], tensors[key]
        if target.shape != value.shape:
            raise ValueError(f"{type(layer).__name__}.{local}: checkpoint tensor {key!r} has shape "
                             f"{tuple(value.shape)}, the layer expects {tuple(target.shape)}.")
        target.copy_(value)
    if isinstance(layer, HFLayer):
        layer.reset_buffers()


def load_layers(path: str | os.PathLike[str], only: Iterable[int] | None = None, *,
                device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                attn_implementation: str | None = None) -> nn.ModuleList:
    """The layer list of the causal LM saved in ``path`` (a local directory: ``config.json`` + safetensors).

    Built on the meta device; only the layers in ``only`` (all when ``None``) are allocated on ``device`` and read
    from the checkpoint — the others stay on meta (a pipeline rank replaces them with its placeholders). Only the
    tensors of those layers are read.
    """
    from transformers import AutoConfig

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"load_layers reads a local directory (config.json + *.safetensors); {path!r} is not "
                                "one. Nothing is downloaded: save a model with `save_pretrained(dir)` first.")
    config = AutoConfig.from_pretrained(path)
    if attn_implementation is not None:
        _compat.set_attn_implementation(config, attn_implementation)
    layers = layers_from_config(config, device="meta", dtype=dtype)
    indices = range(len(layers)) if only is None else sorted(set(only))
    for i in indices:
        if not 0 <= i < len(layers):
            raise IndexError(f"layer {i} does not exist: the model has {len(layers)} layers (0..{len(layers) - 1}).")
    materialize_layers_(layers, indices, device)
    checkpoint = SafetensorsCheckpoint(path)
    for i in indices:
        load_layer_weights_(layers[i], checkpoint)
    return layers


def hf_state_dict(layers: Iterable[nn.Module]) -> dict[str, Tensor]:
    """The layers' tensors under the model's own names (``model.layers.3.mlp.up_proj.weight``), e.g. to
    ``model.load_state_dict(hf_state_dict(layers), strict=False)`` a trained list back into a transformers model.
    A tied weight appears once, under its first layer's name; meta (not allocated) layers are skipped."""
    out: dict[str, Tensor] = {}
    for layer in layers:
        hf_keys: Mapping[str, Sequence[str]] = getattr(layer, "hf_keys", {})
        for local, tensor in _state_tensors(layer):
            if local in hf_keys and not tensor.is_meta and local not in getattr(layer, "tied", ()):
                out.setdefault(hf_keys[local][0], tensor.detach())
    return out
