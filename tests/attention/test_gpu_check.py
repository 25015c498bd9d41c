"""benchmarks/gpu_check.sh runs only on a lent GPU, so its parts are checked here on CPU: the script parses, and its
Python programs run end to end at toy sizes and produce what the summary reads."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, tmp: Path) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, *args], cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return res.stdout


def test_gpu_check_script_parses_and_names_its_programs():
    script = ROOT / "benchmarks" / "gpu_check.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    for program in ("benchmarks/bench_kernels.py", "benchmarks/bench_p1.py", "benchmarks/gpu_check_summary.py"):
        assert program in text and (ROOT / program).exists()


def test_gpu_check_programs_run_on_cpu_and_summarize(tmp_path: Path):
    _run(str(ROOT / "benchmarks" / "bench_kernels.py"), "--seq-lens", "128", "--heads", "4", "--kv-heads", "2",
         "--head-dim", "32", "--dtypes", "fp32", "--causal", "only", "--iters", "1", "--json",
         str(tmp_path / "bench_kernels.json"), "--out", str(tmp_path / "kernels"), tmp=tmp_path)
    out = _run(str(ROOT / "benchmarks" / "bench_p1.py"), "--seq-lens", "256", "--heads", "4", "--kv-heads", "2",
               "--head-dim", "32", "--iters", "1", "--json", str(tmp_path / "bench_p1.json"), "--out",
               str(tmp_path / "p1"), tmp=tmp_path)
    row = json.loads(out.strip().splitlines()[-1])["rows"][0]
    assert row["kernel"] == "cpu_flash" and row["max_abs_diff"] < 1e-5 and row["ratio"] > 0
    summary = json.loads(_run(str(ROOT / "benchmarks" / "gpu_check_summary.py"), str(tmp_path), tmp=tmp_path)
                         .strip().splitlines()[-1])
    assert "cpu_flash" in summary["kernels_128"] and summary["p1_ratio_256"] > 0
    assert json.loads((tmp_path / "p1" / "result.json").read_text())["rows"][0]["ratio"] == row["ratio"]
