#!/usr/bin/env bash
# The test command: sets up .venv if needed, then runs the whole suite (CPU, gloo; CUDA tests skip).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"
exec python -m pytest tests -q -ra --durations=25 "$@"
