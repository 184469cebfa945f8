#!/usr/bin/env bash
# The checks that need CUDA, for a machine with a GPU and torch already installed: the
# tests marked gpu (CUDA tensors over gloo, every compressor on CUDA, NCCL's refusal of
# two ranks on one GPU; no NCCL operation itself), then the
# compressors' speed on the GPU. Results go to $OUT (default results/gpu).
# Usage: [PYTHON=python3] [OUT=folder] bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-results/gpu}"
py="${PYTHON:-python3}"
mkdir -p "$out"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi -L
"$py" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
timeout 300 "$py" -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$out/pytest_gpu.log" \
    | grep -v "^SKIPPED" | tail -30
status=${PIPESTATUS[0]}
timeout 120 "$py" benchmarks/bench_compression.py --device cuda --out "$out"
exit "$status"
