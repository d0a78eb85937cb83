"""transformers causal LMs (GPT-2, Llama, Mistral, Qwen2, Qwen3; Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3) as
pipeline layer lists; an optional extra.

Plain torch + transformers (no Lightning import)::

    from lightning_pipe.hf import causal_lm_layers, layers_from_config, load_layers, causal_lm_loss

    layers = causal_lm_layers(model)                 # from an instantiated *ForCausalLM, same weights
    layers = layers_from_config(config)              # from a config, random init (device="meta": nothing allocated)
    layers = load_layers("ckpt_dir", only=[0, 1])    # local safetensors; reads only the tensors of layers 0 and 1
    logits = run the list on (input_ids, attention_mask)
    loss = causal_lm_loss(logits, labels)            # == model(..., labels=labels).loss

See :mod:`lightning_pipe.hf.layers` for the layer I/O ([Note: layer I/O]) and the checkpoint key mapping,
:mod:`lightning_pipe.hf.weights` for init / loading, :mod:`lightning_pipe.hf.loss` for the loss. The Lightning side:
``lightning_pipe.HFCausalLM`` (in :mod:`lightning_pipe.lightning.hf`).
"""

from lightning_pipe.hf.families import SUPPORTED_MODEL_TYPES
from lightning_pipe.hf.layers import (
    CausalLMDecoderLayer,
    CausalLMEmbedding,
    CausalLMHead,
    CausalLMNorm,
    HFLayer,
    causal_lm_layers,
    layers_from_config,
)
from lightning_pipe.hf.loss import IGNORE_INDEX, causal_lm_loss, causal_lm_loss_sum_count
from lightning_pipe.hf.weights import (
    SafetensorsCheckpoint,
    hf_state_dict,
    init_layer_,
    load_layer_weights_,
    load_layers,
    materialize_layers_,
)

__all__ = [
    "IGNORE_INDEX",
    "SUPPORTED_MODEL_TYPES",
    "CausalLMDecoderLayer",
    "CausalLMEmbedding",
    "CausalLMHead",
    "CausalLMNorm",
    "HFLayer",
    "SafetensorsCheckpoint",
    "causal_lm_layers",
    "causal_lm_loss",
    "causal_lm_loss_sum_count",
    "hf_state_dict",
    "init_layer_",
    "layers_from_config",
    "load_layer_weights_",
    "load_layers",
    "materialize_layers_",
]
