#!/usr/bin/env bash
# The main job: train a small Llama with sequence parallelism through the deepspeed launcher.
#   launch/main.sh [ds_config.json] [train.py options...]
# One rank per GPU where CUDA exists, else 4 CPU ranks (gloo). Default config: ds_configs/wallfacer.json
# (sequence_parallel_size and ring_count "auto", so it fits any rank count).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"
CONFIG="ds_configs/wallfacer.json"
if [ $# -gt 0 ] && [[ "$1" == *.json ]]; then CONFIG="$1"; shift; fi
NUM=0
if command -v nvidia-smi >/dev/null 2>&1; then NUM="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"; fi
if [ "$NUM" -gt 0 ]; then
  echo "main.sh: $NUM GPU(s), config $CONFIG"
else
  NUM="${WALLFACER_CPU_RANKS:-4}"
  export DS_ACCELERATOR=cpu
  echo "main.sh: no GPU, $NUM CPU ranks, config $CONFIG"
fi
exec deepspeed --num_gpus "$NUM" launch/train.py --deepspeed_config "$CONFIG" "$@"
