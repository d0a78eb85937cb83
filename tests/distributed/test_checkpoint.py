"""Sharded checkpoints on CPU ranks: exact resume, reshard on load, single device, consolidate, crash safety, errors.

One 4-rank launch writes checkpoints with several layouts (and resumes some in other layouts); the 2-rank launches
reload them in yet another layout, from single files, after a crash mid-save, and from bad input.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import DictConfig

from lightning_pipe import checkpoint as ckpt_lib
from tests.distributed.launcher import RanksFailed, launch, launch_runs
from tests.distributed.parity import assert_same, merge_replica
from tests.distributed.scenarios import CheckpointCase
from tests.distributed.scenarios.checkpoint import optimizer_by_name, run_reference
from tests.models import ToyRegressor
from tests.unit.test_checkpoint_trust import Payload, crafted_metadata, rewrite_checksums

pytestmark = [pytest.mark.distributed]

EXACT = 1e-6  # same layout: the resumed run must be the uninterrupted one
RESHARD = 1e-5  # another layout / one device: other reduction orders
STEP4 = "epoch=0-step=4.ckpt"


def consolidated_state(path: Path, tied: bool) -> tuple[dict, dict]:
    """Parameters (plain module's named_parameters) and name-keyed optimizer state, through consolidate."""
    model = ToyRegressor(optimizer="adamw", tied=tied)
    ckpt = ckpt_lib.consolidated(path)
    model.load_state_dict(ckpt["state_dict"])
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    opt.load_state_dict(ckpt["optimizer_states"][0])
    return ({n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)},
            optimizer_by_name(model, opt))


# ------------------------------------------------------------------------------------------------ the 4-rank run
# name -> layout; trained (ckpt_train) into root/name, then resumed from its step-4 checkpoint
TRAIN_CASES = {
    "pp4_gpipe": CheckpointCase(schedule="gpipe"),
    "pp4_1f1b_tied": CheckpointCase(schedule="1f1b", tied=True),
    "dp2xpp2_1f1b": CheckpointCase(schedule="1f1b", dp=2),
    "pp4_interleaved": CheckpointCase(schedule="interleaved_1f1b", stages_per_rank=2),
}
# name -> (target layout, source) — resumed (ckpt_resume) in another layout in the same launch
RESHARD_CASES = {
    "pp4_gpipe->dp2xpp2_1f1b": (CheckpointCase(schedule="1f1b", dp=2), "pp4_gpipe"),
    "pp4_1f1b_tied->dp2xpp2_gpipe": (CheckpointCase(schedule="gpipe", dp=2, tied=True), "pp4_1f1b_tied"),
    "dp2xpp2_1f1b->pp4_interleaved": (CheckpointCase(schedule="interleaved_1f1b", stages_per_rank=2),
                                      "dp2xpp2_1f1b"),
}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("ckpt4")
    runs: list[tuple[str, CheckpointCase]] = []
    names = []
    for name, case in TRAIN_CASES.items():
        d = root / name
        runs.append(("ckpt_train", replace(case, dir=str(d), resume_from=str(d / STEP4))))
        names.append(name)
    # in the same processes, after the training runs wrote their checkpoints
    for name, (case, source) in RESHARD_CASES.items():
        runs.append(("ckpt_resume", replace(case, resume_from=str(root / source / STEP4))))
        names.append(name)
    results = launch_runs(4, runs, root / "out", timeout=500)
    return {"root": root, "results": results, "index": {n: i for i, n in enumerate(names)}}


