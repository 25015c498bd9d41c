#!/usr/bin/env bash
# The early warning, outside .ci/run (which stays on the pinned set): a second venv (.venv-latest) with the newest
# release of every dependency, ignoring constraints.txt and setup.py's upper ends, runs the model tests and the sweep
# there, then prints which classes changed verdict against docs/models.md and which releases differ from the pins.
# Run it before closing any change; about 20-25 minutes on 2 cores. Output and tables under runs/latest/.
#   bash launch/test_latest.sh [extra pytest options for the model tests]
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${WALLFACER_LATEST_VENV:-$ROOT/.venv-latest}"
OUT="$ROOT/runs/latest"
mkdir -p "$OUT"
export TORCH_EXTENSIONS_DIR="$VENV/torch_extensions"
PY="$VENV/bin/python"
[ -x "$PY" ] || python3 -m venv "$VENV" || exit 1
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q --upgrade -e "$ROOT[test,hf]" || exit 1
# then the direct dependencies (setup.py's, with the test and hf extras) to their newest releases, past setup.py's
# upper ends; pip resolves what they need beside them
DIRECT="$("$PY" - "$ROOT/setup.py" <<'PY'
import ast, re, sys
tree = ast.parse(open(sys.argv[1]).read())
kw = {k.arg: k.value for n in ast.walk(tree) if isinstance(n, ast.Call) for k in n.keywords if k.arg}
reqs = list(ast.literal_eval(kw["install_requires"]))
extras = ast.literal_eval(kw["extras_require"])
reqs += extras["test"] + extras["hf"]
print(" ".join(re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0] for r in reqs))
PY
)"
"$PY" -m pip install -q --upgrade --upgrade-strategy eager $DIRECT || exit 1
"$PY" -m pip check > "$OUT/pip_check.txt" 2>&1 || true   # lists releases past setup.py's ranges
if ! command -v nvidia-smi >/dev/null 2>&1; then
  DS_ACCELERATOR=cpu "$PY" -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null 2>&1 || true
fi
"$PY" -m pip freeze --exclude-editable > "$OUT/freeze.txt"
export PATH="$VENV/bin:$PATH" OMP_NUM_THREADS=1 WANDB_MODE=offline
cd "$ROOT"
status=0
echo "== model tests (tests/adapters, tests/audit, tests/integration, tests/mixers) on the newest releases"
python -m pytest tests/adapters tests/audit tests/integration tests/mixers -q -p no:cacheprovider "$@" 2>&1 \
  | tee "$OUT/model_tests.txt" | tail -25 || status=1
echo "== the sweep on the newest releases (table: runs/latest/models.md)"
WALLFACER_SWEEP=1 WALLFACER_SWEEP_TABLE="$OUT/models.md" python -m pytest tests/sweep -q -ra -s -p no:cacheprovider \
  > "$OUT/sweep.txt" 2>&1 || status=1
tail -25 "$OUT/sweep.txt"
echo "== what changed"
[ -f "$OUT/models.md" ] && python -m tests.sweep.run --compare docs/models.md "$OUT/models.md"
echo "releases that differ from constraints.txt:"
python - "$ROOT/constraints.txt" "$OUT/freeze.txt" <<'PY'
import sys
def pins(path):
    out = {}
    for line in open(path):
        name, sep, version = line.strip().partition("==")
        if sep and not line.startswith("#"):
            out[name.lower().replace("_", "-")] = version
    return out
old, new = pins(sys.argv[1]), pins(sys.argv[2])
differ = [n for n in sorted(old.keys() | new.keys()) if old.get(n, "").split("+")[0] != new.get(n, "").split("+")[0]]
runtime = [n for n in differ if n.startswith(("nvidia-", "cuda-", "triton")) and n not in old]  # a CUDA torch's own
changed = [f"  {n}: {old.get(n, '-')} -> {new.get(n, '-')}" for n in differ if n not in runtime]
if runtime:
    changed.append(f"  and {len(runtime)} packages of torch's CUDA runtime ({', '.join(runtime[:3])}, ...)")
print("\n".join(changed) or "  none: the pinned set is the newest")
PY
[ -s "$OUT/pip_check.txt" ] && { echo "pip check:"; sed 's/^/  /' "$OUT/pip_check.txt"; }
echo "test_latest.sh: $([ $status -eq 0 ] && echo passed || echo FAILED) (runs/latest/)"
exit $status
