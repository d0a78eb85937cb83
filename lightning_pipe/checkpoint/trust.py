"""A checkpoint is data: whether a load may unpickle objects, and the error when one is refused.

[Note: a checkpoint is data]
Unpickling calls whatever the pickle names, so loading a checkpoint from someone else could run their code. Every
load lightning_pipe performs reads a checkpoint as data unless the caller said its source is trusted:
``torch.load(weights_only=True)`` for ``meta.pt`` and single files (tensors, primitive containers and the types
registered with ``torch.serialization.add_safe_globals``); a restricted unpickler for DCP's ``.metadata`` that admits
its metadata classes, sizes, dtypes and paths; weights-only for DCP's non-tensor items
(:mod:`lightning_pipe.checkpoint.reader`); and every file a load reads must lie inside the checkpoint directory.
The trust flag is Lightning's ``weights_only`` with torch's meaning (:func:`trusted`); the command line's is
``--trust``. What lightning_pipe writes loads without it ([Note: plain checkpoint entries] in ``plain.py``). A
refusal is a :class:`CheckpointError` naming the file, what it holds that is not data, and the opt-in; nothing from
the file has run by then. Checksums do not help here: whoever can replace a file can rewrite ``checksums.json``.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from collections.abc import Sequence
from pathlib import Path, PurePath
from typing import IO, Any

import torch

from lightning_pipe.checkpoint.format import CheckpointError

_TRUE = ("1", "y", "yes", "true")
OPT_IN = ("If you trust the source of this checkpoint, load it with `weights_only=False` (`trainer.fit(model, "
          "ckpt_path=..., weights_only=False)`, `lightning_pipe.checkpoint.consolidated(path, weights_only=False)`) "
          "or, on the command line, `--trust`.")


def _env(name: str) -> bool:
    return os.getenv(name, "0").lower() in _TRUE


def trusted(weights_only: bool | None) -> bool:
    """Whether a load may unpickle any object, by torch.load's rule: ``weights_only=False`` says so; ``None`` is
    torch's default (data only, unless ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is set); ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``
    refuses it whatever the argument."""
    if _env("TORCH_FORCE_WEIGHTS_ONLY_LOAD"):
        return False
    if weights_only is None:
        return _env("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    return not weights_only


def refused(path: str | os.PathLike[str], what: str, names: Sequence[str], hint: str = "") -> CheckpointError:
    """The error for a checkpoint that holds objects a load as data does not create."""
    listed = ", ".join(f"`{n}`" for n in names[:8]) + (f" ({len(names)} in all)" if len(names) > 8 else "")
    return CheckpointError(
        f"Refused to load {str(path)!r}: {what} holds {listed or 'an object that is not plain data'}, which is not "
        "plain data: unpickling it could run code from the file, and lightning_pipe reads a checkpoint as data "
        f"unless told its source is trusted.{hint} {OPT_IN}")


_SAFE_GLOBALS_HINT = (" To admit a type of your own without trusting the whole file, register it with "
                      "`torch.serialization.add_safe_globals([YourType])`.")
META_HINT = (" (A checkpoint written by an earlier lightning_pipe holds OmegaConf configs and paths pickled in "
             "`meta.pt`: it loads with trust, and its next save writes them as plain data.)")
_GLOBAL = re.compile(r"GLOBAL (\S+)")


def _unsafe_globals(f: str | os.PathLike[str] | IO[bytes], error: Exception) -> list[str]:
    """Every global the file names that a weights-only load refuses (read from the pickle's opcodes: nothing
    runs), else the one torch's message names."""
    try:
        if hasattr(f, "seek"):
            f.seek(0)
        found = torch.serialization.get_unsafe_globals_in_checkpoint(f)
    except Exception:
        found = []
    return list(found) or _GLOBAL.findall(str(error))[:1]


def load_data(f: str | os.PathLike[str] | IO[bytes], weights_only: bool | None, name: str | os.PathLike[str],
              what: str, mmap: bool = False, hint: str = "") -> Any:
    """``torch.load`` on CPU, as data unless :func:`trusted`; an object refused raises :func:`refused`'s error (other
    failures, a file that is no pickle at all among them, propagate as torch raised them)."""
    safe = not trusted(weights_only)
    try:
        return torch.load(f, map_location="cpu", weights_only=safe, mmap=mmap)
    except pickle.UnpicklingError as err:
        names = _unsafe_globals(f, err) if safe and str(err).startswith("Weights only load failed") else []
        if not names:  # nothing that could run was named: not a refusal
            raise
    raise refused(name, what, names, hint + _SAFE_GLOBALS_HINT)


def inside(root: Path, name: object) -> bool:
    """Whether ``name`` (read from a checkpoint) is a relative path that stays inside the directory ``root``, links
    resolved: no absolute path, no ``..``."""
    if not isinstance(name, str) or not name or "\0" in name:
        return False
    rel = PurePath(name)
    if rel.is_absolute() or rel.drive or ".." in rel.parts:
        return False
    base = root.resolve()
    return (base / rel).resolve().is_relative_to(base)


def outside_error(root: Path, listed_in: str, name: object) -> CheckpointError:
    return CheckpointError(
        f"Refused to load {str(root)!r}: `{listed_in}` points a load at {name!r}, which is not a file inside the "
        "checkpoint directory (an absolute path, `..`, or a link out of it). A checkpoint's files lie inside its "
        "directory; this one was edited or is not a lightning_pipe checkpoint.")


def reserialized(obj: Any) -> io.BytesIO:
    """``obj``, created by a load as data, saved again: what a consumer that unpickles fully may read safely."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf
