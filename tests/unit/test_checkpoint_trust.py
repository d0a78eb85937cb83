"""A checkpoint is data: every load path refuses a crafted checkpoint without running anything from it.

Each crafted checkpoint holds an object whose unpickling creates a marker directory (a stand-in for any command);
every test asserts that the marker is absent after the refusal, that the error names the file, the object and the
opt-in, and that the opt-in (``weights_only=False`` / ``--trust``) is what unpickles it. The strategy's load runs
here with a one-rank ``RankGroup`` (tests/distributed/test_checkpoint.py runs it on two ranks under Trainer.fit).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_pipe import checkpoint as ckpt_lib
from lightning_pipe._compat.lightning import requested_weights_only
from lightning_pipe.checkpoint import files, reading
from lightning_pipe.checkpoint.__main__ import main
from lightning_pipe.checkpoint.checksums import checksums_of, read_checksums, write_checksums
from lightning_pipe.checkpoint.format import saved_layout
from lightning_pipe.checkpoint.trust import trusted
from lightning_pipe.config import PipelineConfigError
from lightning_pipe.planner.plan import load_plan
from tests.models import ToyRegressor, loader, regression_data
from tests.unit.test_checkpoint_integrity import checkpointer, trained

OPT_IN = "weights_only=False"


class Payload:
    """Unpickling it creates ``marker``: what a malicious checkpoint's object would do with a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return os.mkdir, (self.marker,)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, opt = trained()
    ckpt = checkpointer(model, opt)
    path = tmp_path_factory.mktemp("trust") / "epoch=0-step=2.ckpt"
    ckpt.save({"state_dict": model.state_dict(), "optimizer_states": [ckpt.optimizer_state(opt)], "epoch": 0,
               "global_step": 2}, path)
    return path


def copied(saved: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / "copy.ckpt"))


def rewrite_checksums(path: Path) -> None:
    """What anyone who can replace a file can do: the checksums then match the replaced file."""
    recorded = read_checksums(path)
    assert recorded is not None
    write_checksums(path, checksums_of(path, recorded))


def strategy_load(path: Path, weights_only: bool | None = None) -> dict[str, Any]:
    model, opt = trained()
    return checkpointer(model, opt).load(path, weights_only)


Loader = Callable[[Path, "bool | None"], Any]
SHARDED_LOADERS: dict[str, Loader] = {
    "strategy": strategy_load,
    "consolidated": lambda p, w: ckpt_lib.consolidated(p, w),
    "as_file": lambda p, w: ckpt_lib.as_file(p, w),
    "consolidate": lambda p, w: ckpt_lib.consolidate(p, p.parent / "one.ckpt", w),
}


def refused_without_running(load: Callable[[], Any], marker: Path, *phrases: str) -> str:
    with pytest.raises(ckpt_lib.CheckpointError) as caught:
        load()
    message = str(caught.value)
    assert not marker.exists(), "the checkpoint's object ran"
    for phrase in ("Refused to load", OPT_IN, "--trust", *phrases):
        assert phrase in message, (phrase, message)
    return message


def runs_when_trusted(load: Callable[[], Any], marker: Path) -> None:
    try:
        load()
    except BaseException:  # what happens after unpickling does not matter here (DCP raises BaseExceptions)
        pass
    assert marker.exists(), "weights_only=False is the opt-in that unpickles it"


# ------------------------------------------------------------------------------------------------ single files
@pytest.mark.parametrize("loader", ["load_file", "consolidated", "shard", "strategy"])
def test_a_single_file_is_read_as_data(saved: Path, tmp_path: Path, loader: str) -> None:
    marker = tmp_path / "ran"
    evil = tmp_path / "evil.ckpt"
    ckpt = ckpt_lib.consolidated(saved)
    ckpt["callbacks"] = {"Evil": Payload(marker)}
    torch.save(ckpt, evil)
    load: Loader = {"load_file": lambda p, w: ckpt_lib.load_file(p, w),
                    "shard": lambda p, w: ckpt_lib.shard(p, tmp_path / "sharded.ckpt", w),
                    **SHARDED_LOADERS}[loader]
    refused_without_running(lambda: load(evil, None), marker, repr(str(evil)), "`posix.mkdir`",
                            "add_safe_globals")
    refused_without_running(lambda: load(evil, True), marker, "`posix.mkdir`")
    runs_when_trusted(lambda: load(evil, False), marker)


# ------------------------------------------------------------------------------------------------ sharded directories
@pytest.mark.parametrize("loader", sorted(SHARDED_LOADERS))
def test_a_replaced_meta_file_is_read_as_data(saved: Path, tmp_path: Path, loader: str) -> None:
    marker = tmp_path / "ran"
    path = copied(saved, tmp_path)
    meta = torch.load(path / ckpt_lib.META_FILENAME, weights_only=True)
    meta["loops"] = Payload(marker)
    torch.save(meta, path / ckpt_lib.META_FILENAME)
    rewrite_checksums(path)
    load = SHARDED_LOADERS[loader]
    refused_without_running(lambda: load(path, None), marker, "`meta.pt`", "`posix.mkdir`")
    runs_when_trusted(lambda: load(path, False), marker)


def crafted_metadata(path: Path, change: Callable[[Any], None]) -> None:
    with open(path / ckpt_lib.DCP_METADATA, "rb") as f:
        md = pickle.load(f)  # our own file, just written: safe to unpickle here
    change(md)
    with open(path / ckpt_lib.DCP_METADATA, "wb") as f:
        pickle.dump(md, f)
    rewrite_checksums(path)


@pytest.mark.parametrize("loader", ["read_sharded_metadata", *sorted(SHARDED_LOADERS)])
def test_a_replaced_dcp_metadata_is_read_as_data(saved: Path, tmp_path: Path, loader: str) -> None:
    """torch's own reader unpickles ``.metadata`` with plain ``pickle.load``: ours admits DCP's classes only."""
    marker = tmp_path / "ran"
    path = copied(saved, tmp_path)
    crafted_metadata(path, lambda md: setattr(md, "planner_data", Payload(marker)))
    load = {"read_sharded_metadata": lambda p, w: reading.read_sharded_metadata(p, w), **SHARDED_LOADERS}[loader]
    refused_without_running(lambda: load(path, None), marker, "`.metadata`", "`posix.mkdir`",
                            "metadata classes")
    runs_when_trusted(lambda: load(path, False), marker)


def test_a_dcp_object_entry_is_read_as_data(tmp_path: Path) -> None:
    """DCP saves a non-tensor value with torch.save and its planner reads it back with ``weights_only=False``."""
    marker = tmp_path / "ran"
    path, token = tmp_path / "objects.ckpt", "t0"
    tmp = ckpt_lib.partial_path(path, token)
    shards = ckpt_lib.write_shards({"state_dict.w": torch.ones(3), "state_dict.extra": Payload(marker)}, tmp,
                                   no_dist=True)
    files.seal(tmp, {"pipeline": {"format": ckpt_lib.FORMAT, "optimizers": None}}, shards)
    ckpt_lib.commit(tmp, path, token)
    md, _ = reading.read_sharded_metadata(path)
    refused_without_running(lambda: reading.load_flat(path, {"state_dict.extra": None}, md), marker,
                            "the entry 'state_dict.extra'", "__0_0.distcp", "`posix.mkdir`")
    assert torch.equal(reading.load_flat(path, {"state_dict.w": None}, md)["state_dict.w"], torch.ones(3))
    refused_without_running(lambda: ckpt_lib.consolidated(path), marker, "`posix.mkdir`")
    runs_when_trusted(lambda: ckpt_lib.consolidated(path, weights_only=False), marker)


