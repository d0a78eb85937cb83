"""The private torch names that torch.distributed.checkpoint writes into a checkpoint's ``.metadata`` file.

The restricted reader of ``.metadata`` (:mod:`lightning_pipe.checkpoint.reader`) admits exactly the classes a
DCP save pickles there; three of them are private: the storage record of each item (``_StorageInfo``: data file,
offset, length), the memory-format code of ``TensorProperties`` and the function that pickled ``torch.layout``
objects call. Read from torch 2.13's ``filesystem.py``, ``metadata.py`` and ``serialization.py``; resolved here,
at import, so a torch that moved one fails loudly instead of refusing its own checkpoints later.
"""

from __future__ import annotations

from typing import Any

from lightning_pipe._compat.torch_release import PRIVATE_TORCH_API, _module, _resolve

_WHERE = (
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
)

DCP_METADATA_PRIVATE: dict[tuple[str, str], Any] = {
    (module, name): _resolve(_module(module), name, module) for module, name in _WHERE}
"""(module, name) -> object, for each private global a DCP ``.metadata`` pickle refers to."""

PRIVATE_TORCH_API.update({f"{module}.{name}": obj for (module, name), obj in DCP_METADATA_PRIVATE.items()})
