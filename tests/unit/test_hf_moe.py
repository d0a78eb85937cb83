"""Issue 23.4: mixture-of-experts models are refused when ``HFCausalLM`` is built, from a model or a config, naming
the supported families and the issue that adds experts — not later, at setup on every rank."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_pipe import HFCausalLM  # noqa: E402
from lightning_pipe.hf import SUPPORTED_MODEL_TYPES  # noqa: E402
from lightning_pipe.hf.layers import MOE_ISSUE, is_mixture_of_experts  # noqa: E402

MOE_CONFIGS = [name for name in ("MixtralConfig", "Qwen2MoeConfig", "Qwen3MoeConfig", "OlmoeConfig",
                                 "DeepseekV3Config") if hasattr(transformers, name)]


def _refusal(config_name: str) -> str:
    return (rf"model_type='{getattr(transformers, config_name)().model_type}' is a mixture-of-experts model.*"
            rf"issue {MOE_ISSUE}.*Supported model types: \[.*'llama'.*\]")


@pytest.mark.parametrize("name", MOE_CONFIGS)
def test_a_moe_config_is_refused_at_construction(name: str) -> None:
    config = getattr(transformers, name)(num_hidden_layers=1)
    assert is_mixture_of_experts(config)
    with pytest.raises(NotImplementedError, match=_refusal(name)):
        HFCausalLM(config=config)


@pytest.mark.parametrize("name", MOE_CONFIGS)
def test_a_moe_model_is_refused_at_construction(name: str) -> None:
    with torch.device("meta"):  # allocates nothing: the default sizes are real models'
        model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, name)(num_hidden_layers=1))
    with pytest.raises(NotImplementedError, match=_refusal(name)):
        HFCausalLM(model)


def test_the_moe_families_offered_here_are_all_covered_and_dense_ones_are_not_moe() -> None:
    assert {"MixtralConfig", "Qwen2MoeConfig", "Qwen3MoeConfig", "OlmoeConfig"} <= set(MOE_CONFIGS)
    assert not any(is_mixture_of_experts(transformers.AutoConfig.for_model(t)) for t in SUPPORTED_MODEL_TYPES)