@pytest.mark.parametrize("where", ["../outside.distcp", "/tmp/outside.distcp", "link"])
def test_data_files_lie_inside_the_checkpoint_directory(saved: Path, tmp_path: Path, where: str) -> None:
    """A storage record naming a file elsewhere is refused, trusted or not (a load would read any file)."""
    path = copied(saved, tmp_path)
    data = max(path.glob("*.distcp"), key=lambda f: f.stat().st_size)
    outside = tmp_path / "outside.distcp"
    shutil.copy(data, outside)
    if where == "link":
        data.unlink()
        data.symlink_to(outside)
        bad = data.name
    else:
        bad = where

        def point_away(md: Any) -> None:
            md.storage_data = {k: dataclasses.replace(v, relative_path=bad) if v.relative_path == data.name else v
                               for k, v in md.storage_data.items()}
        crafted_metadata(path, point_away)
    for weights_only in (None, False):
        with pytest.raises(ckpt_lib.CheckpointError, match=f"points a load at '{bad}', which is not a file inside"):
            reading.read_sharded_metadata(path, weights_only)
        with pytest.raises(ckpt_lib.CheckpointError, match="not a file inside the checkpoint directory"):
            strategy_load(path, weights_only)


def test_metadata_of_other_types_is_refused_plainly(saved: Path, tmp_path: Path) -> None:
    """Built only from admitted classes, yet not what a save writes: a clear error, not a TypeError later."""
    path = copied(saved, tmp_path)
    crafted_metadata(path, lambda md: setattr(md, "storage_data", {
        k: dataclasses.replace(v, relative_path=["a", "list"]) for k, v in md.storage_data.items()}))
    with pytest.raises(ckpt_lib.CheckpointError, match="is not the metadata of a torch.distributed.checkpoint save"):
        strategy_load(path)


def test_checksums_name_files_inside_the_directory(saved: Path, tmp_path: Path) -> None:
    path = copied(saved, tmp_path)
    recorded = read_checksums(path)
    assert recorded is not None
    write_checksums(path, {**recorded, "../../etc/hostname": {"size": 1, "crc32": "00000000"}})
    with pytest.raises(ckpt_lib.CheckpointError, match="`checksums.json` points a load at '../../etc/hostname'"):
        ckpt_lib.verify_checksums(path)


# ------------------------------------------------------------------------------------------------ what we write
def test_an_omegaconf_config_and_paths_in_hyper_parameters_need_no_trust(tmp_path: Path) -> None:
    """Hydra's config in the hyper-parameters (and Lightning's ``hparams_type``): saved as plain data, given back
    typed by every reader of ours, plain to torch.load's default."""
    model, opt = trained()
    ckpt = checkpointer(model, opt)
    cfg = OmegaConf.create({"model": {"lr": 0.1, "betas": [0.9, 0.95]}, "lr": "${model.lr}", "run": "???"})
    path = tmp_path / "hydra.ckpt"
    ckpt.save({"state_dict": model.state_dict(), "optimizer_states": [ckpt.optimizer_state(opt)], "epoch": 0,
               "global_step": 2, "hyper_parameters": cfg, "hparams_type": DictConfig,
               "datamodule_hyper_parameters": {"root": tmp_path / "data", "sizes": (OmegaConf.create([1, 2]),)}},
              path)
    assert torch.serialization.get_unsafe_globals_in_checkpoint(str(path / ckpt_lib.META_FILENAME)) == []

    def typed(loaded: dict[str, Any]) -> None:
        hp = loaded["hyper_parameters"]
        assert isinstance(hp, DictConfig) and hp.model.betas == [0.9, 0.95] and hp.lr == 0.1
        assert OmegaConf.is_missing(hp, "run") and loaded["hparams_type"] is DictConfig
        data = loaded["datamodule_hyper_parameters"]
        assert data["root"] == tmp_path / "data" and isinstance(data["sizes"][0], ListConfig)

    typed(strategy_load(path))
    typed(ckpt_lib.consolidated(path))
    single = ckpt_lib.consolidate(path, tmp_path / "one.ckpt")
    typed(ckpt_lib.load_file(single))
    plain = torch.load(single, weights_only=True)  # what Lightning's load_from_checkpoint reads
    assert plain["hyper_parameters"]["model"] == {"lr": 0.1, "betas": [0.9, 0.95]}
    assert plain["hparams_type"] == "omegaconf.DictConfig" and plain["datamodule_hyper_parameters"]["root"] == str(
        tmp_path / "data")
    assert torch.load(ckpt_lib.as_file(path), weights_only=True)["hyper_parameters"]["lr"] == 0.1
    typed(ckpt_lib.consolidated(ckpt_lib.shard(single, tmp_path / "again.ckpt")))  # and back: still plain on disk