@pytest.mark.compact  # make test-torch: on every supported torch
@pytest.mark.timeout(600)
def test_exact_resume_same_layout(four_ranks: dict[str, Any]) -> None:
    """Stopped after 4 of 8 steps and resumed == uninterrupted: params, logged losses (AdamW + StepLR)."""
    res = four_ranks["results"]
    for name in TRAIN_CASES:
        i = four_ranks["index"][name]
        for rank in res:
            full, resumed = rank[i]["full"], rank[i]["resumed"]
            assert resumed["global_step"] == 8
            assert_same(resumed["params"], full["params"], EXACT, f"{name} rank params")
            torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(full["losses"][4:]),
                                       atol=EXACT, rtol=0)
        # ModelCheckpoint wrote sharded directories and a valid "last" link
        d = four_ranks["root"] / name
        assert ckpt_lib.describe(d / STEP4) == "sharded"
        assert os.readlink(d / "last.ckpt") == "epoch=1-step=8.ckpt"
        assert ckpt_lib.describe(d / "last.ckpt") == "sharded"
        assert not list(d.glob(".*partial*")) and not list(d.glob(".*old*"))


@pytest.mark.timeout(600)
def test_checkpoint_content_and_plain_module(four_ranks: dict[str, Any]) -> None:
    """What a run starts from after loading == the checkpoint; the plain module loads it on one device."""
    res, root = four_ranks["results"], four_ranks["root"]
    for name, case in TRAIN_CASES.items():
        i = four_ranks["index"][name]
        params, optim = consolidated_state(root / name / STEP4, case.tied)
        assert_same(merge_replica(res, i, run="resumed", key="start_params"), params, 0, f"{name} loaded params")
        assert_same(merge_replica(res, i, run="resumed", key="start_optim"), optim, 0,
                    f"{name} loaded optimizer state")
        # the documented one-liner on one device
        plain = ToyRegressor.load_from_checkpoint(ckpt_lib.as_file(root / name / STEP4), optimizer="adamw",
                                                  tied=case.tied)
        assert_same({n: p.detach() for n, p in plain.named_parameters(remove_duplicate=False)}, params, 0,
                    f"{name} load_from_checkpoint")
        if case.tied:
            assert plain.layers[0].weight is plain.layers[-1].weight
    # data-parallel replicas do not write duplicates: dp2 x pp2 is the size of pp4
    size_pp4 = ckpt_lib.checkpoint_size(root / "pp4_gpipe" / STEP4)
    size_dp2 = ckpt_lib.checkpoint_size(root / "dp2xpp2_1f1b" / STEP4)
    assert size_dp2 < 1.15 * size_pp4, (size_dp2, size_pp4)


@pytest.mark.timeout(600)
def test_reshard_on_load_4_ranks(four_ranks: dict[str, Any], tmp_path: Path) -> None:
    """pp4 -> dp2 x pp2, another schedule, a virtual-stage schedule: same state loaded, same training as one device."""
    res, root = four_ranks["results"], four_ranks["root"]
    for name, (case, source) in RESHARD_CASES.items():
        i = four_ranks["index"][name]
        src = root / source / STEP4
        params, optim = consolidated_state(src, case.tied)
        for dp_rank in range(case.dp):
            assert_same(merge_replica(res, i, dp_rank, key="start_params"), params, 0, f"{name} loaded params")
            assert_same(merge_replica(res, i, dp_rank, key="start_optim"), optim, 0, f"{name} loaded optim")
        single = ckpt_lib.consolidate(src, tmp_path / f"{source}.ckpt")
        ref, _, _ = run_reference(case, single)
        got = merge_replica(res, i)
        assert_same(got, {k: v for k, v in ref["params"].items() if k in got}, RESHARD, f"{name} final params")
        if case.dp == 1:  # (with replicas each logs its own half-batch loss)
            torch.testing.assert_close(torch.tensor(res[0][i]["losses"]), torch.tensor(ref["losses"]),
                                       atol=RESHARD, rtol=0)


# ------------------------------------------------------------------------------------------------ 2-rank runs
TRUST = {  # crafted checkpoint -> what its refusal names besides the file
    "single_file": ["`posix.mkdir`", "weights_only=False", "--trust"],
    "meta": ["`meta.pt`", "`posix.mkdir`", "weights_only=False"],
    "dcp_metadata": ["`.metadata`", "`posix.mkdir`", "weights_only=False"],
    "outside": ["`.metadata` points a load at '../outside.distcp'"],
    "earlier": ["`omegaconf.dictconfig.DictConfig`", "earlier lightning_pipe", "weights_only=False"],
}


