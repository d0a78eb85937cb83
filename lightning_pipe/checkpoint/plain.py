"""What lightning_pipe writes besides tensors is plain data, so its checkpoints load without trust.

[Note: plain checkpoint entries]
A checkpoint's other entries (Lightning's loops, callbacks, LR schedulers, hyper-parameters) are saved with
``torch.save``, which pickles whatever they hold. Hyper-parameters often hold an OmegaConf config (Hydra passes
``DictConfig`` / ``ListConfig``; Lightning adds the config's type as ``hparams_type``) or a ``pathlib`` path, which a
weights-only load refuses. :func:`to_plain` writes each as a plain container (the config resolved where it can be,
enums by name), a type name or a string, and records where it was under :data:`TYPES_KEY`; :func:`from_plain` puts
the types back when the checkpoint is read, so a save and a load give the hyper-parameters Lightning would have.
A plain reader (Lightning's ``load_from_checkpoint`` of a file written by ``consolidate``) sees dicts, lists and
strings. An OmegaConf config keeps its interpolations only where they do not resolve at save time; a config
holding ``${...}`` is given back as plain containers unless the load is trusted (a registered resolver could run on
access). OmegaConf is never imported here: a checkpoint can hold a config only when its writer had OmegaConf loaded,
and Lightning loads it wherever it is installed; a reader without it keeps the plain containers.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path, PurePath, PurePosixPath, PureWindowsPath
from typing import Any

TYPES_KEY = "lightning_pipe_types"
"""Top-level key of a checkpoint: ``[[where, kind], ...]``, ``where`` the keys down to a converted value."""
_PATH_TYPES: dict[str, Callable[[str], Any]] = {"PosixPath": Path, "WindowsPath": Path, "PurePosixPath": PurePosixPath,
                                                "PureWindowsPath": PureWindowsPath}


def _omegaconf() -> Any:
    return sys.modules.get("omegaconf")


def to_plain(ckpt: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``ckpt`` with OmegaConf configs, their types and paths as plain data, and where they were."""
    found: list[list[Any]] = []
    out = {k: _plain(v, (k,), found, _omegaconf()) for k, v in ckpt.items() if k != TYPES_KEY}
    if found:
        out[TYPES_KEY] = found
    return out


def _plain(value: Any, where: tuple[Any, ...], found: list[list[Any]], oc: Any) -> Any:
    kind, plain = _as_plain(value, oc)
    if kind is not None:
        found.append([list(where), kind])
        return plain
    if type(value) in (dict, OrderedDict):
        return type(value)((k, _plain(v, (*where, k), found, oc)) for k, v in value.items())
    if type(value) in (list, tuple):
        return type(value)(_plain(v, (*where, i), found, oc) for i, v in enumerate(value))
    return value


def _as_plain(value: Any, oc: Any) -> tuple[str | None, Any]:
    if isinstance(value, PurePath) and type(value).__name__ in _PATH_TYPES:
        return f"path:{type(value).__name__}", str(value)
    if oc is None:
        return None, value
    if value is oc.DictConfig or value is oc.ListConfig:
        return "omegaconf_type", f"omegaconf.{value.__name__}"
    if isinstance(value, (oc.DictConfig, oc.ListConfig)):
        try:
            return "omegaconf", oc.OmegaConf.to_container(value, resolve=True, enum_to_str=True)
        except Exception:  # an interpolation that does not resolve here: kept as written
            return "omegaconf", oc.OmegaConf.to_container(value, resolve=False, enum_to_str=True)
    return None, value


def from_plain(ckpt: dict[str, Any], trusted: bool = False) -> dict[str, Any]:
    """``ckpt`` with what :func:`to_plain` converted given back its type (in place; the record is removed).
    A malformed record is ignored: the values stay plain."""
    records = ckpt.pop(TYPES_KEY, None)
    if not isinstance(records, list):
        return ckpt
    for record in records:
        if (isinstance(record, (list, tuple)) and len(record) == 2 and isinstance(record[0], (list, tuple))
                and record[0] and isinstance(record[1], str)):
            _restore(ckpt, list(record[0]), record[1], trusted)
    return ckpt


def _restore(node: Any, where: list[Any], kind: str, trusted: bool) -> None:
    key, rest = where[0], where[1:]
    try:
        value = node[key]
    except (KeyError, IndexError, TypeError):
        return
    if rest:
        if isinstance(value, tuple):  # immutable: rebuilt with the restored element
            items = list(value)
            _restore(items, rest, kind, trusted)
            node[key] = type(value)(items)
        else:
            _restore(value, rest, kind, trusted)
        return
    try:
        node[key] = _typed(value, kind, trusted)
    except TypeError:  # the parent cannot hold it (a record that does not match the checkpoint)
        return


def _typed(value: Any, kind: str, trusted: bool) -> Any:
    if kind.startswith("path:") and isinstance(value, str) and kind[5:] in _PATH_TYPES:
        return _PATH_TYPES[kind[5:]](value)
    oc = _omegaconf()
    if oc is None:
        return value
    if kind == "omegaconf_type" and value in ("omegaconf.DictConfig", "omegaconf.ListConfig"):
        return oc.DictConfig if value.endswith("DictConfig") else oc.ListConfig
    if kind == "omegaconf" and isinstance(value, (dict, list)) and (trusted or not _interpolates(value)):
        return oc.OmegaConf.create(value)
    return value


def _interpolates(value: Any) -> bool:
    if isinstance(value, str):
        return "${" in value
    if isinstance(value, dict):
        return any(_interpolates(k) or _interpolates(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_interpolates(v) for v in value)
    return False
