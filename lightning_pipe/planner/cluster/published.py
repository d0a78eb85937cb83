"""Published large runs the cluster planner is checked against: Megatron-LM SC'21 Table 1 (Narayanan et al., 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"), its configurations as in the
repository's ``examples/sc21/run_table_1.sh``: A100-80GB, 8 per node on NVSwitch, 8 x 200 Gb/s HDR InfiniBand per
node, seq 2048, vocab 51,200, fp16, full recomputation.

The table reports TFLOP/s per GPU counting the recomputed forward; the iteration time follows from the paper's FLOP
count, ``96 B s l h^2 (1 + s / (6h) + V / (16 l h))`` per iteration (DESIGN.md section 14)."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_pipe.planner.cluster.layout import Layout
from lightning_pipe.planner.cluster.presets import CLUSTERS
from lightning_pipe.planner.cluster.specs import ClusterSpec, ModelSpec

SEQ, VOCAB = 2048, 51200


@dataclass(frozen=True)
class PublishedRun:
    layers: int
    hidden: int
    heads: int
    tp: int
    pp: int
    dp: int
    mbs: int
    v: int
    batch: int
    tflops: float
    """TFLOP/s per GPU as published (recomputed forward counted)."""

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def model(self) -> ModelSpec:
        return ModelSpec(self.layers, self.hidden, self.heads, SEQ, VOCAB, name=f"gpt-{self.layers}x{self.hidden}")

    @property
    def cluster(self) -> ClusterSpec:
        return CLUSTERS["a100-80gb-hdr"].with_gpus(self.gpus)

    @property
    def layout(self) -> Layout:
        schedule = "interleaved_1f1b" if self.v > 1 else "1f1b"
        return Layout(self.tp, self.pp, self.dp, self.mbs, self.v, schedule, "full", 0, split="uniform")

    @property
    def iteration_s(self) -> float:
        """The iteration time the published TFLOP/s imply."""
        b, s, n, h = self.batch, SEQ, self.layers, self.hidden
        flops = 96.0 * b * s * n * h * h * (1 + s / (6 * h) + VOCAB / (16 * n * h))
        return flops / (self.tflops * 1e12 * self.gpus)


SC21_TABLE_1 = (
    PublishedRun(24, 2304, 24, 1, 1, 32, 16, 1, 512, 137),
    PublishedRun(30, 3072, 32, 2, 1, 32, 16, 1, 512, 138),
    PublishedRun(36, 4096, 32, 4, 1, 32, 16, 1, 512, 142),
    PublishedRun(40, 6144, 48, 8, 1, 32, 8, 1, 1024, 135),
    PublishedRun(48, 8192, 64, 8, 2, 32, 4, 1, 1536, 138),
    PublishedRun(60, 10240, 80, 8, 4, 32, 2, 3, 1792, 140),
    PublishedRun(80, 12288, 96, 8, 8, 24, 2, 2, 2304, 148),
    PublishedRun(96, 16384, 128, 8, 16, 15, 1, 2, 2160, 155),
    PublishedRun(105, 20480, 128, 8, 35, 9, 1, 3, 2520, 163),
    PublishedRun(128, 25600, 160, 8, 64, 6, 1, 1, 3072, 163),
)
