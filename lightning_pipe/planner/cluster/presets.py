"""Bundled clusters and software stacks (Python constants, so an installed package has them).

Every number of a cluster preset, with its source (also in docs/planner.md, "Planning a cluster"):

``a100-80gb-hdr`` (NVIDIA DGX A100 80GB nodes on HDR InfiniBand, the SC'21 paper's Selene):
  peak 312 TFLOP/s dense fp16 / bf16 per GPU (NVIDIA A100 datasheet); 80 GiB HBM2e at 2,039 GB/s (A100 80GB SXM
  datasheet); NVLink 3 through NVSwitch, 600 GB/s per GPU both directions = 300 one way (datasheet); 8 ConnectX-6
  HDR NICs of 200 Gb/s for 8 GPUs = 25 GB/s per GPU one way (DGX A100 user guide); 8 GPUs per node.
``h100-80gb-ndr`` (DGX H100 on NDR InfiniBand): 989 TFLOP/s dense bf16 (H100 SXM datasheet: 1,979 with sparsity);
  80 GiB HBM3 at 3,350 GB/s (datasheet); NVLink 4, 900 GB/s both directions = 450 one way; 8 ConnectX-7 NDR NICs
  of 400 Gb/s for 8 GPUs = 50 GB/s per GPU (DGX H100 user guide); 8 GPUs per node.
``a100-80gb-100gbe`` (A100 80GB SXM nodes, one 100 Gb/s Ethernet port per node, as many cloud instances): the
  A100 numbers above; 100 Gb/s = 12.5 GB/s per node shared by 8 GPUs = 1.5625 GB/s per GPU; TCP (no RDMA) latency
  about 25 us per message.
"""

from __future__ import annotations

from lightning_pipe.planner.cluster.specs import ClusterSpec, Stack

CLUSTERS: dict[str, ClusterSpec] = {
    "a100-80gb-hdr": ClusterSpec(gpus=64, gpus_per_node=8, peak_tflops=312.0, memory_gib=80.0, nvlink_gbps=300.0,
                                 network_gbps=25.0, hbm_gbps=2039.0, network_latency_us=5.0, precision="bf16",
                                 name="a100-80gb-hdr", notes="DGX A100 80GB, 8 x HDR 200 Gb/s InfiniBand per node"),
    "h100-80gb-ndr": ClusterSpec(gpus=64, gpus_per_node=8, peak_tflops=989.0, memory_gib=80.0, nvlink_gbps=450.0,
                                 network_gbps=50.0, hbm_gbps=3350.0, network_latency_us=5.0, precision="bf16",
                                 name="h100-80gb-ndr", notes="DGX H100, 8 x NDR 400 Gb/s InfiniBand per node"),
    "a100-80gb-100gbe": ClusterSpec(gpus=64, gpus_per_node=8, peak_tflops=312.0, memory_gib=80.0, nvlink_gbps=300.0,
                                    network_gbps=1.5625, hbm_gbps=2039.0, network_latency_us=25.0, precision="bf16",
                                    name="a100-80gb-100gbe", notes="A100 80GB SXM nodes, one 100 GbE port per node"),
}

STACKS: dict[str, Stack] = {
    # This library's recipes under PipelineStrategy, Lightning's bf16-mixed (fp32 weights and gradients), torch 2.13.
    "lightning_pipe": Stack(),
    # Megatron-LM as the SC'21 paper ran Table 1: fp16 with fp32 master weights, gradients all-reduced in fp16
    # after the schedule, scores materialised (fused softmax, dropout 0.1), vocabulary-parallel embedding and head,
    # pipeline sends split over the tensor ranks, ranks ordered tensor, data, pipeline; full recompute of the blocks.
    "megatron_sc21": Stack(
        name="megatron_sc21", attention="materialized", vocab_parallel=True, dropout=True,
        state_bytes=20, zero_full_bytes=4, zero_sharded_bytes=16, gather_bytes=2, optimizer_pass_bytes=48,
        reduce_bytes=2, dp_overlap=False, rank_order="tp,dp,pp", zero_rank_order="tp,dp,pp",
        recv_buffers="in_flight", pp_scatter_gather=True, blocking_p2p=True, zero_tied_on_one_rank=True,
        recompute_modes=("none", "full"), zero_modes=(0,), recompute_all_layers=False,
        schedules=("1f1b", "interleaved_1f1b"), splits=("uniform",)),
    # Megatron-Core as run since 2023: flash attention, sequence parallelism, selective recompute, the distributed
    # optimizer (bf16 weights, fp32 gradients, master weights and moments), overlapped gradient reduction.
    "megatron": Stack(
        name="megatron", attention="flash", vocab_parallel=True, dropout=False, sequence_parallel=True,
        state_bytes=18, zero_full_bytes=6, zero_sharded_bytes=12, gather_bytes=2, optimizer_pass_bytes=40,
        reduce_bytes=4, dp_overlap=True, dp_overlap_with_tp=True, rank_order="tp,dp,pp", zero_rank_order="tp,dp,pp",
        recv_buffers="in_flight", pp_scatter_gather=True, zero_tied_on_one_rank=True,
        recompute_modes=("none", "selective", "full"), zero_modes=(0, 1), recompute_all_layers=False,
        schedules=("1f1b", "interleaved_1f1b"), splits=("uniform",)),
}
