"""Lightning's own checkpoint loaders, told what a sharded pipeline checkpoint directory is.

``Model.load_from_checkpoint`` of a ``PipelineModule`` reads such a directory itself (lightning/module.py); any other
LightningModule's, and a Trainer's resume under another strategy, open it as a file and fail with the file system's
``IsADirectoryError``. :func:`explain_sharded_loads` (installed at ``import lightning_pipe``) adds to that error what
the directory is and the ways to read it (docs/checkpoints.md). ``torch.load`` of the directory cannot be reached: it
fails with the bare error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_pipe._compat import lightning as _compat
from lightning_pipe.checkpoint.format import META_FILENAME


def explain_sharded_loads() -> None:
    """Lightning's checkpoint loaders (``load_from_checkpoint`` of any LightningModule, the Trainer's resume under
    other strategies) given a sharded pipeline checkpoint directory fail with the file system's
    ``IsADirectoryError``; with this installed (at ``import lightning_pipe``), that error says what the directory is
    and how to read it. Nothing else changes; installed once."""
    for loader in _compat.CHECKPOINT_LOADERS:
        original = loader.pl_load
        if getattr(original, "_lightning_pipe_explains", False):
            continue

        def load(path_or_url: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            try:
                return _original(path_or_url, *args, **kwargs)
            except IsADirectoryError as err:
                if isinstance(path_or_url, (str, Path)) and (Path(path_or_url) / META_FILENAME).is_file():
                    err.add_note(
                        f"lightning_pipe: {str(path_or_url)!r} is a sharded checkpoint directory written by "
                        "PipelineStrategy. Read it with YourModel.load_from_checkpoint(path) where YourModel is a "
                        "PipelineModule, with torch.load(lightning_pipe.checkpoint.as_file(path)) or "
                        "Model.load_from_checkpoint(lightning_pipe.checkpoint.as_file(path)), or convert it once: "
                        "`python -m lightning_pipe.checkpoint consolidate SRC DST`. "
                        "PipelineStrategy(save_consolidated=True) writes one ordinary .ckpt file instead.")
                raise

        load._lightning_pipe_explains = True  # type: ignore[attr-defined]
        setattr(loader, "pl_load", load)  # noqa: B010  (a module attribute the loader reads per call)


__all__ = ["explain_sharded_loads"]
