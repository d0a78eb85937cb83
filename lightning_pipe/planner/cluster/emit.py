"""Write a predicted layout as a Hydra experiment of the GPT recipe (``experiment=<the file's name>``).

The file overrides the recipe's defaults (``configs/train.yaml``): the model (a bundled config by name, or
``gpt2_124m`` / ``llama_1b`` with the model's shape), the schedule and its micro-batches and stages per rank, the
strategy's replicas, tensor-parallel size, ZeRO-1 as FSDP shards, recomputation and the planned split, the trainer's
devices, nodes and precision, and the data loader's batch per data-parallel rank. Data stays the recipe's default
(the standard library's text, bytes as tokens): add ``data=bin_file data.bin_path=...`` for real data.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from lightning_pipe.planner.cluster.project import Projection, Projector
from lightning_pipe.planner.cluster.specs import ModelSpec, spec_error

PRECISION = {"bf16": "bf16-mixed", "fp16": "16-mixed", "fp32": "32-true"}


def _multiple_of(model: ModelSpec) -> int:
    """The Llama recipe's ``multiple_of`` that gives the model's SwiGLU width (recipes.llama.model.swiglu_hidden)."""
    base = int(2 * 4 * model.hidden / 3)
    for m in (256, 128, 64, 32, 16, 8, model.ffn):
        if m * math.ceil(base / m) == model.ffn:
            return m
    raise spec_error("The Llama recipe's SwiGLU width is 2/3 x 4 x hidden rounded up to a multiple of multiple_of: "
                     "at least int(8 hidden / 3).", f"ffn={model.ffn} for hidden={model.hidden}",
                     "`ffn` in the model file")


def model_overrides(model: ModelSpec) -> tuple[str, dict[str, Any]]:
    """(the bundled model config to start from, the keys to set on it)."""
    if model.source and Path(model.source).parent.name == "model":
        return Path(model.source).stem, {}
    shape = {"vocab_size": model.vocab, "block_size": model.seq, "n_layer": model.layers, "n_head": model.heads,
             "n_embd": model.hidden}
    if model.activation == "swiglu":
        return "llama_1b", {**shape, "n_kv_head": model.kv_heads, "multiple_of": _multiple_of(model),
                            "tie_embeddings": model.tied_embeddings}
    if model.ffn != 4 * model.hidden or model.kv_heads != model.heads or not model.tied_embeddings:
        raise spec_error("The GPT recipe's blocks have ffn = 4 x hidden, one key/value head per head and the head "
                         "tied to the embedding.", f"ffn={model.ffn}, kv_heads={model.kv_heads}, "
                         f"tied_embeddings={model.tied_embeddings}", "the model file (or use activation=swiglu)")
    return "gpt2_124m", shape


def _yaml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    return str(value)


def _block(name: str, values: dict[str, Any]) -> list[str]:
    return [f"{name}:"] + [f"  {k}: {_yaml(v)}" for k, v in values.items()] if values else []


def launch_lines(path: Path, projector: Projector) -> list[str]:
    """How to run the file: the recipe's command, and under SLURM one task per GPU."""
    c = projector.cluster
    if path.parent.name != "experiment":
        where = "(copy it to configs/experiment/) "
    else:
        where = "" if path.parent.parent.name == "configs" else f"--config-dir {path.parent.parent} "
    run = f"python recipes/gpt/train.py {where}experiment={path.stem}"
    lines = [f"#   {run}"]
    if c.accelerator == "gpu":
        per_node = min(c.gpus, c.gpus_per_node)
        lines.append(f"#   srun --nodes={c.nodes} --ntasks-per-node={per_node} --gpus-per-node={per_node} {run}")
    return lines


def experiment(projection: Projection, projector: Projector, path: Path) -> str:
    """The experiment file's text."""
    lay, model, c = projection.layout, projector.model, projector.cluster
    if lay.recompute == "selective":
        raise spec_error("The strategy recomputes whole layers (recompute=full) or none; selective recomputation "
                         "is a Megatron feature.", f"recompute={lay.recompute}", "recompute in --layout")
    base, shape = model_overrides(model)
    m = lay.microbatches(projector.global_batch)
    per_node = min(c.gpus, c.gpus_per_node)
    trainer = "gpu_multinode" if c.accelerator == "gpu" and c.nodes > 1 else "gpu" if c.accelerator == "gpu" \
        else "default"
    strategy = {"data_parallel_size": 1 if lay.zero else lay.dp, "fsdp_size": lay.dp if lay.zero else 1,
                "fsdp_reshard_after_forward": False, "tensor_parallel_size": lay.tp,
                "recompute": "all" if lay.recompute == "full" else "none", "partition": list(projection.counts)}
    lines = ["# @package _global_",
             f"# {model.name} on {c.name} ({c.gpus} x {c.accelerator}): {lay.line()}",
             f"# predicted by `python -m lightning_pipe.planner project`: {projection.iteration_s:.3f} s per step, "
             f"{projection.model_tflops_per_gpu:.1f} model TFLOP/s per device (MFU {projection.mfu:.1%}), "
             f"{projection.memory_bytes / 2**30:.1f} GiB per device",
             "# run:", *launch_lines(path, projector),
             "defaults:", f"  - override /model: {base}", f"  - override /schedule: {lay.schedule}",
             "  - override /strategy: pipeline", f"  - override /trainer: {trainer}", "",
             f"task_name: {path.stem}",
             *_block("model", shape),
             *_block("schedule", {"microbatches": m, "stages_per_rank": lay.v}),
             *_block("strategy", strategy),
             *_block("data", {"batch_size": projector.global_batch // lay.dp}),
             *_block("trainer", {"accelerator": c.accelerator, "devices": per_node, "num_nodes": c.nodes,
                                 "precision": PRECISION[c.precision]})]
    return "\n".join(lines) + "\n"


def write_experiment(projection: Projection, projector: Projector, path: str | Path) -> list[str]:
    """Write the experiment file; returns the lines that say how to run it."""
    target = Path(path)
    if not projection.fits:
        raise spec_error("--emit-config writes a layout that fits in the devices' memory.",
                         f"{projection.layout.line()} at {projection.memory_bytes / 2**30:.1f} GiB per device "
                         f"(of {projector.cluster.memory_gib:g})", "--layout (or leave it out to search)")
    text = experiment(projection, projector, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    return [line[4:] for line in launch_lines(target, projector)]