def test_a_config_that_still_interpolates_is_typed_only_when_trusted(tmp_path: Path) -> None:
    """An interpolation left in a config resolves on access (through any resolver the reader registered)."""
    ckpt = ckpt_lib.consolidated(ckpt_lib.consolidate(saved_for(tmp_path), tmp_path / "one.ckpt"))
    ckpt["hyper_parameters"] = OmegaConf.create({"home": "${oc.env:NOT_SET_ANYWHERE}"})
    ckpt_lib.save_file_atomic(ckpt, tmp_path / "interp.ckpt")
    assert ckpt_lib.load_file(tmp_path / "interp.ckpt")["hyper_parameters"] == {"home": "${oc.env:NOT_SET_ANYWHERE}"}
    assert isinstance(ckpt_lib.load_file(tmp_path / "interp.ckpt", weights_only=False)["hyper_parameters"],
                      DictConfig)


def saved_for(tmp_path: Path) -> Path:
    model, opt = trained()
    ckpt = checkpointer(model, opt)
    path = tmp_path / "small.ckpt"
    ckpt.save({"state_dict": model.state_dict(), "optimizer_states": [ckpt.optimizer_state(opt)]}, path)
    return path


class Tally:
    """An object of the user's own in a callback's state."""

    def __init__(self, count: int) -> None:
        self.count = count


def test_a_save_that_will_need_trust_says_so(tmp_path: Path) -> None:
    model, opt = trained()
    ckpt = checkpointer(model, opt)
    state = {"state_dict": model.state_dict(), "optimizer_states": [ckpt.optimizer_state(opt)],
             "callbacks": {"Counter": {"tally": Tally(3)}}}
    with pytest.warns(UserWarning, match=r"holds .*test_checkpoint_trust.Tally, which a load as data refuses"):
        ckpt.save(dict(state), tmp_path / "own.ckpt")
    with pytest.raises(ckpt_lib.CheckpointError, match="test_checkpoint_trust.Tally"):
        strategy_load(tmp_path / "own.ckpt")
    with torch.serialization.safe_globals([Tally]):  # admitted without trusting the whole file
        assert strategy_load(tmp_path / "own.ckpt")["callbacks"]["Counter"]["tally"].count == 3
    assert strategy_load(tmp_path / "own.ckpt", weights_only=False)["callbacks"]["Counter"]["tally"].count == 3


def test_a_meta_file_written_by_an_earlier_version_asks_for_trust(saved: Path, tmp_path: Path) -> None:
    """Earlier versions pickled an OmegaConf config into ``meta.pt``: refused by default, read with trust."""
    path = copied(saved, tmp_path)
    meta = torch.load(path / ckpt_lib.META_FILENAME, weights_only=True)
    meta["hyper_parameters"] = OmegaConf.create({"lr": 0.1})
    torch.save(meta, path / ckpt_lib.META_FILENAME)
    rewrite_checksums(path)
    with pytest.raises(ckpt_lib.CheckpointError) as caught:
        strategy_load(path)
    for phrase in ("`omegaconf.dictconfig.DictConfig`", "earlier lightning_pipe", OPT_IN, "--trust"):
        assert phrase in str(caught.value), (phrase, str(caught.value))
    assert strategy_load(path, weights_only=False)["hyper_parameters"] == {"lr": 0.1}


