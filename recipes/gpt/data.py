"""Byte-level (or pre-tokenized) language-model data that needs no download.

Sources, first match wins:

* ``bin_path``: a nanoGPT-style ``uint16`` token file (read through ``numpy.memmap``); the model's
  ``vocab_size`` must cover its ids. ``val_bin_path`` optionally names a separate validation file
  (nanoGPT's ``train.bin``/``val.bin``); otherwise the last ``val_fraction`` of the tokens is validation.
* ``text_path``: any file, read as bytes (vocabulary 256).
* default: the ``.py`` files of this Python's standard library (sorted paths, tests and site-packages left
  out), concatenated up to ``max_bytes``. Deterministic on a given Python install; nothing is cached.

Samples are windows of ``block_size + 1`` tokens: ``x = w[:-1]``, ``y = w[1:]``.
* train: ``len(train_tokens) // block_size`` windows per epoch (about one pass over the tokens), starting at
  offsets drawn once from ``seed`` — random offsets give every shift of the text, not just one tiling.
  The loader shuffles them (Lightning's sampler is seeded by ``seed_everything``).
* val: contiguous, non-overlapping windows in order, so the validation loss is the same number every time.

Both loaders drop the last incomplete batch: pipeline schedules infer shapes once and need a fixed batch size.
The training loader resumes mid-epoch (:class:`ResumableDataLoader`): a run resumed from any checkpoint sees the
batches an uninterrupted run would.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def stdlib_py_files(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """The standard library's ``.py`` files, sorted by relative path, without tests and third-party packages."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if not _SKIP_DIRS.intersection(rel.parts[:-1]) and path.is_file():
            files.append(rel)
    return [root / rel for rel in sorted(files, key=lambda p: p.as_posix())]


def read_stdlib_corpus(max_bytes: int, root: str | os.PathLike[str] | None = None) -> tuple[np.ndarray, int]:
    """Concatenate standard-library sources up to ``max_bytes``; returns ``(uint8 array, number of files used)``."""
    chunks: list[bytes] = []
    total = 0
    for path in stdlib_py_files(root):
        if total >= max_bytes:
            break
        data = path.read_bytes()[: max_bytes - total]
        chunks.append(data)
        total += len(data)
    if total == 0:
        raise FileNotFoundError(f"No standard-library .py files found under {root or sysconfig.get_paths()['stdlib']}.")
    return np.frombuffer(b"".join(chunks), dtype=np.uint8), len(chunks)


def _memmap_tokens(path: str) -> np.ndarray:
    """A ``uint16`` token file, mapped; numpy cannot map an empty file, which we report as too little data."""
    if Path(path).expanduser().stat().st_size == 0:
        return np.zeros(0, dtype=np.uint16)
    return np.memmap(Path(path).expanduser(), dtype=np.uint16, mode="r")


