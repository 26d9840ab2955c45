#!/usr/bin/env bash
# The CUDA-only tests (Liger's kernels, offload_activations' side-stream copies, 4-bit matmuls and more), each bf16
# path's distance from fp32 (which the tests' bf16 tolerances come from) and the flex decoding kernel's
# (kept out or let in),
# in one device call (after `bash bench/carry_wheels.sh` here):
#   device run: bash bench/gpu_checks.sh     (carry [".carry"])
# Prints the tests' summary and failures without the captured debug logs, and keeps the reports under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu_checks}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .carry/whl/*.whl || exit 1
export PYTHONPATH=$PWD/src:/tmp/site
python3 -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__, '|', torch.cuda.get_device_name())"
python3 -m pytest -q -p no:cacheprovider -p no:logging -rfs -m "slow or not slow" -k cuda \
  tests/training/test_attention.py tests/training/test_cuda_graphs.py tests/training/test_liger.py \
  tests/training/test_activation_offload.py > "$out/tests.log" 2>&1
grep -E "^(FAILED|ERROR|SKIPPED)|^E  |passed|failed" "$out/tests.log" | head -40
# The CUDA-only tests of files whose other tests are the CPU's (4-bit matmuls, the head's syncs, pinned staging).
python3 -m pytest -q -p no:cacheprovider -p no:logging -rfs -m "slow or not slow" \
  tests/training/test_linear4bit.py tests/training/test_head_loss.py tests/training/test_speedups.py \
  tests/training/test_memory_levers.py tests/data/test_data_order.py tests/bench/test_cuda_graphs_held.py \
  -k "on_cuda or on_a_gpu or cuda_snapshot or expandable or reaches_the_device or counted_once" \
  > "$out/tests_other_files.log" 2>&1
grep -E "^(FAILED|ERROR|SKIPPED)|^E  |passed|failed" "$out/tests_other_files.log" | head -40
python3 bench/bf16_gradient_error.py 2>&1 | grep -v Warning | tee "$out/bf16_error.log"
python3 bench/flex_decoding_check.py 2>&1 | grep "vs eager fp32" | tee "$out/flex_decoding.log"
