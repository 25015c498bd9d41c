"""Real vLLM generation through ``WallfacerGRPOTrainer`` on one GPU, against TRL's own ``GRPOTrainer``: part (d) of
``benchmarks/gpu_check.sh``.

    python benchmarks/vllm_check.py --out runs/bench/gpu_check     # both modes, a few minutes
    python benchmarks/vllm_check.py --modes colocate                # one of them

Needs vllm (TRL's range, 0.22-0.31), trl, deepspeed, peft and datasets; without vllm it prints why it skips and
exits 0. One GPU holds one NCCL rank, so the trainers run with P = 1 (``"sequence_parallel_size": 1``): these runs
check the parts a CPU cannot (vLLM's engine and server, the NCCL weight transfer from the ZeRO-3 partitions, TRL's
colocated engine in the trainer's process), not the split over a group, which the CPU tests check
(``tests/hf_trainer/test_trl_vllm.py`` for the server protocol, the parity tests for the split).

The model: a tiny Llama with 64-dimensional heads (vLLM's attention kernels need that much), saved in bf16 with the
byte-level chat tokenizer; the trainers load it in fp32 and train a LoRA adapter that starts away from the base model
(so the engine's weights from disk are wrong until TRL pushes the merged ones) with the KL term (beta 0.1), ZeRO-3,
3 steps of 2 micro-batches of 8 completions (4 per prompt, 12 tokens at most), decoding greedily
(``generation_kwargs={"temperature": 0.0}``). Server mode: ``vllm serve`` on the same GPU (TRL's command line,
``trl.scripts.vllm_serve.build_command``: dev mode, the NCCL weight-transfer engine, processed log-probabilities) with
a small ``gpu_memory_utilization``; TRL's trainer, then ours, against it. Colocate mode: each trainer with its own
engine in its process (``vllm_gpu_memory_utilization`` small as well). Each trainer runs in its own process.

Verdicts per mode: both runs finished; the weights reached vLLM (GRPO's ``sampling/sampling_logp_difference/mean``,
the engine's log-probability of a generated token against the trainer's, stays below 0.1 at every step: against the
stand-in server of the CPU tests it is 1e-6 with the pushes and 0.4-1.2 without them, the engine keeping the disk's
weights); the completions table equals TRL's; the largest relative loss difference to TRL's.
Prints one line per verdict, then one JSON line (also written to OUT/vllm_check.json).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import emit, free_port  # noqa: E402

MODEL = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False)
"""The checked model: 64-dimensional heads; the byte-level vocabulary of the chat tokenizer."""
MAX_MODEL_LEN = 512
GPU_MEMORY = 0.15
"""The engine's share of the GPU (the trainer's tiny model needs little)."""
LOGP_TOLERANCE = 0.1
"""bf16 engine against fp32 trainer: the mean log-probability gap of a generated token with the right weights."""


def write_model(folder: Path) -> None:
    """The tiny Llama (seed 0) in bf16 and the chat tokenizer, with NUL as end of sequence."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from ds_wallfacer.hf_trainer.chat import chat_tokenizer

    torch.manual_seed(0)
    tok = chat_tokenizer()
    model = LlamaForCausalLM(LlamaConfig(**MODEL, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                         bos_token_id=None))
    model.to(torch.bfloat16).save_pretrained(folder)
    GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id).save_pretrained(folder)
    tok.save_pretrained(folder)
    # readable by the transformers an installed vLLM brings too (older ones know torch_dtype and this class name)
    for name, keys in (("config.json", {"torch_dtype": "bfloat16"}),
                       ("tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast"})):
        path = folder / name
        path.write_text(json.dumps({**json.loads(path.read_text()), **keys}, indent=2))


def start_server(folder: Path, port: int, log: Path) -> subprocess.Popen:
    """``vllm serve`` as TRL runs it, on this GPU, answering on ``port`` once healthy (up to 5 minutes)."""
    import requests
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    command = build_command(ScriptArguments(model=str(folder), host="127.0.0.1", port=port, dtype="bfloat16",
                                            gpu_memory_utilization=GPU_MEMORY, max_model_len=MAX_MODEL_LEN,
                                            enforce_eager=True, log_level="warning"))
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    server = subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {server.returncode}: see {log}")
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except requests.exceptions.RequestException:
            pass
        time.sleep(2)
    server.kill()
    raise RuntimeError(f"vllm serve did not answer in 5 minutes: see {log}")


def stop_server(server: subprocess.Popen) -> None:
    """The server and its engine process (its own session)."""
    import signal

    try:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def row_bonus(completions: list, **kwargs: Any) -> list[float]:
    """0, 0.1, 0.2, 0.3 by the row's place among each 4: greedy completions of a prompt are alike; this keeps the
    advantages and the reward statistics from being degenerate."""
    return [0.1 * (i % 4) for i in range(len(completions))]


