"""The sweep as a test target of its own (``bash launch/sweep.sh``; skipped in the main suite): every causal-LM
class of the installed transformers trains exactly on 4 ranks or is refused at start-up on every rank; nothing
trains wrong, fails after start-up or hangs. The classic transformers must be exact, so refusing everything
cannot pass."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(os.environ.get("WALLFACER_SWEEP") != "1",
                                reason="the sweep is its own target: bash launch/sweep.sh")

MUST_BE_EXACT = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "Qwen3MoeForCausalLM", "MixtralForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                 "Phi3ForCausalLM", "GPTNeoXForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM",
                 "SmolLM3ForCausalLM", "Glm4MoeForCausalLM", "Exaone4ForCausalLM", "GraniteForCausalLM",
                 "GptOssForCausalLM", "DeepseekV3ForCausalLM", "Llama4ForCausalLM", "Lfm2ForCausalLM",
                 "Lfm2MoeForCausalLM", "Lfm3ForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM",
                 "Qwen3_5MoeForCausalLM", "Mamba2ForCausalLM",
                 "BambaForCausalLM", "GraniteMoeHybridForCausalLM", "NemotronHForCausalLM", "Zamba2ForCausalLM",
                 "FalconH1ForCausalLM", "OlmoHybridForCausalLM", "LaraMiniForCausalLM")
MUST_BE_REFUSED = ("RecurrentGemmaForCausalLM",
                   "MiniMaxForCausalLM")


def test_every_causal_lm_is_exact_or_refused(tmp_path: Path) -> None:
    from tests.sweep.run import PASSING, recogniser_misses, run, write_table

    rows = run()
    table = Path(os.environ.get("WALLFACER_SWEEP_TABLE") or tmp_path / "models.md")
    write_table(rows, table)
    bad = [f"{r.cls}: {r.verdict}: {r.detail}" for r in rows if r.verdict not in PASSING]
    assert not bad, "\n".join(bad)
    verdict = {r.cls: r.verdict for r in rows}
    not_exact = [r for r in rows if r.cls in MUST_BE_EXACT and r.verdict != "exact"]
    missing = [c for c in MUST_BE_EXACT if c not in verdict]
    assert not not_exact and not missing, "\n".join(
        [f"{r.cls}: {r.verdict}: {r.detail}" + "".join(f"\n    {m}" for m in recogniser_misses(r.model_type, r.cls))
         for r in not_exact] + [f"{c}: not in this transformers" for c in missing])
    assert [c for c in MUST_BE_REFUSED if verdict.get(c) != "refused"] == []