def crafted_checkpoints(source: Path, tmp_path: Path) -> tuple[dict[str, Path], Path]:
    """Copies of a real checkpoint, each changed as someone who controls the files could (checksums rewritten),
    and the marker their objects would create."""
    marker = tmp_path / "ran"
    out = {name: Path(shutil.copytree(source, tmp_path / f"{name}.ckpt")) for name in TRUST if name != "single_file"}
    out["single_file"] = tmp_path / "single_file.ckpt"
    torch.save({**ckpt_lib.consolidated(source), "callbacks": {"Evil": Payload(marker)}}, out["single_file"])
    for name, extra in (("meta", {"loops": Payload(marker)}), ("earlier", {"hyper_parameters": DictConfig({})})):
        meta = torch.load(out[name] / ckpt_lib.META_FILENAME, weights_only=True)
        torch.save({**meta, **extra}, out[name] / ckpt_lib.META_FILENAME)
    crafted_metadata(out["dcp_metadata"], lambda md: setattr(md, "planner_data", Payload(marker)))
    data = max(out["outside"].glob("*.distcp"), key=lambda f: f.stat().st_size).name
    crafted_metadata(out["outside"], lambda md: setattr(md, "storage_data", {
        k: replace(v, relative_path="../outside.distcp") if v.relative_path == data else v
        for k, v in md.storage_data.items()}))
    for name in ("meta", "earlier"):
        rewrite_checksums(out[name])
    return {name: out[name] for name in TRUST}, marker


