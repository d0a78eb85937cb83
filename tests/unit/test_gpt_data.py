"""The GPT recipe's data module: stdlib corpus, text file, uint16 .bin; determinism, split, shapes, baseline."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from recipes.gpt.data import ByteCorpusDataModule, TokenWindows, stdlib_py_files

SMALL = 300_000  # bytes of stdlib: enough for the tests, fast to read


@pytest.fixture(scope="module")
def stdlib_dm() -> ByteCorpusDataModule:
    dm = ByteCorpusDataModule(block_size=32, batch_size=4, max_bytes=SMALL, val_fraction=0.1, seed=3)
    dm.setup("fit")
    return dm


def test_stdlib_files_are_sorted_sources_without_tests() -> None:
    files = stdlib_py_files()
    assert len(files) > 100
    assert files == sorted(files, key=lambda p: p.as_posix())
    assert all(p.suffix == ".py" for p in files)
    assert not any({"site-packages", "test", "tests"} & set(p.parts) for p in files)


def test_stdlib_corpus_size_and_split(stdlib_dm: ByteCorpusDataModule) -> None:
    dm = stdlib_dm
    assert dm.corpus_bytes == SMALL and dm.num_files >= 1
    assert len(dm.train_tokens) + len(dm.val_tokens) == SMALL
    assert len(dm.val_tokens) == int(SMALL * 0.1)
    assert dm.train_tokens.dtype == np.uint8
    assert b"import" in dm.train_tokens.tobytes()


def test_batches_are_shifted_windows(stdlib_dm: ByteCorpusDataModule) -> None:
    for loader in (stdlib_dm.train_dataloader(), stdlib_dm.val_dataloader()):
        x, y = next(iter(loader))
        assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.long
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert loader.drop_last  # fixed shapes for the pipeline's shape inference


def test_windows_stay_inside_their_split(stdlib_dm: ByteCorpusDataModule) -> None:
    dm = stdlib_dm
    train_off, val_off = dm.train_offsets(), dm.val_offsets()
    assert train_off.min() >= 0 and train_off.max() + 33 <= len(dm.train_tokens)
    assert len(train_off) == len(dm.train_tokens) // 32
    assert val_off.max() + 33 <= len(dm.val_tokens)
    assert np.all(np.diff(val_off) == 33)  # contiguous, non-overlapping
    # the last window of every val offset is fully readable
    x, y = TokenWindows(dm.val_tokens, val_off, 32)[len(val_off) - 1]
    assert x.shape == y.shape == (32,)


def test_deterministic_given_seed() -> None:
    def offsets(seed: int) -> np.ndarray:
        dm = ByteCorpusDataModule(block_size=32, batch_size=4, max_bytes=SMALL, seed=seed)
        dm.setup()
        return dm.train_offsets()

    a, b, c = offsets(1), offsets(1), offsets(2)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_unigram_entropy(stdlib_dm: ByteCorpusDataModule) -> None:
    h = stdlib_dm.unigram_entropy()
    assert 2.0 < h < math.log(256)  # source code: far from uniform


def test_text_file(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_bytes(b"abcd" * 1000)
    dm = ByteCorpusDataModule(text_path=str(text), block_size=8, batch_size=2, val_fraction=0.25)
    dm.setup()
    assert dm.corpus_bytes == 4000 and len(dm.val_tokens) == 1000
    assert dm.unigram_entropy() == pytest.approx(math.log(4))
    x, y = next(iter(dm.val_dataloader()))
    assert x[0].tolist() == list(b"abcdabcd") and y[0].tolist() == list(b"bcdabcda")


def test_bin_file(tmp_path: Path) -> None:
    tokens = (np.arange(5000) % 1000 + 50000).astype(np.uint16)  # ids above 256: a GPT-2-sized vocabulary
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    dm = ByteCorpusDataModule(bin_path=str(path), block_size=16, batch_size=2, val_fraction=0.2, seed=0)
    dm.setup()
    assert isinstance(dm.train_tokens, np.memmap)
    assert dm.corpus_bytes == 10000 and len(dm.val_tokens) == 1000
    x, y = next(iter(dm.train_dataloader()))
    assert x.dtype == torch.long and int(x.max()) >= 50000
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_separate_val_bin(tmp_path: Path) -> None:
    np.arange(3000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.arange(500, dtype=np.uint16).tofile(tmp_path / "val.bin")
    dm = ByteCorpusDataModule(
        bin_path=str(tmp_path / "train.bin"), val_bin_path=str(tmp_path / "val.bin"), block_size=8, batch_size=2
    )
    dm.setup()
    assert len(dm.train_tokens) == 3000 and len(dm.val_tokens) == 500
    x, _ = next(iter(dm.val_dataloader()))
    assert x[0].tolist() == list(range(8))


def test_too_little_data_names_the_keys(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_bytes(b"x" * 100)
    dm = ByteCorpusDataModule(text_path=str(text), block_size=32, batch_size=4)
    with pytest.raises(ValueError) as err:
        dm.setup()
    msg = str(err.value)
    assert "4 x 33 = 132 tokens" in msg and "Got 95 tokens in the train split" in msg and str(text) in msg
    assert "Change `data.text_path` (more data), `data.batch_size`" in msg


def test_missing_data_file_is_refused_at_construction(tmp_path: Path) -> None:
    # In the launching process, before any rank starts (configs/data/text_file.yaml, bin_file.yaml).
    for key in ("text_path", "bin_path", "val_bin_path"):
        kwargs = {key: str(tmp_path / "missing")}
        if key == "val_bin_path":
            np.arange(3000, dtype=np.uint16).tofile(tmp_path / "train.bin")
            kwargs["bin_path"] = str(tmp_path / "train.bin")
        with pytest.raises(FileNotFoundError, match=rf"{key}='.*missing'.*Change `data.{key}`"):
            ByteCorpusDataModule(**kwargs)


def test_empty_or_tiny_sources_name_their_setting(tmp_path: Path) -> None:
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"Got 0 tokens.*Change `data.bin_path`"):
        ByteCorpusDataModule(bin_path=str(tmp_path / "empty.bin"), block_size=8, batch_size=2).setup()
    with pytest.raises(ValueError, match=r"standard-library corpus.*max_bytes=500.*Change `data.max_bytes`"):
        ByteCorpusDataModule(max_bytes=500, block_size=32, batch_size=4).setup()


def test_val_fraction_is_checked() -> None:
    with pytest.raises(ValueError, match="val_fraction"):
        ByteCorpusDataModule(val_fraction=0.0)


def _windows(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[list[int]]:
    return [x[:, 0].tolist() for x, _ in batches]


def test_training_loader_resumes_the_interrupted_epoch(stdlib_dm: ByteCorpusDataModule) -> None:
    """The state a checkpoint keeps (sampler epoch, batches handed out) makes the next pass of that epoch skip what
    was trained on; a pass of another epoch (the checkpoint closed its epoch) starts at its first batch."""
    from torch.utils.data import DistributedSampler

    from recipes.gpt.data import ResumableDataLoader

    def loader() -> ResumableDataLoader:
        ds = TokenWindows(stdlib_dm.train_tokens, stdlib_dm.train_offsets()[:40], stdlib_dm.block_size)
        sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=7)  # what Lightning injects
        return ResumableDataLoader(ds, batch_size=4, sampler=sampler, drop_last=True)

    first = loader()
    first.sampler.set_epoch(2)  # type: ignore[attr-defined]
    uninterrupted = _windows(list(first))
    iterator = iter(first)
    _ = [next(iterator) for _ in range(3)]
    state = first.state_dict()
    assert state == {"epoch": 2, "batches": 3}

    resumed = loader()
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(2)  # type: ignore[attr-defined]
    assert _windows(list(resumed)) == uninterrupted[3:]
    assert resumed.state_dict() == {"epoch": 2, "batches": len(uninterrupted)}
    assert _windows(list(resumed)) == uninterrupted  # only the first pass after the resume skips

    next_epoch = loader()
    next_epoch.load_state_dict({"epoch": 2, "batches": len(uninterrupted)})  # saved at the epoch's end
    next_epoch.sampler.set_epoch(3)  # type: ignore[attr-defined]
    fresh = loader()
    fresh.sampler.set_epoch(3)  # type: ignore[attr-defined]
    assert _windows(list(next_epoch)) == _windows(list(fresh))


def test_a_fit_resumed_mid_epoch_ends_like_an_uninterrupted_one(tmp_path: Path) -> None:
    """Lightning itself, one device: 6 steps in one go, and 3 steps + a resume from the step-3 checkpoint, end
    with the same parameters (without a resumable loader the resumed run retrains the epoch's first batches)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from recipes.gpt.model import GPT

    def fit(max_steps: int, ckpt_path: str | None = None, callbacks: list | None = None) -> GPT:
        pl.seed_everything(5)
        model = GPT(block_size=16, n_layer=1, n_head=2, n_embd=16, warmup_steps=1, max_steps=6)
        dm = ByteCorpusDataModule(block_size=16, batch_size=4, max_bytes=SMALL, seed=3)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, callbacks=callbacks,
                             enable_checkpointing=bool(callbacks), enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=tmp_path)
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
        return model

    uninterrupted = fit(6)
    fit(3, callbacks=[ModelCheckpoint(dirpath=tmp_path, filename="step3", every_n_train_steps=3)])
    resumed = fit(6, ckpt_path=str(tmp_path / "step3.ckpt"))
    for (name, want), got in zip(uninterrupted.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
