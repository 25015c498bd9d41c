"""The paper's worked example and configurations, through the planner's cost model.

``worked_example`` reproduces the paper's figures (docs/design/attention.md; Llama-30B, N = 64Ki, P = 64, C = 4, bf16): the
paper prints GiB (2^30 bytes) and counts P ring hops (and P/C^2 sub-ring hops), one more than its own formulas.
``comparisons`` predicts ring vs WallFacer C = 2 / 4 vs Ulysses vs the hybrid on the paper's clusters.
"""
from __future__ import annotations

from typing import Any

from ..attention.volume import AttnShape
from .candidate import Strategy, Workload
from .cost import paper_figures
from .model import MODELS
from .search import PlanError, plan

__all__ = ["PAPER_SETTINGS", "PUBLISHED_GPT_SPEEDUP", "comparisons", "speedup_table", "worked_example"]

PAPER_SETTINGS = (
    # (cluster, model, P, N): 8x8 H100 + IB and 4x8 A100 + Ethernet at 64K-128K; one NVLink node for contrast
    ("h100x64", "llama-30b-like", 64, 65536),
    ("h100x64", "llama-30b-like", 64, 131072),
    ("h100x64", "llama-30b-like", 32, 65536),
    ("h100x64", "llama-30b-like", 32, 131072),
    ("h100x64", "llama-30b-like", 8, 65536),  # one SP group per node (data parallel 8): NVLink only
    ("a100x32-eth", "llama-30b-like", 32, 65536),
    ("a100x32-eth", "llama-30b-like", 32, 131072),
    ("h100x64", "llama3-8b", 64, 131072),
    ("h100x64", "llama3-8b", 8, 131072),
)


PUBLISHED_GPT_SPEEDUP = 1.7712
"""The paper's best measured throughput gain of WallFacer over ring attention on GPT-style models, +77.12 % (its
abstract; +114.33 % on DiT). Its per-setting figures are not reproduced here: every setting is compared with this
upper bound."""


def speedup_table(rows: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Per paper setting: the best multi-ring row's predicted step speedup over ring (and attention alone), against
    the paper's best published gain, with what the model says makes the difference (ring's exposed
    communication as a share of its step, tokens per rank)."""
    out = []
    for r in rows if rows is not None else comparisons():
        if "error" in r:
            continue
        fams = r["families"]
        ring = fams.get("ring")
        multi = [(f, d) for f, d in fams.items() if f.startswith("wallfacer C=") and d["speedup_vs_ring"]]
        if not ring or not multi:
            continue
        fam, best = max(multi, key=lambda fd: fd[1]["speedup_vs_ring"])
        pred = best["speedup_vs_ring"]
        share = ring.get("exposed_comm_s", 0.0) / ring["step_s"] if ring["step_s"] else 0.0
        tokens = r["seq_len"] // r["sp_size"]
        if abs(pred / PUBLISHED_GPT_SPEEDUP - 1) <= 0.25:
            why = "within 25 % of the paper's best"
        elif pred < PUBLISHED_GPT_SPEEDUP:
            why = (f"below the paper's best, which is a maximum over its settings: ring hides most of its hops here "
                   f"({share:.0%} of its step exposed at {tokens} tokens per rank)")
        else:
            why = (f"ring is communication-bound in the model ({share:.0%} of its step exposed at {tokens} tokens "
                   f"per rank: its hops outlast the block kernels), so C-fold fewer bytes pay almost in full; the "
                   f"paper measured at most +77 %")
        out.append({"cluster": r["cluster"], "model": r["model"], "sp_size": r["sp_size"], "seq_len": r["seq_len"],
                    "best_multi_ring": fam, "config": best["config"], "predicted_speedup": pred,
                    "predicted_attention_speedup": best["attn_speedup_vs_ring"],
                    "paper_best_speedup": PUBLISHED_GPT_SPEEDUP, "ratio_to_paper": pred / PUBLISHED_GPT_SPEEDUP,
                    "ring_exposed_share": share, "tokens_per_rank": tokens, "explanation": why})
    return out


def worked_example() -> dict[str, float]:
    """Forward bytes per rank per layer of the paper's example (see ``cost.paper_figures``)."""
    m = MODELS["llama-30b-like"]
    shape = AttnShape(batch=1, seq_len=65536, q_heads=m.heads, kv_heads=m.kv_heads, head_dim=m.head_dim, elem_bytes=2)
    return paper_figures(shape, sp_size=64, ring_count=4)


def _family(row: Any) -> str:
    # multi-ring WallFacer is one family per ring count (the paper compares C = 2, 4, ... with ring); hybrid is one
    c = row.candidate
    return f"{c.strategy} C={c.ring_count}" if c.strategy is Strategy.WALLFACER else str(c.strategy)


def comparisons(*, overlap: bool = True, settings=PAPER_SETTINGS) -> list[dict[str, Any]]:
    """Per setting, the best fitting row of each family (ring, wallfacer C=2, C=4, ..., ulysses, hybrid) at
    SP size P (MsT and checkpointing on, as in long-sequence training), with its speedup over ring."""
    out = []
    for cluster, model, p, n in settings:
        workload = Workload(seq_len=n, overlap=overlap)
        fixed = {"sp_size": p, "mini_sequence": True, "activation_checkpointing": True}
        try:
            pl = plan(cluster, model, n, world_size=None, fixed=fixed, workload=workload)
        except PlanError as e:
            out.append({"cluster": cluster, "model": model, "sp_size": p, "seq_len": n, "error": str(e)})
            continue
        best: dict[str, Any] = {}
        for row in pl.rows:
            best.setdefault(_family(row), row)
        ring = best.get("ring")
        fams = {}
        for fam, row in best.items():
            k = row.cost
            fams[fam] = {
                "config": row.candidate.label, "fits": row.fits, "reason": row.reason, "step_s": k.step_s,
                "exposed_comm_s": k.exposed_comm_s, "compute_s": k.compute_s,
                "attn_layer_s": k.attn_layer_s, "comm_bytes_per_step": k.step_bytes,
                "speedup_vs_ring": ring.cost.step_s / k.step_s if ring and row.fits else None,
                "attn_speedup_vs_ring": ring.cost.attn_layer_s / k.attn_layer_s if ring and row.fits else None,
            }
        winner = pl.rows[0].candidate.label
        out.append({"cluster": cluster, "model": model, "sp_size": p, "seq_len": n, "overlap": overlap,
                    "families": fams, "best": winner, "skipped": list(pl.skipped)})
    return out
