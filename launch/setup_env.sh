#!/usr/bin/env bash
# Creates .venv (once) and installs the package with its test and hf (transformers Trainer) extras, every
# dependency at the version constraints.txt pins (the tested set: a release made tomorrow changes nothing here).
# Sourced by main.sh, test.sh and sweep.sh.
# --no-compile: Python compiles a module when it is first imported, so set-up skips byte-compiling every file of
# torch and transformers (about a minute on 2 cores).
# On a machine without an NVIDIA driver, torch is pinned to the CPU build first, so that pip does not
# pull a multi-GB CUDA wheel.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${WALLFACER_VENV:-$ROOT/.venv}"
# DeepSpeed JIT-builds its CPU communication op into torch's extensions folder, shared by every checkout of this
# user: two venvs (two checkouts) would rebuild it in turn, each build invalidating the other's. One per venv.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$VENV/torch_extensions}"
PINS="$ROOT/constraints.txt"
if [ ! -x "$VENV/bin/python" ] || [ ! -f "$VENV/.installed" ] || [ "$ROOT/setup.py" -nt "$VENV/.installed" ] \
   || [ "$PINS" -nt "$VENV/.installed" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip install -q --no-compile -c "$PINS" torch \
      || "$VENV/bin/python" -m pip install -q --no-compile -c "$PINS" torch --index-url https://download.pytorch.org/whl/cpu
  fi
  "$VENV/bin/python" -m pip install -q --no-compile -c "$PINS" -e "$ROOT[test,hf]"
  if ! command -v nvidia-smi >/dev/null 2>&1; then  # CPU ranks: build DeepSpeed's shared-memory op once, now
    DS_ACCELERATOR=cpu "$VENV/bin/python" -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" \
      || echo "setup_env.sh: DeepSpeed's CPU communication op did not build now; the first run will try again"
  fi
  touch "$VENV/.installed"
fi
export PATH="$VENV/bin:$PATH"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export WANDB_MODE="${WANDB_MODE:-offline}"