# ------------------------------------------------------------------------------------------------ the rule, the CLI
def test_trust_follows_torch_loads_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (trusted(None), trusted(True), trusted(False)) == (False, False, True)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # torch: only when the caller did not say
    assert (trusted(None), trusted(True), trusted(False)) == (True, False, True)
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    monkeypatch.delenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    assert (trusted(None), trusted(True), trusted(False)) == (False, False, False)


@pytest.mark.parametrize("weights_only", [None, True, False])
def test_the_trainers_weights_only_is_found_where_lightning_drops_it(weights_only: bool | None) -> None:
    """Lightning 2.6 does not hand ``Trainer.fit(weights_only=...)`` to a strategy that restores after setup; the
    strategy reads it from the running call (the one-device fit here runs the same ``Trainer._run``)."""
    seen: list[bool | None] = []

    class Probe(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            seen.append(requested_weights_only(trainer))

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, callbacks=[Probe()])
    model = ToyRegressor(n_layers=3)
    trainer.fit(model, loader(regression_data(8), 8), weights_only=weights_only)
    assert seen == [weights_only] and requested_weights_only(trainer) is None  # (no call running now)


@pytest.mark.parametrize("command", ["info", "consolidate", "shard"])
def test_the_command_line_reads_as_data_unless_trust_is_given(saved: Path, tmp_path: Path, command: str,
                                                               capsys: pytest.CaptureFixture) -> None:
    marker = tmp_path / "ran"
    evil = tmp_path / "evil.ckpt"
    if command == "shard":
        torch.save({**ckpt_lib.consolidated(saved), "callbacks": {"Evil": Payload(marker)}}, evil)
    else:
        evil = copied(saved, tmp_path)
        meta = torch.load(evil / ckpt_lib.META_FILENAME, weights_only=True)
        meta["loops"] = Payload(marker)
        torch.save(meta, evil / ckpt_lib.META_FILENAME)
        rewrite_checksums(evil)
    argv = [command, str(evil)] + ([] if command == "info" else [str(tmp_path / "out.ckpt")])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert not marker.exists() and "Refused to load" in err and "--trust" in err and "`posix.mkdir`" in err
    assert main([command, "--trust", *argv[1:]]) == 0 and marker.exists()


def test_the_help_says_what_trust_means(capsys: pytest.CaptureFixture) -> None:
    for argv in (["--help"], ["info", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        out = " ".join(capsys.readouterr().out.split())
        assert "--trust" in out and "Checkpoints from others" in out
    assert "run code from the file" in out and "add_safe_globals" in out


def test_the_saved_layout_reaches_the_rebalancer_only_as_layer_lists() -> None:
    """A resumed rebalancing run goes back to the split a checkpoint names: data from the file, checked first."""
    good = {"schedule": "1f1b", "pipeline_size": 2, "stages": [[0, 1], [2, 3]]}
    assert saved_layout({"layout": good}) == good
    assert saved_layout({"layout": {**good, "stages": "0-1,2-3"}}) == {"schedule": "1f1b", "pipeline_size": 2}
    assert saved_layout({"layout": {**good, "stages": [[0, 1.5]]}}) == {"schedule": "1f1b", "pipeline_size": 2}
    assert saved_layout({"layout": ["not", "a", "dict"]}) is None and saved_layout({}) is None


def test_saved_plans_are_json_never_pickle(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    plan = tmp_path / "plan.json"
    plan.write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(PipelineConfigError, match="A plan is a JSON file"):
        load_plan(plan)
    assert not marker.exists()
    plan.write_text(json.dumps({"format": "not a plan"}))
    with pytest.raises(PipelineConfigError, match="format"):
        load_plan(plan)