def train(trainer_kind: str, mode: str, folder: str, port: int, out: str) -> dict[str, Any]:
    """One run in this process (rank 0 of 1 on GPU 0): ``trl`` or ``wallfacer``, ``mode`` server or colocate."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from ds_wallfacer.hf_trainer import WallfacerGRPOTrainer
    from ds_wallfacer.hf_trainer.chat import chat_tokenizer
    from ds_wallfacer.hf_trainer.rl_data import arithmetic_reward, make_prompts

    ds: dict[str, Any] = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                          "train_batch_size": "auto", "gradient_clipping": "auto",
                          "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": 3},
                          "optimizer": {"type": "SGD", "params": {"lr": "auto"}}}
    if trainer_kind == "wallfacer":
        ds["wallfacer"] = {"mode": "wallfacer", "sequence_parallel_size": 1}
    args = GRPOConfig(
        output_dir=out, per_device_train_batch_size=8, gradient_accumulation_steps=2, max_steps=3, learning_rate=0.5,
        lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1, report_to=[], seed=0, disable_tqdm=True,
        bf16=False, save_strategy="no", deepspeed=ds, num_generations=4, max_completion_length=12, temperature=1.0,
        beta=0.1, gradient_checkpointing=False, use_vllm=True, vllm_mode=mode,
        vllm_server_base_url=f"http://127.0.0.1:{port}", vllm_gpu_memory_utilization=GPU_MEMORY,
        vllm_max_model_length=MAX_MODEL_LEN, generation_kwargs={"temperature": 0.0},
    )
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    torch.manual_seed(1)  # the adapter: the same in both runs, away from the base model (B random too)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"])
    cls = WallfacerGRPOTrainer if trainer_kind == "wallfacer" else GRPOTrainer
    trainer = cls(model=model, args=args, processing_class=chat_tokenizer(), peft_config=lora,
                  reward_funcs=[arithmetic_reward, row_bonus],
                  train_dataset=Dataset.from_list(make_prompts(16, seed=1, filler=1)))
    trainer.train()
    table = trainer._logs  # TRL's completions table (the last round)
    return {"logs": [h for h in trainer.state.log_history if "loss" in h],
            "table": {"prompt": list(table["prompt"]), "completion": list(table["completion"])},
            "rollouts": trainer.rollout_stats() if trainer_kind == "wallfacer" else None}


def run_child(trainer_kind: str, mode: str, folder: Path, port: int, out: Path) -> dict[str, Any]:
    """``train`` in a fresh process (its own GPU memory, its own process group); its result or its error."""
    result, log = out / f"{mode}_{trainer_kind}.json", out / f"{mode}_{trainer_kind}.log"
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, __file__, "--child", trainer_kind, "--modes", mode, "--model", str(folder),
               "--port", str(port), "--out", str(out)]
    with log.open("w") as f:
        code = subprocess.run(command, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=420).returncode
    if code != 0 or not result.exists():
        tail = log.read_text(errors="replace").splitlines()[-8:]
        return {"error": f"exit {code}: " + " | ".join(tail)}
    return json.loads(result.read_text())


def verdicts(mode: str, ref: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    """The mode's verdicts (module docstring), printed and returned."""
    if "error" in ref or "error" in got:
        out = {"ran": False, "trl": ref.get("error", "ok"), "wallfacer": got.get("error", "ok")}
        print(f"vLLM {mode}: a run failed: {out}")
        return out
    gap, ref_gap = (max(h.get("sampling/sampling_logp_difference/mean", float("inf")) for h in run["logs"])
                    for run in (got, ref))
    worst = max(h.get("sampling/sampling_logp_difference/max", float("inf")) for h in got["logs"])
    losses = [(a["loss"], b["loss"]) for a, b in zip(ref["logs"], got["logs"])]
    rel = max(abs(a - b) / max(abs(a), 1e-12) for a, b in losses) if losses else float("nan")
    out = {"ran": len(got["logs"]) == len(ref["logs"]) == 3, "weights_reached_vllm": gap < LOGP_TOLERANCE,
           "logp_gap_mean": gap, "logp_gap_max": worst, "trl_logp_gap_mean": ref_gap,
           "table_equal": got["table"] == ref["table"],
           "loss_rel_diff_max": rel, "rollouts": got.get("rollouts")}
    print(f"vLLM {mode}: ran {out['ran']}; weights reached vLLM {out['weights_reached_vllm']} (log-prob gap: mean "
          f"{gap:.3g} at worst step, largest {worst:.3g}; TRL's run {ref_gap:.3g}; tolerance {LOGP_TOLERANCE} on the "
          f"mean); completions equal TRL's "
          f"{out['table_equal']}; largest relative loss difference {rel:.2e}")
    return out


def check(modes: list[str], out: Path) -> dict[str, Any]:
    """Both trainers in each mode; the verdicts."""
    folder = out / "vllm_model"
    write_model(folder)
    found: dict[str, Any] = {}
    for mode in modes:
        port, server = free_port(), None
        try:
            if mode == "server":
                server = start_server(folder, port, out / "vllm_server.log")
            ref = run_child("trl", mode, folder, port, out)
            got = run_child("wallfacer", mode, folder, port, out)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            ref, got = {"error": str(e)}, {"error": str(e)}
        finally:
            if server is not None:
                stop_server(server)
        found[mode] = verdicts(mode, ref, got)
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "runs" / "bench" / "gpu_check"))
    p.add_argument("--modes", default="server,colocate", help="server, colocate or both (comma-separated)")
    p.add_argument("--child", choices=("trl", "wallfacer"), help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.child:  # one run, in the process run_child started
        result = train(args.child, args.modes, args.model, args.port, str(out / f"{args.modes}_{args.child}"))
        (out / f"{args.modes}_{args.child}.json").write_text(json.dumps(result))
        return 0
    import importlib.util
    import signal

    if importlib.util.find_spec("vllm") is None:
        print("vLLM checks skipped: vllm is not installed here (pip install 'trl[vllm]' with deepspeed and peft; "
              "TRL supports vllm 0.22-0.31)")
        emit({"summary": "vllm_check", "skipped": "vllm not installed"}, out / "vllm_check.json")
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's TERM still stops the server (finally)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    emit({"summary": "vllm_check", **check(modes, out)}, out / "vllm_check.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
