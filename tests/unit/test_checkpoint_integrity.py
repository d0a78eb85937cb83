"""Checksums and read-only queries of lightning_pipe.checkpoint, in one process (no process group).

The strategy's save/load (``ShardedCheckpointer``) runs here with a one-rank ``RankGroup``: the same code the
ranks run, minus the collectives.
"""

from __future__ import annotations

import errno
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.trainer.states import TrainerFn

from lightning_pipe import checkpoint as ckpt_lib
from lightning_pipe.checkpoint.__main__ import main
from lightning_pipe.config import PipelineConfig
from lightning_pipe.lightning.checkpointing import RankGroup, ShardedCheckpointer
from lightning_pipe.parallel.topology import Topology
from tests.models import ToyRegressor


def trained() -> tuple[ToyRegressor, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = ToyRegressor(n_layers=4, optimizer="adamw")
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    for _ in range(2):
        model.layers(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def checkpointer(model: ToyRegressor, opt: torch.optim.Optimizer) -> ShardedCheckpointer:
    model._pipeline_layout = SimpleNamespace(ranges=[range(len(model.layers))], tied=[])  # type: ignore[attr-defined]
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    trainer.state.fn = TrainerFn.FITTING
    model.trainer = trainer
    return ShardedCheckpointer(RankGroup(0, 1, lambda obj: obj, lambda: None), model, [opt], PipelineConfig(),
                               Topology(1, 1, 0))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ToyRegressor, torch.optim.Optimizer]:
    model, opt = trained()
    ckpt = checkpointer(model, opt)
    path = tmp_path_factory.mktemp("integrity") / "epoch=0-step=2.ckpt"
    ckpt.save({"state_dict": model.state_dict(), "optimizer_states": [ckpt.optimizer_state(opt)], "epoch": 0,
               "global_step": 2}, path)
    return path, model, opt


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 4):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))  # same size: only a checksum notices


