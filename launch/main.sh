#!/usr/bin/env bash
# The main job: the trainer (python -m ds_wallfacer.train) on a tiny Llama and the bundled text, through the
# deepspeed launcher: multi-ring WallFacer (C = 2 over P = 4 ranks) + Mini-Sequence Transformer, ZeRO-2; writes a
# checkpoint, an HF export and an offline wandb run under runs/main, and prints a JSON summary last.
#   launch/main.sh [ds_config.json] [trainer options...]      (later options override the defaults below)
# One rank per GPU where CUDA exists, else 4 CPU ranks (gloo). Default config: ds_configs/main.json (4 ranks;
# pass ds_configs/wallfacer.json, whose sizes are "auto", for another rank count).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"
CONFIG="ds_configs/main.json"
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
exec deepspeed --num_gpus "$NUM" launch/train.py --deepspeed_config "$CONFIG" --output_dir runs/main \
  --seq_len 512 --steps 30 --save_every 15 --eval_every 10 "$@"
