#!/usr/bin/env bash
# The main job: the trainer (python -m ds_wallfacer.train) on a tiny Llama and the bundled text, through the
# deepspeed launcher: multi-ring WallFacer (C = 2 over P = 4 ranks) + Mini-Sequence Transformer, ZeRO-2; writes a
# checkpoint, an HF export and an offline wandb run under runs/main, and prints a JSON summary last.
#   launch/main.sh [ds_config.json] [trainer options...]      (later options override the defaults below)
# One rank per GPU where CUDA exists, else 4 CPU ranks (gloo). Default config: ds_configs/main.json (P = 4 x D);
# on a GPU count that is not a multiple of 4 (one GPU: MsT alone), ds_configs/main_auto.json (sizes "auto").
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"
CONFIG="ds_configs/main.json"
if [ $# -gt 0 ] && [[ "$1" == *.json ]]; then CONFIG="$1"; shift; fi
NUM=0
if command -v nvidia-smi >/dev/null 2>&1; then NUM="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"; fi
if [ "$NUM" -gt 0 ]; then
  # main.json fixes P = 4 (C = 2): on a GPU count it does not fit, let the planner size the run instead
  if [ "$CONFIG" = "ds_configs/main.json" ] && [ $((NUM % 4)) -ne 0 ]; then CONFIG="ds_configs/main_auto.json"; fi
  echo "main.sh: $NUM GPU(s), config $CONFIG"
else
  NUM="${WALLFACER_CPU_RANKS:-4}"
  export DS_ACCELERATOR=cpu
  echo "main.sh: no GPU, $NUM CPU ranks, config $CONFIG"
fi
exec deepspeed --num_gpus "$NUM" launch/train.py --deepspeed_config "$CONFIG" --output_dir runs/main \
  --seq_len 512 --steps 30 --save_every 15 --eval_every 10 "$@"
