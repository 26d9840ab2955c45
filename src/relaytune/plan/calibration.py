"""Constants of the memory model (plan/memory.py) fitted to GPU measurements, each beside where it was measured.

Units as in plan/memory.py: a = bytes of the compute dtype, I = the MLP's intermediate size, per token of
the micro-batch. The BACKWARD_* constants come from H200 figures: the eager ones from
bench/results/gpu-h200.md (Qwen2.5-3B, loss chunk 256), the compiled 4-bit one from
bench/results/planner.md; bench/planner_accuracy.py re-measures, and --rescore re-scores old runs.
"""

GIB = 2 ** 30

# Backward temporaries of one decoder layer, in units of a x I per token: gradients of the down
# projection's input, of the SwiGLU halves and of the LoRA input casts. Adapters in fp32 under
# half-precision autocast add fp32 copies of those gradients; 4-bit layers skip the fp32 cast.
BACKWARD_FP32_CAST = 4.3
BACKWARD_PLAIN = 1.6
# A compiled 4-bit layer's backward holds more at once: Inductor fuses the layer's gradient work into
# few kernels around bitsandbytes' dequantizing matmuls, which are graph breaks. Fitted to the eight
# compiled QLoRA cases with checkpointing in bench/results/planner.md (no held-out check yet).
BACKWARD_COMPILED_QUANTIZED = 1.5
# compile_checkpoint: the compiled backward graph recomputes the layer and holds more MLP-sized buffers at
# once (Inductor keeps the frozen and LoRA outputs of gate and up apart). Its two H200 measurements at
# seq 2048 (bench/results/vs-trl-h200.md, thirteenth session) peaked 0.656 GiB (Llama-3-8B QLoRA bs 2) and
# 0.637 GiB (Qwen2.5-3B QLoRA bs 4) above the checkpoint outside, which this model overestimates by 0.31
# and 0.14 GiB; 3.5 puts both totals just above what was measured (8.54 against 8.51, 5.68 against 5.59).
BACKWARD_CHECKPOINT_INSIDE = 3.5
# liger_kernels' SwiGLU writes the gate's and up's gradients into their saved inputs instead of new buffers,
# which takes up to 2 units of a x I per token off the compiled backward. Measured on an H100 with
# offload_activations (bench/results/vs-trl-h200.md, fifth session): 2.56 units for Qwen2.5-3B QLoRA and
# 1.65 for Llama-3-8B QLoRA (micro-batches 4 and 2 x 2048 tokens); the least, rounded down, is counted.
# SwiGLU alone on H100s (ninth session of 2026-12-06) saved 2.74 and 2.00 units in the same cases and 2.81 for
# Qwen2.5-3B at micro-batch 32, more than the two gradients explain (not traced); the least still rules.
# RMSNorm's kernel saves the norm's input in the compute dtype, as a compiled layer already does.
LIGER_SWIGLU_IN_PLACE = 1.5
BACKWARD_FIXED = int(0.08 * GIB)  # cuBLAS workspaces and a dequantized weight, whatever the batch
# With offload_activations, what stayed on the GPU beyond the other parts, per token of the micro-batch:
# 1.08 GiB at 32,768 tokens (Qwen2.5-3B QLoRA, micro-batch 16) and 0.55 GiB at 16,384 (Llama-3-8B QLoRA,
# micro-batch 8), compiled layers on an H200 (bench/results/vs-trl-h200.md). Not yet explained.
OFFLOAD_RESIDUAL_PER_TOKEN = 34 * 1024
# Qwen2.5-3B QLoRA on an H200, compiling from scratch (pointwise autotuning off under graphs, as
# layers.compile_layers sets it): none at 2,048 tokens per micro-batch (2.847 GiB with and without),
# 0.128 GiB at 8,192 (5.079 against the tenth session's 4.951 without graphs; why, not traced). Rounded
# up, and counted at every micro-batch and for every model, since no other was measured.
GRAPHS_EXTRA = int(0.15 * GIB)
SLACK_FRACTION = 0.05  # reserved above allocated: the caching allocator's rounding and fragmentation
