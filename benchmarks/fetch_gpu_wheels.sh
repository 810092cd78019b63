#!/usr/bin/env bash
# Wheels a GPU machine without network lacks, fetched here into .whl/ (git-ignored):
# FlashInfer's sampling kernels for the VA comparison of `report_decoding --gpu --flashinfer`, and
# the fused-loss baselines of `report --gpu`, Liger-Kernel and Cut Cross-Entropy (pure Python over
# torch and triton, under 1 MB each; the versions pyproject's "bench" extra installs here).
# 0.6.0 is the newest FlashInfer whose wheel is small enough to travel (~7.5 MB; 0.7 is 62 MB
# against the 64 MiB the device tool carries); it JIT-compiles its kernels with the machine's
# nvcc on first use. The machines run CPython 3.12, so the binary dependency is fetched for it.
# Then: device run with carry [".whl"] and `bash benchmarks/gpu_check.sh "loss flashinfer"`.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download --no-deps -d .whl flashinfer-python==0.6.0 liger-kernel==0.8.5 cut-cross-entropy==25.1.1
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  -d .whl "apache-tvm-ffi>=0.1.6,<0.2"
ls -la .whl
