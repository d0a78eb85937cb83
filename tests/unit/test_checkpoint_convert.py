"""Single-process checks of lightning_pipe.checkpoint: shard/consolidate round trip, CLI, errors, atomic commit."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as L
import pytest
import torch

from lightning_pipe import checkpoint as ckpt_lib
from lightning_pipe.checkpoint.__main__ import main
from tests.models import ToyRegressor, loader, regression_data


@pytest.fixture(scope="module")
def plain_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = ToyRegressor(optimizer="adamw", tied=True)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0)
    trainer.fit(model, loader(regression_data(32), 8))
    path = tmp_path_factory.mktemp("plain") / "plain.ckpt"
    trainer.save_checkpoint(path)
    return path


def with_names(plain: Path, out: Path) -> Path:
    ckpt = torch.load(plain, weights_only=False)
    names = [n for n, _ in ToyRegressor(tied=True).named_parameters()]  # the optimizer's (model) order
    ckpt[ckpt_lib.NAMES_KEY] = [[names]]
    torch.save(ckpt, out)
    return out


def test_shard_then_consolidate_round_trip(plain_ckpt: Path, tmp_path: Path) -> None:
    src = with_names(plain_ckpt, tmp_path / "named.ckpt")
    sharded = ckpt_lib.shard(src, tmp_path / "sharded.ckpt")
    assert ckpt_lib.describe(sharded) == "sharded"
    back = ckpt_lib.consolidated(sharded)
    orig = torch.load(plain_ckpt, weights_only=False)
    assert sorted(back["state_dict"]) == sorted(orig["state_dict"])
    for k, v in orig["state_dict"].items():
        assert torch.equal(back["state_dict"][k], v), k
    a, b = orig["optimizer_states"][0], back["optimizer_states"][0]
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        for key, v in a["state"][i].items():
            assert torch.equal(torch.as_tensor(b["state"][i][key]), torch.as_tensor(v)), (i, key)
    assert back["global_step"] == orig["global_step"] and back["loops"] == orig["loops"]
    # the plain module loads the result on one device
    model = ToyRegressor.load_from_checkpoint(ckpt_lib.as_file(sharded), optimizer="adamw", tied=True)
    assert model.layers[0].weight is model.layers[-1].weight


def test_cli(plain_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = with_names(plain_ckpt, tmp_path / "named.ckpt")
    assert main(["shard", str(src), str(tmp_path / "d.ckpt")]) == 0
    assert main(["consolidate", str(tmp_path / "d.ckpt"), str(tmp_path / "one.ckpt")]) == 0
    assert main(["info", str(tmp_path / "d.ckpt")]) == 0
    assert "sharded checkpoint" in capsys.readouterr().out
    assert main(["info", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_shard_positional_optimizer_state_explains(plain_ckpt: Path, tmp_path: Path) -> None:
    with pytest.raises(ckpt_lib.CheckpointError, match="trainer.fit\\(model, ckpt_path=...\\)"):
        ckpt_lib.shard(plain_ckpt, tmp_path / "x.ckpt")
    assert not (tmp_path / "x.ckpt").exists()


def test_bad_paths(plain_ckpt: Path, tmp_path: Path) -> None:
    with pytest.raises(ckpt_lib.CheckpointError, match="does not exist"):
        ckpt_lib.describe(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ckpt_lib.CheckpointError, match="not a lightning_pipe checkpoint"):
        ckpt_lib.describe(tmp_path / "empty")
    (tmp_path / "t.txt").write_text("hello")
    with pytest.raises(ckpt_lib.CheckpointError, match="not a checkpoint"):
        ckpt_lib.load_file(tmp_path / "t.txt")
    torch.save({"a": 1}, tmp_path / "dict.pt")
    with pytest.raises(ckpt_lib.CheckpointError, match="no 'state_dict'"):
        ckpt_lib.load_file(tmp_path / "dict.pt")
    sharded = ckpt_lib.shard(with_names(plain_ckpt, tmp_path / "n.ckpt"), tmp_path / "s.ckpt")
    data = next(sharded.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:10])
    with pytest.raises(ckpt_lib.CheckpointError, match="truncated"):
        ckpt_lib.read_sharded_metadata(sharded)
    (sharded / ckpt_lib.META_FILENAME).unlink()
    with pytest.raises(ckpt_lib.CheckpointError, match="incomplete.*meta.pt"):
        ckpt_lib.describe(sharded)


def test_commit_keeps_old_until_new_is_in_place(tmp_path: Path) -> None:
    target = tmp_path / "last.ckpt"
    target.mkdir()
    (target / ckpt_lib.META_FILENAME).write_text("old")
    new = ckpt_lib.partial_path(target, "t1")
    new.mkdir()
    (new / ckpt_lib.META_FILENAME).write_text("new")
    ckpt_lib.aside_path(tmp_path / "last.ckpt", "partial", "dead").mkdir()  # left by a crashed save
    ckpt_lib.commit(new, target, "t1")
    assert (target / ckpt_lib.META_FILENAME).read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    # a crash between the two renames of a swap: the old copy is found again
    old = ckpt_lib.aside_path(tmp_path / "last.ckpt", "old", "t2")
    target.rename(old)
    assert ckpt_lib.recover(target) == target and (target / ckpt_lib.META_FILENAME).read_text() == "new"
