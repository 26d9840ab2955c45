#!/usr/bin/env bash
# Fills .carry/whl with the wheels that the lent H200's image lacks (Python 3.12, x86-64), for
# `device run` with carry [".carry"]. The image has torch, triton, pyarrow, accelerate, pytest and
# hypothesis; it lacks, or has other versions of, everything below.
#
#   bash bench/carry_wheels.sh          # transformers 5.25.0 (what scripts/setup.sh installs) + kernels
#   bash bench/carry_wheels.sh 5.24     # transformers 5.24.0, with the image's huggingface_hub 1.x
#
# On the device, first:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .carry/whl/*.whl && export PYTHONPATH=/tmp/site
#
# bitsandbytes' wheel holds a library for each CUDA, ROCm and XPU version (129 MB unpacked); the image's
# torch is cu130, so the others are dropped and the whole folder stays well under the 64 MiB that travels.
set -euo pipefail
cd "$(dirname "$0")/.."
profile=${1:-5.25}
case "$profile" in
  5.24) transformers=(transformers==5.24.0) ;;
  # 5.25 needs kernels, and huggingface_hub 2.4, which moved to httpx2.
  5.25) transformers=(transformers==5.25.0 kernels==0.19.1 tomlkit huggingface_hub==2.4.0 httpx2==2.17.0
                      httpcore2==2.17.0 truststore anyio idna h11 click hf-xet) ;;
  *) echo "usage: bash bench/carry_wheels.sh [5.24|5.25]" >&2; exit 2 ;;
esac
rm -rf .carry/whl && mkdir -p .carry/whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .carry/whl \
  "${transformers[@]}" peft==0.21.2 pydantic==2.12.5 pydantic-core==2.41.5 annotated-types typing-inspection \
  gguf bitsandbytes==0.50.2 trl==1.16.0 datasets dill multiprocess liger-kernel==0.8.5 2>&1 | grep -v "is ignored" || true
zip -q -d .carry/whl/bitsandbytes-*.whl $(unzip -Z1 .carry/whl/bitsandbytes-*.whl |
  grep -E 'libbitsandbytes_(cuda|rocm|xpu)[0-9]+\.so$' | grep -v cuda130)
ls .carry/whl
du -sh --apparent-size .carry
