"""Every built-in schedule (``configs/schedule/*.yaml``) trains through the GPT recipe with the recipe's own
defaults — ``python recipes/gpt/train.py schedule=<name>``, as the README shows for each: gpt_tiny's 6 layers, 2 CPU
ranks, each schedule's micro-batches, gradient clipping at 1.0 on the embedding/head weight tied across the stages.
Only what keeps it cheap is overridden (2 steps, a narrower model, batch 8, a 60 kB corpus slice, no validation,
logging or checkpoints); and the data options (``data=dynamic_padding``, ``data=packed``). One launch runs all of them
(the recipe's config composed with Hydra's compose API and its own ``train``, in the launched ranks)."""

from __future__ import annotations

import math

import pytest

from tests.distributed.launcher import REPO, launch
from tests.distributed.scenarios.recipe import RecipeCase
from tests.torch_tiers import refused

pytestmark = [pytest.mark.distributed]

SCHEDULES = sorted(p.stem for p in (REPO / "configs" / "schedule").glob("*.yaml"))
SPLIT_BACKWARD = {"zb_h1", "zbv", "dualpipev"}  # refused on the restricted torch tier (tests/unit/test_compat.py)
CHEAP = ("trainer.max_steps=2", "trainer.val_check_interval=null", "trainer.limit_val_batches=0",
         "validate_after_fit=false", "data.max_bytes=60000", "data.batch_size=8", "model.n_embd=32",
         "model.n_head=2", "model.block_size=32", "logger=none", "callbacks=none",
         "trainer.enable_checkpointing=false", "trainer.enable_progress_bar=false", "+trainer.enable_model_summary=false")


@pytest.mark.timeout(600)
def test_every_schedule_trains_from_the_recipe_defaults(tmp_path) -> None:
    schedules = [s for s in SCHEDULES if not (s in SPLIT_BACKWARD and refused("split_backward"))]
    assert {"gpipe", "1f1b", "pipedream", "chimera", "auto", "custom"} <= set(schedules), schedules
    cases = [RecipeCase(overrides=(f"schedule={s}", *CHEAP, f"paths.output_dir={tmp_path / s}")) for s in schedules]
    # the data options under the pipeline: dynamic padding (a new length each batch), packed rows for the Llama
    data = {"dynamic_padding": ("data=dynamic_padding",), "packed_llama": ("data=packed", "model=llama_tiny")}
    cases += [RecipeCase(overrides=(*options, *CHEAP, f"paths.output_dir={tmp_path / name}"))
              for name, options in data.items()]
    # last (a failed step ends the run): byte data (ids up to 255) for a 100-token vocabulary, on the first stage of
    # each of 2 one-stage replicas; the embedding's bare IndexError names the id, the size and the setting instead
    cases.append(RecipeCase(overrides=("model.vocab_size=100", "strategy.data_parallel_size=2", *CHEAP,
                                       f"paths.output_dir={tmp_path / 'vocab'}"), expect_error=True))
    results = launch("recipe", 2, cases, tmp_path / "out", timeout=540)
    for rank in results:
        vocab = rank[-1]
        assert not vocab["ok"] and "is outside the vocabulary of layer 0's embedding Embedding.wte (nn.Embedding(100" in (
            vocab["error"]), vocab["error"]
        assert "vocab_size=100" in vocab["error"] and "Hydra: model.vocab_size" in vocab["error"], vocab["error"]
        for name, out in zip(data, rank[len(schedules):-1]):
            assert out["ok"] and out["global_step"] == 2 and math.isfinite(out["train_loss"]), (name, out)
        for schedule, out in zip(schedules, rank):
            assert out["ok"] and out["global_step"] == 2, (schedule, out)
            assert out["gradient_clip_val"] == 1.0 and math.isfinite(out["train_loss"]), (schedule, out)
            if schedule not in ("auto", "custom"):
                assert out["schedule"] == schedule, (schedule, out)
