"""The one-GPU check: CUDA parity, speed against the right anchors, host-device syncs per step and a profiler trace
of one step, each case in a process of its own, in one command of about 6 minutes on an H200.

On a machine with one CUDA GPU (run with one H200, torch 2.11, no Hydra: none is needed here), from the repository
root:

    set -o pipefail; PYTHONUNBUFFERED=1 python3 -m bench.gpu 2>&1 | tee $OUT/gpu.log

``--out DIR`` (default ``$OUT`` if set, else ``bench/out/gpu``) receives ``results.json`` (every case's numbers,
errors and the table) and four gzip'd Chrome traces, ``trace_<model>-{a3,c}.json.gz`` (one step each). The table
printed at the end is the one to quote. ``--smoke`` runs the same code on the CPU (tiny GPT and Llama, gloo, fp32
parity) in about two minutes: ``tests/recipes/test_gpu_script.py`` runs it. docs/gpu-check.md says more.

Cases, per model (GPT-2 124M: 4 micro-batches of 4 x 1024 tokens; Llama 1.2B, configs/model/llama_1b.yaml:
2 micro-batches of 4 x 2048 tokens; 16384 tokens a step either way; bf16, the module's own AdamW):

    a    plain torch loop, the whole batch          a3  torch.distributed.pipelining by hand (interleaved 1F1B,
    a2   plain torch loop, grad accumulation            2 stages on the one rank, m micro-batches)
         over the same m micro-batches              c   PipelineStrategy in a Lightning Trainer, 1 rank x 2 stages

and parity (GPT-2 124M, 5 steps, every parameter vs Lightning on one device, NCCL at world size 1): interleaved
1F1B and ZB-V, each fp32 (TF32 off, atol 1e-5) and bf16-mixed (atol 2 bf16 ulps, 2**-7). On torch < 2.13 the
library refuses ZB-V (split backward): the case then reads "refused", with the library's message.
"""