class TokenWindows(Dataset):
    """Windows ``tokens[o : o + block_size + 1]`` at the given offsets, as ``(x, y)`` LongTensors."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, block_size: int) -> None:
        self.tokens = tokens
        self.offsets = offsets
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        o = int(self.offsets[i])
        window = torch.from_numpy(np.asarray(self.tokens[o : o + self.block_size + 1], dtype=np.int64))
        return window[:-1], window[1:]


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` that continues an interrupted epoch at the batch where its checkpoint was taken.

    Lightning stores a training loader's ``state_dict()`` in every checkpoint when the loader has one, and hands it
    back through ``load_state_dict()`` before the resumed run iterates. Without it, Lightning restarts the
    interrupted epoch from its first batch, so a run resumed mid-epoch (a SLURM requeue,
    ``ModelCheckpoint(every_n_train_steps=...)``) trains on other batches than an uninterrupted one. The state is
    the sampler's epoch and the batches handed out in it (Lightning's fetcher reads a sized loader without looking
    ahead, so that is what the loop consumed). The resumed pass skips them only in that same epoch — a checkpoint
    taken at an epoch's end resumes at the next epoch's start — by reading and dropping them (a window of the token
    array each: microseconds). The order must not depend on anything else: Lightning's ``DistributedSampler``
    shuffles by seed and epoch.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._epoch: int | None = None  # the sampler's epoch of the current pass
        self._handed_out = 0  # batches of the current pass
        self._resume: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "batches": self._handed_out}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume = dict(state_dict)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        self._epoch, self._handed_out = None, 0
        return self._batches(super().__iter__())

    def _batches(self, batches: Iterator[Any]) -> Iterator[Any]:
        # Runs at the first next(): after Lightning's set_epoch for this pass.
        self._epoch = getattr(self.sampler, "epoch", None)
        resume, self._resume = self._resume, None
        if resume is not None and resume["epoch"] == self._epoch and resume["batches"] < len(self):
            for _ in range(resume["batches"]):
                next(batches)
            self._handed_out = resume["batches"]
        for batch in batches:
            self._handed_out += 1
            yield batch


class ByteCorpusDataModule(pl.LightningDataModule):
    """Language-model data from the standard library, a text file, or a ``uint16`` ``.bin`` (see module doc).

    After ``setup()``: ``corpus_bytes`` (bytes or tokens read), ``num_files`` (stdlib files used),
    ``train_tokens`` / ``val_tokens`` (the split arrays).
    """

    def __init__(
        self,
        block_size: int = 128,
        batch_size: int = 16,
        text_path: str | None = None,
        bin_path: str | None = None,
        val_bin_path: str | None = None,
        max_bytes: int = 8_000_000,
        val_fraction: float = 0.05,
        seed: int = 1337,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1). Got {val_fraction}. Change `data.val_fraction`.")
        # Checked here, in the launching process, so a typo fails before any rank starts.
        for key, path in (("text_path", text_path), ("bin_path", bin_path), ("val_bin_path", val_bin_path)):
            if path is not None and not Path(path).expanduser().is_file():
                where = "" if Path(path).is_absolute() else f" (relative to {Path.cwd()})"
                raise FileNotFoundError(f"The data file must exist. Got {key}={str(path)!r}{where}, which is not a "
                                        f"file. Change `data.{key}`.")
        self.save_hyperparameters()
        self.block_size = block_size
        self.batch_size = batch_size
        self.text_path = text_path
        self.bin_path = bin_path
        self.val_bin_path = val_bin_path
        self.max_bytes = max_bytes
        self.val_fraction = val_fraction
        self.seed = seed
        self.num_workers = num_workers
        self.corpus_bytes = 0
        self.num_files = 0
        self.train_tokens: np.ndarray | None = None
        self.val_tokens: np.ndarray | None = None

    # ---------------------------------------------------------------- loading
    def _load(self) -> tuple[np.ndarray, np.ndarray]:
        if self.bin_path is not None:
            tokens = _memmap_tokens(self.bin_path)
            self.corpus_bytes = tokens.nbytes
            if self.val_bin_path is not None:
                val = _memmap_tokens(self.val_bin_path)
                self.corpus_bytes += val.nbytes
                return tokens, val
        elif self.text_path is not None:
            tokens = np.fromfile(Path(self.text_path).expanduser(), dtype=np.uint8)
            self.corpus_bytes = tokens.nbytes
        else:
            tokens, self.num_files = read_stdlib_corpus(self.max_bytes)
            self.corpus_bytes = tokens.nbytes
        n_val = int(len(tokens) * self.val_fraction)
        return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]

    def _source(self) -> str:
        if self.bin_path is not None:
            val = f" and val_bin_path={self.val_bin_path!r}" if self.val_bin_path is not None else ""
            return f"bin_path={self.bin_path!r}{val} ({self.corpus_bytes} bytes)"
        if self.text_path is not None:
            return f"text_path={self.text_path!r} ({self.corpus_bytes} bytes)"
        return f"the standard-library corpus ({self.corpus_bytes} bytes, max_bytes={self.max_bytes})"

    def _source_key(self) -> str:
        if self.bin_path is not None:
            return "`data.bin_path`" + (" / `data.val_bin_path`" if self.val_bin_path is not None else "")
        return "`data.text_path`" if self.text_path is not None else "`data.max_bytes`"

    def setup(self, stage: str | None = None) -> None:
        if self.train_tokens is not None:
            return
        train, val = self._load()
        need = self.block_size + 1
        for name, arr in (("train", train), ("val", val)):
            if len(arr) < need * self.batch_size:
                raise ValueError(
                    f"Each split needs at least one full batch of windows: batch_size x (block_size + 1) = "
                    f"{self.batch_size} x {need} = {need * self.batch_size} tokens. Got {len(arr)} tokens in the "
                    f"{name} split of {self._source()}. Change {self._source_key()} (more data), `data.batch_size`, "
                    "`model.block_size` or `data.val_fraction`."
                )
        self.train_tokens, self.val_tokens = train, val

    # ---------------------------------------------------------------- loaders
    def train_offsets(self) -> np.ndarray:
        assert self.train_tokens is not None, "call setup() first"
        n = len(self.train_tokens)
        rng = np.random.default_rng(self.seed)
        # `high` is exclusive, so every window o .. o + block_size fits: o + block_size + 1 <= n.
        return rng.integers(0, n - self.block_size, size=n // self.block_size, dtype=np.int64)

    def val_offsets(self) -> np.ndarray:
        assert self.val_tokens is not None, "call setup() first"
        return np.arange(0, len(self.val_tokens) - self.block_size, self.block_size + 1, dtype=np.int64)

    def train_dataloader(self) -> DataLoader:
        ds = TokenWindows(self.train_tokens, self.train_offsets(), self.block_size)
        return ResumableDataLoader(ds, batch_size=self.batch_size, shuffle=True, drop_last=True,
                                   num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        ds = TokenWindows(self.val_tokens, self.val_offsets(), self.block_size)
        return DataLoader(ds, batch_size=self.batch_size, shuffle=False, drop_last=True, num_workers=self.num_workers)

    # ---------------------------------------------------------------- baseline
    def unigram_entropy(self) -> float:
        """Entropy (nats/token) of the validation split's own token frequencies.

        The loss of the best context-free predictor on the val split (fitted on the val split itself, so an
        optimistic baseline): a model whose ``val_loss`` is below this has learned something from context.
        """
        assert self.val_tokens is not None, "call setup() first"
        counts = np.bincount(np.asarray(self.val_tokens), minlength=1).astype(np.float64)
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())
