#!/usr/bin/env bash
# The GPU checks of the attention core and of vLLM generation in one run on a lent H200 (about 5 minutes, under 8 with every cap hit;
# (a)-(c) need no DeepSpeed and no network):
#  (a) the CUDA tests: every block-kernel backend this machine runs against the float32 reference, cuDNN masks,
#      the Triton merge against the PyTorch merge, varlen calls (packed documents) against a call per span;
#  (b) block kernels' fwd+bwd TFLOP/s at 4K and 16K tokens, causal, bf16, 32/8 heads, d = 128 (target >= 550 at 16K);
#  (c) WallFacer attention at P = 1 against its bare block kernel at 16K and 128K tokens (target ratio <= 1.03);
#  (d) vLLM generation (server and colocated) through WallfacerGRPOTrainer against TRL's GRPOTrainer on this one GPU
#      (benchmarks/vllm_check.py, a few minutes; it also runs alone): needs vllm, trl, deepspeed, peft and datasets,
#      skipped with a message where vllm is not installed (the lent machines' image has none of them).
# Results: logs and JSON under $OUT (default runs/bench/gpu_check), verdicts last.
#
# Optional backends travel as wheels in .whl/ (or $WHEELS): installed with --no-deps into /tmp/site. flash-attn-4
# needs flash_attn_4, nvidia_cutlass_dsl, nvidia_cutlass_dsl_libs_base, nvidia_cutlass_dsl_libs_cu13 (92 MB: more
# than one call carries, so split it with `split -b 40M WHEEL WHEEL.part-`, copy the first part(s) to
# /tmp/wf_parts in one call and carry the rest in the next; parts found in .whl/ or $WF_PARTS are joined here),
# quack_kernels, apache_tvm_ffi, torch_c_dlpack_ext. FlashAttention-3 has no wheel on PyPI (built from source).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-runs/bench/gpu_check}"; mkdir -p "$OUT"
WHEELS="${WHEELS:-.whl}"; WF_PARTS="${WF_PARTS:-/tmp/wf_parts}"

# -- optional wheels ----------------------------------------------------------------------------------------------
shopt -s nullglob
mkdir -p /tmp/wf_join
for first in "$WHEELS"/*.whl.part-aa "$WF_PARTS"/*.whl.part-aa; do  # split -b names parts aa, ab, ...
  whl=$(basename "${first%.part-aa}")
  printf '%s\n' "$WHEELS/$whl".part-* "$WF_PARTS/$whl".part-* | awk -F/ '!seen[$NF]++ {print $NF"\t"$0}' | sort \
    | cut -f2 | xargs cat > "/tmp/wf_join/$whl"
done
wheels=("$WHEELS"/*.whl /tmp/wf_join/*.whl)
shopt -u nullglob
if [ ${#wheels[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "${wheels[@]}" 2>&1 | tail -3
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

{
  nvidia-smi -L
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), torch.cuda.get_device_name())"
  python3 - <<'EOF'
import importlib
for mod in ("triton", "flash_attn", "flash_attn_interface", "flash_attn.cute"):
    try:
        m = importlib.import_module(mod)
        print(f"{mod}: {getattr(m, '__version__', 'present')}")
    except Exception as e:  # noqa: BLE001
        print(f"{mod}: not available ({type(e).__name__}: {str(e)[:80]})")
EOF
} 2>&1 | tee "$OUT/environment.log"

# (a) CUDA tests (each backend skips itself where it does not run)
timeout 240 python3 -m pytest -q -rs -p no:cacheprovider tests/attention/test_kernels.py \
  tests/attention/test_fast_kernels.py tests/attention/test_merge.py tests/attention/test_fetch.py \
  tests/attention/test_spans.py \
  -k "cuda or interpreter" 2>&1 \
  | tee "$OUT/pytest_cuda.log" | tail -25

# (b) block kernels at 4K and 16K, causal, bf16, 32/8 heads, d = 128
timeout 150 python3 benchmarks/bench_kernels.py --seq-lens 4096,16384 --heads 32 --kv-heads 8 --head-dim 128 \
  --dtypes bf16 --causal only --iters 5 --json "$OUT/bench_kernels.json" 2>&1 | tee "$OUT/bench_kernels.log" | tail -14

# (c) WallFacer at P = 1 against its bare kernel, 16K and 128K
timeout 150 python3 benchmarks/bench_p1.py --seq-lens 16384,131072 --heads 32 --kv-heads 8 --head-dim 128 --dtype bf16 \
  --iters 3 --json "$OUT/bench_p1.json" 2>&1 | tee "$OUT/bench_p1.log" | tail -6

# (d) vLLM, server and colocated, one GPU (skips itself without vllm)
timeout 480 python3 benchmarks/vllm_check.py --out "$OUT" 2>&1 | tee "$OUT/vllm_check.log" | tail -4

python3 benchmarks/gpu_check_summary.py "$OUT" 2>&1 | tee "$OUT/summary.log"