@pytest.mark.timeout(600)
def test_crash_mid_save_reshard_to_pp2_single_files_and_bad_input(four_ranks: dict[str, Any], tmp_path: Path) -> None:
    root = four_ranks["root"]
    # 1) a rank dies in the middle of the second save (step 4): the step-2 checkpoint and "last" stay valid
    crash_dir = tmp_path / "crash"
    with pytest.raises(RanksFailed, match="exit codes"):
        launch("ckpt_crash", 2, [CheckpointCase(dir=str(crash_dir), crash_rank=1, schedule="1f1b")],
               tmp_path / "out_crash", timeout=200)
    assert ckpt_lib.describe(crash_dir / "epoch=0-step=2.ckpt") == "sharded"
    assert not (crash_dir / STEP4).exists()
    assert os.readlink(crash_dir / "last.ckpt") == "epoch=0-step=2.ckpt"
    assert not list(crash_dir.glob(ckpt_lib.partial_path(crash_dir / STEP4, "*").name)), "the surviving rank removes the failed save's files"
    assert ckpt_lib.consolidated(crash_dir / "last.ckpt")["global_step"] == 2

    # 2) single files: one consolidated from a pipeline checkpoint, one written by a plain single-device run
    consolidated_file = ckpt_lib.consolidate(root / "pp4_1f1b_tied" / STEP4, tmp_path / "tied_consolidated.ckpt")
    _, _, plain_trainer = run_reference(CheckpointCase(tied=True), steps=4)
    plain_file = tmp_path / "plain_single_device.ckpt"
    plain_trainer.save_checkpoint(plain_file)
    plain_continued, _, _ = run_reference(CheckpointCase(tied=True), plain_file)

    # 3) bad input
    corrupt = tmp_path / "corrupt.ckpt"
    shutil.copytree(root / "pp4_gpipe" / STEP4, corrupt)
    data_file = sorted(corrupt.glob("*.distcp"), key=lambda f: f.stat().st_size)[-1]
    data_file.write_bytes(data_file.read_bytes()[:100])
    incomplete = tmp_path / "incomplete.ckpt"
    shutil.copytree(root / "pp4_gpipe" / STEP4, incomplete)
    (incomplete / ".metadata").unlink()
    not_ckpt_dir = tmp_path / "some_dir"
    not_ckpt_dir.mkdir()
    text_file = tmp_path / "notes.txt"
    text_file.write_text("not a checkpoint")
    crafted, marker = crafted_checkpoints(root / "pp4_gpipe" / STEP4, tmp_path)

    cases = [
        CheckpointCase(schedule="1f1b", resume_from=str(root / "pp4_gpipe" / STEP4)),  # pp4 -> pp2
        CheckpointCase(schedule="gpipe", tied=True, resume_from=str(consolidated_file)),
        CheckpointCase(schedule="1f1b", tied=True, resume_from=str(plain_file)),
        CheckpointCase(schedule="gpipe", resume_from=str(crash_dir / "last.ckpt")),
        CheckpointCase(n_layers=6, resume_from=str(root / "pp4_gpipe" / STEP4), expect_error=True),
        CheckpointCase(resume_from=str(corrupt), expect_error=True),
        CheckpointCase(resume_from=str(incomplete), expect_error=True),
        CheckpointCase(resume_from=str(not_ckpt_dir), expect_error=True),
        CheckpointCase(resume_from=str(text_file), expect_error=True),
        CheckpointCase(resume_from=str(tmp_path / "nowhere.ckpt"), expect_error=True),
        # a checkpoint is data: each crafted one refused by every rank; the earlier format read when trusted
        *(CheckpointCase(resume_from=str(p), expect_error=True) for p in crafted.values()),
        CheckpointCase(schedule="gpipe", resume_from=str(crafted["earlier"]), weights_only=False),
    ]
    # 4) last, in the same processes: rank 1's disk is full in the middle of the second save (issue 23)
    full_dir = tmp_path / "full"
    full = CheckpointCase(dir=str(full_dir), crash_rank=1, schedule="1f1b", expect_error=True)
    res = launch_runs(2, [*(("ckpt_resume", case) for case in cases), ("ckpt_full", full)], tmp_path / "out2",
                      timeout=400)
    four = four_ranks["results"]
    # pp4 -> pp2 continues exactly like the uninterrupted pp4 run (same data, same optimizer state)
    src = merge_replica(four, four_ranks["index"]["pp4_gpipe"], run="full")
    assert_same(merge_replica(res, 0), src, RESHARD, "pp4->pp2 final params")
    full_losses = four[0][four_ranks["index"]["pp4_gpipe"]]["full"]["losses"][4:]
    torch.testing.assert_close(torch.tensor(res[0][0]["losses"]), torch.tensor(full_losses), atol=RESHARD, rtol=0)
    # a consolidated single file starts a pipeline run: same as the tied pp4 run it came from
    src = merge_replica(four, four_ranks["index"]["pp4_1f1b_tied"], run="full")
    assert_same(merge_replica(res, 1), src, RESHARD, "consolidated file -> pp2")
    # a plain single-device checkpoint (positional optimizer state) starts a pipeline run
    got = merge_replica(res, 2)
    assert_same(got, {k: v for k, v in plain_continued["params"].items() if k in got}, RESHARD,
                "single-device ckpt -> pp2")
    assert res[0][3]["global_step"] == 8
    messages = {
        4: ["does not match the model", "Missing from the checkpoint", "Unexpected in the checkpoint", "layers.7"],
        5: ["corrupted", ".distcp"],
        6: ["incomplete", ".metadata"],
        7: ["not a lightning_pipe checkpoint"],
        8: ["not a checkpoint"],
        9: ["does not exist"],
        **{10 + i: ["Refused to load", str(path), *TRUST[name]] for i, (name, path) in enumerate(crafted.items())},
    }
    for idx, phrases in messages.items():
        errors = [rank[idx] for rank in res]
        assert all(not e["ok"] for e in errors), errors
        assert errors[0]["error"] == errors[1]["error"], "every rank raises the same error"
        assert errors[0]["error"].startswith("CheckpointError")
        for phrase in phrases:
            assert phrase in errors[0]["error"], (phrase, errors[0]["error"])
    assert not marker.exists(), "a crafted checkpoint's object ran"
    assert res[0][10 + len(crafted)]["global_step"] == 8  # the earlier format, trusted: resumed at step 4
    # the full disk: every rank names it first (not DCP's CheckpointException), the failed save's files are gone,
    # the step-2 checkpoint and `last` (linked to it) stay
    for rank in res:
        assert not rank[-1]["ok"] and rank[-1]["error"].startswith(
            f"CheckpointError: No space left on {str(full_dir)!r}: saving {STEP4!r} needed about "), rank[-1]
    assert sorted(p.name for p in full_dir.iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    assert ckpt_lib.describe(full_dir / "last.ckpt") == "sharded"


@pytest.mark.timeout(600)
def test_async_checkpoints_resume_exactly_and_survive_a_kill_mid_write(tmp_path: Path) -> None:
    """async_checkpoint=True: stopped after 4 of 8 steps and resumed == uninterrupted; a rank killed while "last"
    is written on the saver's thread leaves the previous "last" complete (checksums verified), and the run resumes
    from it."""
    crash_dir = tmp_path / "crash"
    with pytest.raises(RanksFailed, match="exit codes"):
        launch("ckpt_crash", 2, [CheckpointCase(dir=str(crash_dir), crash_rank=1, async_save=True)],
               tmp_path / "out_crash", timeout=200)
    last = crash_dir / "last.ckpt"
    assert last.is_dir() and not last.is_symlink()
    assert ckpt_lib.verify_checksums(last) and ckpt_lib.consolidated(last)["global_step"] == 2
    assert ckpt_lib.describe(crash_dir / STEP4) == "sharded"  # written before "last" (save 3 of 4 completed)

    d = tmp_path / "async"
    res = launch_runs(2, [("ckpt_train", CheckpointCase(dir=str(d), resume_from=str(d / STEP4), async_save=True)),
                          ("ckpt_resume", CheckpointCase(resume_from=str(last), async_save=True))],
                      tmp_path / "out", timeout=400)
    for rank in res:
        full, resumed = rank[0]["full"], rank[0]["resumed"]
        assert resumed["global_step"] == 8 and rank[1]["global_step"] == 8
        assert_same(resumed["params"], full["params"], EXACT, "async resume params")
        torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(full["losses"][4:]), atol=EXACT,
                                   rtol=0)
    assert ckpt_lib.consolidated(d / "last.ckpt")["global_step"] == 8 and not list(d.glob(".*partial*"))


