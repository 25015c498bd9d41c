#!/usr/bin/env bash
# The GPU checks of the attention core, in one short run (used on a lent H200; needs no DeepSpeed):
# CUDA kernels against the reference (pytest), kernel speed, and WallFacer attention (P = 1) on CUDA.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-results/gpu_check}"; mkdir -p "$OUT"
nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
python3 -m pytest -q -rs tests/attention/test_kernels.py -k cuda 2>&1 | tee "$OUT/pytest_cuda.log" | tail -15
python3 launch/bench_kernels.py --seq-lens 4096,16384 --iters 5 2>&1 | tee "$OUT/bench_kernels.log" | tail -30
torchrun --standalone --nproc_per_node 1 launch/bench_attention.py --seq-len 16384 --heads 32 --kv-heads 8 \
  --head-dim 128 --iters 3 --out "$OUT/bench_attention.png" 2>&1 | tee "$OUT/bench_attention.log" | tail -12
