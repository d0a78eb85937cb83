"""Read a model, a cluster and a stack from what a user has: JSON files, preset names, the recipes' model configs
(``configs/model/*.yaml``) and transformers' ``config.json``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from lightning_pipe.planner.cluster.presets import CLUSTERS, STACKS
from lightning_pipe.planner.cluster.specs import ClusterSpec, ModelSpec, Stack, from_mapping, spec_error

HF_KEYS = {"layers": ("num_hidden_layers", "n_layer"), "hidden": ("hidden_size", "n_embd"),
           "heads": ("num_attention_heads", "n_head"), "vocab": ("vocab_size",),
           "seq": ("max_position_embeddings", "n_positions", "n_ctx")}


def _read(path: Path, what: str) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as err:
        raise spec_error(f"A {what} is a file (or a preset name).", f"{str(path)!r} ({err.strerror})",
                         f"--{what}") from None
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml  # PyYAML, installed with omegaconf; only the recipes' model configs need it

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as err:  # any parse error is the file's fault: say which file
        raise spec_error(f"A {what} file is JSON (or a recipe's YAML model config).", f"{str(path)!r}: {err}",
                         f"--{what}") from None
    if not isinstance(data, dict):
        raise spec_error(f"A {what} file holds one mapping of keys.", f"{str(path)!r}", f"--{what}")
    return data


def load_model(source: str, seq: int | None = None) -> ModelSpec:
    """A model JSON (``layers``, ``hidden``, ``heads``, ``seq``, ``vocab``, ...), a recipe's model config
    (``configs/model/gpt_small.yaml``, or its name ``gpt_small`` from the current directory's ``configs/model``) or
    a transformers ``config.json``; ``seq`` replaces the file's sequence length."""
    path = Path(source)
    if not path.exists() and (Path("configs/model") / f"{source}.yaml").exists():
        path = Path("configs/model") / f"{source}.yaml"
    data = _read(path, "model")
    if "_target_" in data:
        spec = _from_recipe(data, path)
    elif "layers" in data and "hidden" in data:
        spec = from_mapping(ModelSpec, {"name": path.stem, **data}, "model")
    else:
        spec = _from_transformers(data, path)
    if seq is not None:
        import dataclasses

        spec = dataclasses.replace(spec, seq=seq)
    return spec


def _from_recipe(data: dict[str, Any], path: Path) -> ModelSpec:
    target = str(data["_target_"])
    common = {"layers": data["n_layer"], "hidden": data["n_embd"], "heads": data["n_head"],
              "seq": data["block_size"], "vocab": data["vocab_size"], "name": path.stem, "source": str(path)}
    if target.endswith("Llama"):
        hidden = int(2 * 4 * data["n_embd"] / 3)
        multiple = int(data.get("multiple_of", 256))
        ffn = multiple * math.ceil(hidden / multiple)  # recipes.llama.model.swiglu_hidden
        return ModelSpec(**common, kv_heads=data.get("n_kv_head", data["n_head"]), ffn=ffn, activation="swiglu",
                         tied_embeddings=bool(data.get("tie_embeddings", False)))
    if target.endswith("GPT"):
        return ModelSpec(**common, tied_embeddings=True, bias=bool(data.get("bias", True)))
    raise spec_error("A recipe model config builds recipes.gpt.model.GPT or recipes.llama.model.Llama.",
                     f"_target_={target!r} in {str(path)!r}", "--model")


def _from_transformers(data: dict[str, Any], path: Path) -> ModelSpec:
    found: dict[str, Any] = {}
    for key, names in HF_KEYS.items():
        value = next((data[n] for n in names if n in data), None)
        if value is None:
            raise spec_error("A model file has layers, hidden, heads, seq and vocab (or a transformers config's "
                             "num_hidden_layers, hidden_size, num_attention_heads, max_position_embeddings, "
                             "vocab_size).", f"{str(path)!r} without {key} ({' / '.join(names)})", "--model")
        found[key] = value
    act = str(data.get("hidden_act", data.get("activation_function", "gelu")))
    gated = act in ("silu", "swish") or "llama" in str(data.get("model_type", "")).lower()
    ffn = data.get("intermediate_size") or data.get("n_inner") or 0
    return ModelSpec(**found, kv_heads=data.get("num_key_value_heads") or 0, ffn=int(ffn),
                     activation="swiglu" if gated else "gelu",
                     tied_embeddings=bool(data.get("tie_word_embeddings", True)), name=path.parent.name or path.stem)


def load_cluster(source: str, gpus: int | None = None) -> ClusterSpec:
    """A preset name (:data:`~lightning_pipe.planner.cluster.presets.CLUSTERS`) or a cluster JSON; ``gpus``
    replaces its GPU count."""
    if source in CLUSTERS:
        spec = CLUSTERS[source]
    else:
        path = Path(source)
        if not path.exists():
            raise spec_error(f"--cluster is a JSON file or one of the presets {sorted(CLUSTERS)}.",
                             f"{source!r}", "--cluster")
        spec = from_mapping(ClusterSpec, {"name": path.stem, **_read(path, "cluster")}, "cluster")
    return spec.with_gpus(gpus) if gpus is not None else spec


def load_stack(source: str) -> Stack:
    """A stack name (:data:`~lightning_pipe.planner.cluster.presets.STACKS`) or a JSON of :class:`Stack` fields."""
    if source in STACKS:
        return STACKS[source]
    path = Path(source)
    if not path.exists():
        raise spec_error(f"--stack is a JSON file or one of {sorted(STACKS)}.", f"{source!r}", "--stack")
    data = _read(path, "stack")
    for key in ("recompute_modes", "zero_modes", "schedules", "splits"):
        if key in data:
            data[key] = tuple(data[key])
    stack: Stack = from_mapping(Stack, {"name": path.stem, **data}, "stack")
    return stack