@pytest.mark.timeout(300)
def test_a_really_full_disk_stops_every_rank_naming_it(tmp_path: Path, small_tmpfs: Callable[[str], Path]) -> None:
    """Saves into a 260 KiB tmpfs until it is full: the toy's second checkpoint, then the tiny GPT's first (its
    tensors alone need more than is left). Whichever write the disk refuses — a rank's tensors, which torch's zip
    writer reports without the errno, or rank 0's meta.pt — every rank raises the same error naming the directory,
    no partial save stays, and the checkpoint written before it is intact."""
    disk = small_tmpfs("260k")
    toy, gpt = disk / "toy", disk / "gpt"
    res = launch("ckpt_train", 2, [CheckpointCase(dir=str(toy), expect_error=True),
                                   CheckpointCase(dir=str(gpt), model="gpt", n_layers=4, expect_error=True)],
                 tmp_path / "out", timeout=250)
    for case, where in enumerate((toy, gpt)):
        errors = [rank[case] for rank in res]
        assert all(not e["ok"] for e in errors) and errors[0]["error"] == errors[1]["error"], errors
        assert errors[0]["error"].startswith(f"CheckpointError: No space left on {str(where)!r}: saving "), errors
        assert not [p for p in where.iterdir() if ".partial-" in p.name]
    assert ckpt_lib.describe(toy / STEP4) == "sharded" and ckpt_lib.consolidated(toy / STEP4)["global_step"] == 4