def fresh_load(path: Path) -> tuple[ToyRegressor, torch.optim.Optimizer]:
    torch.manual_seed(1)
    model = ToyRegressor(n_layers=4, optimizer="adamw", seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    checkpointer(model, opt).load(path)
    return model, opt


def test_save_records_every_file_and_load_restores(saved: tuple) -> None:
    path, model, opt = saved
    recorded = ckpt_lib.read_checksums(path)
    assert recorded is not None
    assert set(recorded) == {".metadata", "meta.pt", *(f.name for f in path.glob("*.distcp") if f.stat().st_size)}
    assert ckpt_lib.verify_checksums(path) == len(recorded)
    # shared out among ranks: every file checked exactly once
    assert sum(ckpt_lib.verify_checksums(path, r, 3) for r in range(3)) == len(recorded)
    loaded, loaded_opt = fresh_load(path)
    for (name, p), q in zip(model.named_parameters(), loaded.parameters()):
        assert torch.equal(p, q), name
    for p, q in zip(model.parameters(), loaded.parameters()):
        assert torch.equal(opt.state[p]["exp_avg_sq"], loaded_opt.state[q]["exp_avg_sq"])


@pytest.mark.parametrize("victim", ["data", "meta.pt", ".metadata"])
def test_flipped_bytes_are_refused_naming_the_file(saved: tuple, tmp_path: Path, victim: str,
                                                    capsys: pytest.CaptureFixture) -> None:
    path = copy(saved[0], tmp_path / "bad.ckpt")
    target = max(path.glob("*.distcp"), key=lambda f: f.stat().st_size) if victim == "data" else path / victim
    flip_bytes(target)
    pattern = f"corrupted: file '{target.name}' does not match the checksum"
    with pytest.raises(ckpt_lib.CheckpointError, match=pattern):
        fresh_load(path)
    with pytest.raises(ckpt_lib.CheckpointError, match=pattern):
        ckpt_lib.consolidated(path)
    for argv in (["info", str(path)], ["consolidate", str(path), str(tmp_path / "one.ckpt")]):
        assert main(argv) == 2
        assert target.name in capsys.readouterr().err
    assert not (tmp_path / "one.ckpt").exists()


def test_truncated_and_missing_files(saved: tuple, tmp_path: Path) -> None:
    path = copy(saved[0], tmp_path / "cut.ckpt")
    data = max(path.glob("*.distcp"), key=lambda f: f.stat().st_size)
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(ckpt_lib.CheckpointError, match=f"corrupted: file '{data.name}' has 100 bytes.*truncated"):
        fresh_load(path)
    data.unlink()
    with pytest.raises(ckpt_lib.CheckpointError, match=f"incomplete: file '{data.name}'"):
        ckpt_lib.consolidated(path)


def test_damaged_or_deleted_checksum_file(saved: tuple, tmp_path: Path) -> None:
    path = copy(saved[0], tmp_path / "c.ckpt")
    sums = path / ckpt_lib.CHECKSUMS_FILENAME
    doc = json.loads(sums.read_text())
    name = next(iter(doc["files"]))
    doc["files"][name]["crc32"] = "00000000"
    sums.write_text(json.dumps(doc))
    with pytest.raises(ckpt_lib.CheckpointError, match="checksums.json` does not match its own checksum"):
        ckpt_lib.consolidated(path)
    doc = json.loads((saved[0] / ckpt_lib.CHECKSUMS_FILENAME).read_text())  # a save that lost one rank's list
    del doc["files"][max(path.glob("*.distcp"), key=lambda f: f.stat().st_size).name]
    doc["self"] = ckpt_lib.checksums._self_check(doc["files"])
    sums.write_text(json.dumps(doc))
    with pytest.raises(ckpt_lib.CheckpointError, match="have no checksum"):
        fresh_load(path)
    sums.write_text("{not json")
    with pytest.raises(ckpt_lib.CheckpointError, match="checksums.json` is unreadable"):
        fresh_load(path)
    sums.unlink()  # deleting it must not turn verification off silently
    with pytest.raises(ckpt_lib.CheckpointError, match="checksums.json` is missing"):
        fresh_load(path)


def test_checkpoint_without_checksums_still_loads(saved: tuple, tmp_path: Path) -> None:
    """As written before checksums existed: no checksums.json, no entry in meta.pt."""
    path = copy(saved[0], tmp_path / "old.ckpt")
    (path / ckpt_lib.CHECKSUMS_FILENAME).unlink()
    meta = torch.load(path / ckpt_lib.META_FILENAME, weights_only=False)
    del meta["pipeline"]["checksums"]
    torch.save(meta, path / ckpt_lib.META_FILENAME)
    assert ckpt_lib.verify_checksums(path) is None
    loaded, _ = fresh_load(path)
    assert torch.equal(loaded.layers[0].weight, saved[1].layers[0].weight)
    assert ckpt_lib.consolidated(path)["global_step"] == 2
    # unverified, a garbled file still fails as a CheckpointError (agreed by all ranks), not DCP's exception
    data = max(path.glob("*.distcp"), key=lambda f: f.stat().st_size)
    data.write_bytes(bytes(data.stat().st_size))
    with pytest.raises(ckpt_lib.CheckpointError, match="reading its tensors failed.*corrupted"):
        fresh_load(path)


def test_describe_is_a_pure_query(saved: tuple, tmp_path: Path) -> None:
    target = tmp_path / "last.ckpt"
    old = copy(saved[0], ckpt_lib.aside_path(tmp_path / "last.ckpt", "old", "abcd1234"))  # a save died between its two renames
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ckpt_lib.CheckpointError, match="does not exist.*left the previous checkpoint at .*old-[0-9a-f]*-abcd1234"):
        ckpt_lib.describe(target)
    with pytest.raises(ckpt_lib.CheckpointError, match="does not exist"):
        ckpt_lib.consolidated(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    copy(saved[0], target)
    assert ckpt_lib.describe(target) == "sharded" and old.is_dir()  # the stray copy is left alone too
    shutil.rmtree(target)
    assert ckpt_lib.recover(target) == target and target.is_dir() and not old.exists()  # explicit


def test_a_full_disk_is_named_first_with_the_size_needed(tmp_path: Path) -> None:
    """DCP wraps each rank's write error in a CheckpointException (a BaseException) whose text starts with its own
    name; the save says "no space left" first (issue 23)."""
    import errno

    from torch.distributed.checkpoint import CheckpointException

    from lightning_pipe.checkpoint import files

    full = CheckpointException("save failed", {1: (OSError(errno.ENOSPC, "No space left on device"), None)})
    error = files.no_space_error(full, tmp_path / "epoch=0-step=4.ckpt", 3 * 2**20)
    assert error is not None and str(error).startswith(
        f"No space left on {str(tmp_path)!r}: saving 'epoch=0-step=4.ckpt' needed about 3.0 MB (")
    assert "MB free there now" in str(error) and "partial save was removed" in str(error)
    try:
        raise RuntimeError("write failed") from OSError(errno.ENOSPC, "No space left on device")
    except RuntimeError as chained:
        assert files.no_space_error(chained, tmp_path / "x", 10) is not None
    assert files.no_space_error(CheckpointException("x", {0: (ValueError("bad"), None)}), tmp_path / "x", 1) is None
    assert files.state_bytes({"a": torch.zeros(4), "b": 3, "c": torch.zeros(2, dtype=torch.float64)}) == 32


ZIP_WRITER_ERROR = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"


def test_a_full_disk_behind_torchs_zip_writer_is_found_by_the_space_left(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.save's zip writer reports a refused write as a RuntimeError without the errno: the writing rank checks
    the space left, before DCP hands its failure to the others (where only the message would arrive)."""
    from torch.distributed.checkpoint import CheckpointException

    from lightning_pipe.checkpoint import files

    real_save = torch.save

    def failing_save(obj: object, f: object, *args: object, **kwargs: object) -> None:
        if isinstance(obj, torch.Tensor):  # DCP's write of a tensor item
            raise RuntimeError(ZIP_WRITER_ERROR)
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", failing_save)
    space = {"free": 10**12}
    monkeypatch.setattr(files.shutil, "disk_usage", lambda _: SimpleNamespace(free=space["free"]))
    state = {"w": torch.zeros(1000)}
    with pytest.raises(CheckpointException) as plenty:  # space left: another failure, said as it was
        files.write_shards(state, tmp_path / "a", no_dist=True)
    assert files.no_space_error(plenty.value, tmp_path / "a.ckpt", 4000) is None
    space["free"] = 100
    with pytest.raises(CheckpointException) as full:
        files.write_shards(state, tmp_path / "b", no_dist=True)
    error = files.no_space_error(full.value, tmp_path / "b.ckpt", 4000)
    assert error is not None and str(error).startswith(f"No space left on {str(tmp_path)!r}: saving 'b.ckpt'")
    (failure, _), = full.value.failures.values()
    assert isinstance(failure, OSError) and "inline_container" in str(failure)  # (what travels to the other ranks)


def test_a_really_full_disk_is_named_on_every_write(small_tmpfs: Callable[[str], Path]) -> None:
    from lightning_pipe.checkpoint import files

    small_disk = small_tmpfs("64k")
    big = torch.zeros(40_000)  # 160 kB: more than the disk holds
    with pytest.raises(BaseException) as shards:  # DCP's tensor files, written through torch's zip writer
        files.write_shards({"w": big}, small_disk / "partial", no_dist=True)
    error = files.no_space_error(shards.value, small_disk / "x.ckpt", 160_000)
    assert error is not None and str(error).startswith(f"No space left on {str(small_disk)!r}")
    files.remove(small_disk / "partial")
    with pytest.raises(OSError) as single:  # one file (consolidate), torch.save to a path
        files.save_file_atomic({"state_dict": {"w": big}}, small_disk / "one.ckpt")
    assert single.value.errno == errno.ENOSPC and list(small_disk.iterdir()) == []  # its partial file removed
    tmp = small_disk / "partial"
    tmp.mkdir()
    with pytest.raises(ckpt_lib.CheckpointError, match=f"^No space left on {re.escape(repr(str(small_disk)))}"):
        # rank 0's end of a sharded save: meta.pt
        files.seal_and_commit(tmp, small_disk / "y.ckpt", "t", {"pipeline": {}, "big": big}, {}, 160_000)
    assert list(small_disk.iterdir()) == []


def test_a_model_mismatch_names_shapes_and_names_together() -> None:
    """A checkpoint of another model: one message with the shapes that differ *and* the names either side lacks
    (a shape alone read as if one tensor were wrong)."""
    from lightning_pipe.checkpoint.format import name_mismatch_message

    message = name_mismatch_message("ck", ["layers.1.weight"], ["layers.2.weight"],
                                    ["layers.0.weight: checkpoint [16, 8] vs model [20, 16]"])
    assert "Shapes differ for: layers.0.weight: checkpoint [16, 8] vs model [20, 16]." in message
    assert "Missing from the checkpoint: layers.1.weight." in message
    assert "Unexpected in the checkpoint (no such parameter/buffer in the model): layers.2.weight." in message
    assert "strict_loading" not in message  # no loading option skips a shape
    assert "strict_loading" in name_mismatch_message("ck", ["a"], [])


def test_staging_names_hold_no_checkpoint_version_for_lightning_to_read(tmp_path: Path) -> None:
    """Lightning's SLURM resume reads a version number from every name in the directory that holds ``ckpt_``: a save
    of ``hpc_ckpt_3.ckpt`` killed half-way must leave nothing that reads as ``hpc_ckpt_<digits>``."""
    target = tmp_path / "hpc_ckpt_3.ckpt"
    for kind in ("partial", "old"):
        aside = ckpt_lib.aside_path(target, kind, "1a2b3c4d")
        assert aside.parent == tmp_path and aside.name.startswith(f".{kind}-") and "ckpt_" not in aside.name
    assert ckpt_lib.aside_path(target, "old", "t") != ckpt_lib.aside_path(tmp_path / "hpc_ckpt_4.ckpt", "old", "t")
