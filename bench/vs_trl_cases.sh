#!/usr/bin/env bash
# Issue 16's cases through bench/vs_trl.py (relaytune, TRL and TRL + Liger side by side), one report
# each under $OUT, in one device call (after `bash bench/carry_wheels.sh` here):
#   device run: bash bench/vs_trl_cases.sh lora qlora        (carry [".carry"]; ~340 s on an H200)
#   device run: bash bench/vs_trl_cases.sh llama s512        (~360 s)
#   device run: bash bench/vs_trl_cases.sh liger-nockpt      (Llama, relaytune alone with liger_kernels,
#                                                             which keeps the checkpoint outside the layers)
#   device run: bash bench/vs_trl_cases.sh offload-qlora offload-qlora-compute offload-llama offload-llama-compute
#               (relaytune alone with offload_activations: its side-stream copies, then the same run with the
#               copies on the compute stream, on one machine)
#   device run: bash bench/vs_trl_cases.sh lowmem-qlora lowmem-llama cap32   (relaytune alone with every
#               memory lever: offload_activations and liger_kernels; cap32: Qwen QLoRA at micro-batch 32
#               under the 14.5 GiB cap, which TRL does not fit)
#   device run: bash bench/vs_trl_cases.sh aim-qlora aim-llama   (the lowmem settings beside TRL and TRL + Liger
#               in one invocation: the aim of 0.75x TRL's peak at 2.5x its tokens/s)
#   device run: bash bench/vs_trl_cases.sh offload-qlora swiglu-qlora lowmem-qlora offload-llama swiglu-llama lowmem-llama
#               (relaytune alone: which of Liger's two kernels costs the lowmem settings' tokens/s; a compiled
#               layer already saves the norm's input in bf16, so the plan counts no saving for rms_norm)
#   device run: bash bench/vs_trl_cases.sh aim-swiglu-qlora aim-swiglu-llama   (the aim cases with Liger's SwiGLU
#               alone, beside TRL and TRL + Liger)
#   device run: bash bench/vs_trl_cases.sh offload-qlora-b16 offload-qlora-b32 swiglu-qlora-b32   (relaytune alone,
#               uncapped, unpacked: the memory plan's offload residual and SwiGLU saving at large micro-batches)
# Each report ends with its command and wall time; the tables print as they finish.
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/vs_trl_cases}
mkdir -p "$out"
[ -d /tmp/site/transformers ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/site .carry/whl/*.whl || exit 1
export PYTHONPATH=$PWD/src:/tmp/site
for case in "$@"; do
  common=(--steps 10 --warmup 3 --packing)
  case "$case" in
    lora) args=(--arch qwen2.5-3b --quant none --batch 4) ;;
    qlora) args=(--arch qwen2.5-3b --quant 4bit --batch 4) ;;
    llama) args=(--arch llama-3-8b --quant 4bit --batch 2) ;;
    s512) args=(--arch qwen2.5-3b --quant 4bit --batch 4 --seq 512) ;;
    liger-nockpt) args=(--arch llama-3-8b --quant 4bit --batch 2 --systems relaytune --relaytune-liger) ;;
    offload-qlora) args=(--arch qwen2.5-3b --quant 4bit --batch 4 --systems relaytune
                         --relaytune-set offload_activations=true) ;;
    offload-llama) args=(--arch llama-3-8b --quant 4bit --batch 2 --systems relaytune
                         --relaytune-set offload_activations=true) ;;
    offload-qlora-compute) args=(--arch qwen2.5-3b --quant 4bit --batch 4 --systems relaytune
                                 --relaytune-set offload_activations=true --relaytune-offload-stream compute) ;;
    offload-llama-compute) args=(--arch llama-3-8b --quant 4bit --batch 2 --systems relaytune
                                 --relaytune-set offload_activations=true --relaytune-offload-stream compute) ;;
    lowmem-qlora) args=(--arch qwen2.5-3b --quant 4bit --batch 4 --systems relaytune --relaytune-liger
                        --relaytune-set offload_activations=true) ;;
    lowmem-llama) args=(--arch llama-3-8b --quant 4bit --batch 2 --systems relaytune --relaytune-liger
                        --relaytune-set offload_activations=true) ;;
    swiglu-qlora) args=(--arch qwen2.5-3b --quant 4bit --batch 4 --systems relaytune --relaytune-liger swiglu
                        --relaytune-set offload_activations=true) ;;
    swiglu-llama) args=(--arch llama-3-8b --quant 4bit --batch 2 --systems relaytune --relaytune-liger swiglu
                        --relaytune-set offload_activations=true) ;;
    aim-qlora) args=(--arch qwen2.5-3b --quant 4bit --batch 4 --relaytune-liger
                     --relaytune-set offload_activations=true) ;;
    aim-llama) args=(--arch llama-3-8b --quant 4bit --batch 2 --relaytune-liger
                     --relaytune-set offload_activations=true) ;;
    aim-swiglu-qlora) args=(--arch qwen2.5-3b --quant 4bit --batch 4 --relaytune-liger swiglu
                            --relaytune-set offload_activations=true) ;;
    aim-swiglu-llama) args=(--arch llama-3-8b --quant 4bit --batch 2 --relaytune-liger swiglu
                            --relaytune-set offload_activations=true) ;;
    offload-qlora-b16|offload-qlora-b32|swiglu-qlora-b32)  # uncapped, unpacked as cap32: the plan's large batches
      args=(--arch qwen2.5-3b --quant 4bit --batch "${case##*-b}" --systems relaytune
            --relaytune-set offload_activations=true)
      [[ $case == swiglu-* ]] && args+=(--relaytune-liger swiglu)
      common=(--steps 3 --warmup 1) ;;
    cap32) args=(--arch qwen2.5-3b --quant 4bit --cap-gib 14.5 --search 32 --systems relaytune --relaytune-liger
                 --relaytune-set offload_activations=true)
           common=(--steps 3 --warmup 1) ;;  # unpacked, as TRL's 16 at this cap was measured
    *) echo "unknown case $case (lora, qlora, llama, s512, liger-nockpt, offload-qlora[-compute]," \
            "offload-llama[-compute], lowmem-qlora, lowmem-llama, swiglu-qlora, swiglu-llama, aim-qlora, aim-llama," \
            "aim-swiglu-qlora, aim-swiglu-llama, offload-qlora-b16, offload-qlora-b32, swiglu-qlora-b32, cap32)" >&2
       exit 2 ;;
  esac
  start=$(date +%s)
  python3 bench/vs_trl.py "${args[@]}" "${common[@]}" --out "$out/$case.md" > "$out/$case.log" 2>&1
  rc=$?
  echo "<!-- command: python bench/vs_trl.py ${args[*]} ${common[*]} ; exit $rc ; total $(( $(date +%s) - start ))s -->" \
    >> "$out/$case.md"
  cat "$out/$case.md" 2>/dev/null || tail -30 "$out/$case.log"
done
