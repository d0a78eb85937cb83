"""torch.distributed.checkpoint's file reader, reading a checkpoint as data ([Note: a checkpoint is data]).

Torch's ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle.load`` and the non-tensor items of the data
files with ``torch.load(weights_only=False)`` (its planner's ``load_bytes``); tensors it reads weights-only.
:class:`CheckpointReader` reads ``.metadata`` with an unpickler that admits only what a DCP save writes there, passes
non-tensor items through a weights-only load, and refuses storage records that point outside the directory.
Trusted (``weights_only=False``), it is torch's reader, with the same check of the paths.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from lightning_pipe._compat.torch import DCP_METADATA_PRIVATE
from lightning_pipe.checkpoint.format import DCP_METADATA, CheckpointError
from lightning_pipe.checkpoint.trust import inside, load_data, outside_error, refused, reserialized, trusted

# A path in ``.metadata`` (its checkpoint id) becomes this system's concrete path; the pure classes stay themselves.
_PATHS: dict[str, type] = {"Path": Path, "PosixPath": Path, "WindowsPath": Path, "PurePosixPath": PurePosixPath,
                           "PureWindowsPath": PureWindowsPath}


def _user_safe_global(module: str, name: str) -> Any:
    """A global the user admitted with ``torch.serialization.add_safe_globals`` (so it reads like torch.load)."""
    for entry in torch.serialization.get_safe_globals():
        obj, full = (entry if isinstance(entry, tuple)
                     else (entry, f"{getattr(entry, '__module__', '')}.{getattr(entry, '__qualname__', '')}"))
        if full == f"{module}.{name}":
            return obj
    return None


def metadata_global(module: str, name: str) -> Any:
    """What ``.metadata`` may name: DCP's metadata classes, sizes, dtypes, devices and paths; ``None`` otherwise."""
    if (module, name) in DCP_METADATA_PRIVATE:
        return DCP_METADATA_PRIVATE[module, name]
    if module == dcp_metadata.__name__ and name in dcp_metadata.__all__:
        return getattr(dcp_metadata, name)
    if module == "torch" and (name in ("Size", "device") or isinstance(getattr(torch, name, None), torch.dtype)):
        return getattr(torch, name)
    if module == "pathlib" and name in _PATHS:
        return _PATHS[name]
    return _user_safe_global(module, name)


class _Refused(pickle.UnpicklingError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        obj = metadata_global(module, name)
        if obj is None:
            raise _Refused(f"{module}.{name}")
        return obj


def _well_formed(md: Any) -> bool:
    """Metadata whose entries and storage records have the types the loaders read (data from the file)."""
    if not (isinstance(md, dcp_metadata.Metadata) and isinstance(md.state_dict_metadata, dict)
            and isinstance(md.storage_data, dict)):
        return False
    return all(isinstance(getattr(info, "relative_path", None), str) and isinstance(getattr(info, "offset", None), int)
               and isinstance(getattr(info, "length", None), int) for info in md.storage_data.values())


def read_metadata_as_data(f: IO[bytes], where: Path) -> Any:
    """Unpickle a DCP ``.metadata`` stream with :class:`_MetadataUnpickler`; refusals name the object."""
    try:
        md = _MetadataUnpickler(f).load()
    except _Refused as err:
        raise refused(where / DCP_METADATA, f"`{DCP_METADATA}`", [err.name],
                      " It admits torch.distributed.checkpoint's metadata classes, sizes, dtypes and paths "
                      "only.") from None
    if not _well_formed(md):
        raise CheckpointError(f"Checkpoint directory {str(where)!r}: `{DCP_METADATA}` is not the metadata of a "
                              "torch.distributed.checkpoint save (its entries or storage records have other types).")
    return md


class CheckpointReader(FileSystemReader):
    """DCP's ``FileSystemReader`` for one checkpoint directory, reading it as data unless ``weights_only=False``."""

    def __init__(self, path: str | os.PathLike[str], weights_only: bool | None = None) -> None:
        super().__init__(path)
        self.root = Path(path)
        self.trusted = trusted(weights_only)

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        if self.trusted:
            md = super().read_metadata(*args, **kwargs)
        elif args or kwargs.get("rank") is not None:
            # DCP's fallback to per-rank metadata files, which a lightning_pipe checkpoint never has
            raise CheckpointError(f"Checkpoint directory {str(self.root)!r}: only `{DCP_METADATA}` is read.")
        else:
            with open(self.root / DCP_METADATA, "rb") as f:
                md = read_metadata_as_data(f, self.root)
            if getattr(md, "storage_meta", None) is None:  # as torch's reader does
                md.storage_meta = dcp_metadata.StorageMeta()
            md.storage_meta.load_id = getattr(self, "load_id", None)
        names = {getattr(info, "relative_path", None) for info in (md.storage_data or {}).values()}
        for name in sorted(names, key=repr):  # (a few data files, each checked once)
            if not inside(self.root, name):
                raise outside_error(self.root, DCP_METADATA, name)
        return md

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if not self.trusted:
            planner = cast(LoadPlanner, _DataOnlyBytes(planner, self))
        return super().read_data(plan, planner)


class _DataOnlyBytes:
    """A load planner seen through a filter: each non-tensor item is loaded as data first (a refusal names the data
    file and the key), then handed on saved again, so the planner's own full unpickling reads only that."""

    def __init__(self, planner: LoadPlanner, reader: CheckpointReader) -> None:
        self._planner, self._reader = planner, reader

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        info = self._reader.storage_data.get(read_item.storage_index)
        data_file = self._reader.root / str(getattr(info, "relative_path", "?"))
        obj = load_data(value, True, data_file, f"the entry {read_item.dest_index.fqn!r}")
        self._planner.load_bytes(read_item, reserialized(obj))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)
