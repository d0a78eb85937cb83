"""Bad input on real ranks: every rank raises the same clear error, nobody hangs, the processes stay usable
(and then a good run with ModelCheckpoint(monitor="val_loss") works in the same processes)."""

from __future__ import annotations

import pytest

from tests.distributed.launcher import launch
from tests.distributed.scenarios import TrainingCase

pytestmark = [pytest.mark.distributed]


@pytest.mark.timeout(300)
def test_bad_input_fails_fast_on_every_rank(tmp_path):
    cases = [
        # a batch of 3 rows cannot fill 4 micro-batches (a batch of 6 trains unevenly: test_features.py)
        TrainingCase(batch=3, microbatches=4, steps=1, expect_error=True),
        # the module keeps its layers under another attribute
        TrainingCase(model="no_layers", steps=1, expect_error=True),
        # explicit partition that does not sum to the 8 layers
        TrainingCase(partition=[3, 3], steps=1, expect_error=True),
        # rank 0's loader yields 5 batches, rank 1's 3 (issue 23: a hang before): every rank stops after batch 3
        TrainingCase(steps=10, validate=False, rank_limits={"limit_train_batches": [5, 3]}, expect_error=True),
        # the same in validation (3 batches on rank 0, 1 on rank 1), at the first check after 2 training batches
        TrainingCase(steps=4, rank_limits={"limit_val_batches": [3, 1]}, expect_error=True),
        # StochasticWeightAveraging pairs a copy of the whole module with this rank's stages: refused at setup
        TrainingCase(steps=2, swa=True, expect_error=True),
        # 187 samples in batches of 8: the last of the epoch has 3 rows for 4 micro-batches, refused as training
        # starts (not 23 steps in); a run that stops before it (max_steps) is left alone
        TrainingCase(n_data=187, drop_last=False, steps=30, validate=False, expect_error=True),
        TrainingCase(n_data=187, drop_last=False, steps=2, validate=False),
        # and afterwards a good run still works in the same processes, monitored by ModelCheckpoint
        TrainingCase(steps=4, monitor_dir=str(tmp_path / "ckpts")),
    ]
    results = launch("training", 2, cases, tmp_path, timeout=200)
    for rank_results in results:
        batch, no_layers, partition, uneven_train, uneven_val, swa, ragged, ragged_short, good = rank_results
        assert not batch["ok"] and ("A training batch of 3 rows (batch_idx 0) does not divide into microbatches=4, "
                                    "and 3 rows cannot fill 4 micro-batches") in batch["error"], batch
        assert "DataLoader(drop_last=True)" in batch["error"]
        assert not no_layers["ok"] and "no attribute `layers`" in no_layers["error"]
        assert "strategy.layers_attr" in no_layers["error"]
        assert not partition["ok"] and "counts [3, 3] (sum 6) for 8 layers" in partition["error"]
        assert not uneven_train["ok"] and ("training data ends at different batches: rank(s) [1] ran out after 3 "
                                           "batches (batch_idx 2 was their last) while rank(s) [0] have more"
                                           ) in uneven_train["error"], uneven_train
        assert "Trainer(limit_train_batches=...)" in uneven_train["error"]
        assert not uneven_val["ok"] and ("validation data ends at different batches: rank(s) [1] ran out after 1 "
                                         "batches") in uneven_val["error"], uneven_val
        assert not swa["ok"] and "StochasticWeightAveraging cannot run under PipelineStrategy" in swa["error"]
        assert not ragged["ok"], ragged
        assert ("A training batch of 3 rows (the last of each epoch, batch_idx 23: 187 samples per rank in batches of 8"
                in ragged["error"]) and "drop_last=True" in ragged["error"], ragged["error"]
        assert ragged_short["ok"] and len(ragged_short["losses"]) == 2
        assert good["ok"] and len(good["losses"]) == 4
        # validation every 2 batches fed ModelCheckpoint's monitor on every rank with the same value
        assert good["best"] == results[0][-1]["best"] and good["best"][1] == min(good["fit_val_losses"])
        assert (tmp_path / "ckpts").exists() and good["best"][0]
