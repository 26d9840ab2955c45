#!/usr/bin/env bash
# The CUDA-only tests, the flex/CUDA-graphs trajectory, and the CUDA graphs a real model's run holds
# after each step (Qwen2.5-3B QLoRA at seq 512, where auto turns graphs on), in one device call (after
# `bash bench/carry_wheels.sh` here):
#   device run: bash bench/gpu_checks.sh     (carry [".carry"])
# Prints the tests' failures without the captured debug logs, and keeps the three reports under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu_checks}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .carry/whl/*.whl || exit 1
export PYTHONPATH=$PWD/src:/tmp/site
python3 -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__, '|', torch.cuda.get_device_name())"
python3 -m pytest -q -p no:cacheprovider -p no:logging -rs -m "slow or not slow" -k cuda \
  tests/training/test_attention.py tests/training/test_cuda_graphs.py 2>&1 | tail -60 | tee "$out/tests.log"
python3 bench/flex_graphs_trajectory.py 2>&1 | grep -v Warning | tee "$out/trajectory.log"
python3 bench/vs_trl.py --arch qwen2.5-3b --quant 4bit --batch 4 --seq 512 --steps 10 --warmup 3 --packing \
  --systems relaytune > "$out/graphs_held.log" 2>&1
grep -o '"cuda_graphs_held_per_step": \[[^]]*\]\|"tokens_per_second": [0-9.]*' "$out/graphs_held.log" || tail -20 "$out/graphs_held.log"
