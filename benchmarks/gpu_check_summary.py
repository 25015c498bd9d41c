"""The verdict lines of ``benchmarks/gpu_check.sh``: block-kernel speed and WallFacer's P = 1 overhead against
targets.

    python benchmarks/gpu_check_summary.py OUT_DIR    # reads bench_kernels.json, bench_p1.json, vllm_check.json

Targets: the fastest block kernel at >= 550 TFLOP/s fwd+bwd at 16K tokens (causal, bf16; PyTorch's cuda_sdpa path
measured 311 on an H200), WallFacer at P = 1 within 1.03x of its bare kernel, and (``vllm_check.json``) vLLM's runs
in both modes finished, with the trained weights in vLLM and TRL's completions. Prints one line per check and
a last JSON line (also written to OUT_DIR/summary.json); a missing result file is reported, not fatal.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from harness import emit

TARGET_TFLOPS = 550.0
TARGET_RATIO = 1.03


def summarize(out_dir: str | Path) -> dict:
    out = Path(out_dir)
    verdict: dict = {}
    kernels = out / "bench_kernels.json"
    if kernels.exists():
        rows = [r for r in json.loads(kernels.read_text())["rows"] if r.get("causal") and not r.get("failed")]
        for n in sorted({r["seq_len"] for r in rows}):
            at = sorted((r for r in rows if r["seq_len"] == n), key=lambda r: -r["tflops"])
            verdict[f"kernels_{n}"] = {r["kernel"]: round(r["tflops"], 1) for r in at}
            if at:
                best = at[0]
                ok = best["tflops"] >= TARGET_TFLOPS if n >= 16384 else None
                mark = "" if ok is None else (" (target >= 550: met)" if ok else " (target >= 550: NOT met)")
                print(f"block kernels, {n} tokens causal: " + ", ".join(f"{k} {t}" for k, t in
                                                                      verdict[f"kernels_{n}"].items()) + mark)
    else:
        print(f"no {kernels}")
    p1 = out / "bench_p1.json"
    if p1.exists():
        for r in json.loads(p1.read_text())["rows"]:
            if "failed" in r:
                print(f"WallFacer P = 1, {r['seq_len']} tokens: {r['failed']}")
                continue
            verdict[f"p1_ratio_{r['seq_len']}"] = round(r["ratio"], 4)
            print(f"WallFacer P = 1 / bare {r['kernel']}, {r['seq_len']} tokens: {r['ratio']:.3f} "
                  f"(target <= {TARGET_RATIO}: {'met' if r['ratio'] <= TARGET_RATIO else 'NOT met'})")
    else:
        print(f"no {p1}")
    verdict.update(_vllm_verdicts(out / "vllm_check.json"))
    emit(dict(summary="gpu_check", **verdict), out / "summary.json")
    return verdict


def _vllm_verdicts(path: Path) -> dict:
    """``vllm_check.py``'s verdicts per mode (it printed them in full): one line each."""
    if not path.exists():
        print(f"no {path}")
        return {}
    found = json.loads(path.read_text())
    if "skipped" in found:
        print(f"vLLM: skipped ({found['skipped']})")
        return {"vllm": "skipped"}
    out = {}
    for mode in ("server", "colocate"):
        v = found.get(mode)
        if v is None:
            continue
        ok = bool(v.get("ran")) and bool(v.get("weights_reached_vllm")) and bool(v.get("table_equal"))
        out[f"vllm_{mode}"] = "met" if ok else "NOT met"
        print(f"vLLM {mode}: ran, weights reached vLLM and completions equal TRL's: {out[f'vllm_{mode}']}")
    return out


if __name__ == "__main__":
    summarize(sys.argv[1] if len(sys.argv) > 1 else "runs/bench/gpu_check")
