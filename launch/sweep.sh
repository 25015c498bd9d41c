#!/usr/bin/env bash
# The sweep over transformers (its own target, outside the main suite): every causal-LM class of the installed
# transformers, tiny, trained on 4 CPU ranks, must be exact or refused at start-up. About 10-15 minutes on 2 cores.
# WALLFACER_SWEEP_TABLE=docs/models.md also rewrites the supported-models table.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"
export WALLFACER_SWEEP=1
exec python -m pytest tests/sweep -q -ra -s "$@"
