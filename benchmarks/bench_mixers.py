"""Bytes of the mixer layers' exchanges next to attention's, per training step, for the recurrent hybrids (measured).

    python benchmarks/bench_mixers.py                       # 4 CPU ranks, 4K tokens, ring and hybrid (U = 2)
    python benchmarks/bench_mixers.py --seq-len 8192 --modes wallfacer,ulysses

For each family (LFM2: short convolutions; Qwen3.5: gated delta-nets; Granite 4 hybrid: Mamba-2 mixers; each with
three mixer layers and one attention layer, hidden 256) and each sequence-parallel mode, the ranks build the model
through ``initialize`` (ZeRO-1, SGD, fp32) and time three training steps on one sequence. The comm layer's counts of
the last step give the bytes each rank sent by kind: the mixers' halos ("halo") and head-parallel all-to-alls
("heads"), and attention's ring hops, team collectives and Ulysses all-to-alls. The mixers' counted bytes are
checked against the formulas (``mixers.halo_bytes``, ``mixers.head_parallel_bytes``; a mismatch fails the run);
``per_layer`` is one mixer layer's bytes over one attention layer's. The
time is the slowest rank's step, the fastest of the last two steps (a shared machine drifts). Prints a table, writes
``runs/bench/mixers/`` (``--out``: result.json, and plot.png with matplotlib) and ends with one JSON line.
"""
from __future__ import annotations

import argparse
import time
from typing import Any

from harness import add_out_option, emit, plot_path, print_table, run_ranks, save_plot  # first: repository on path

FAMILIES = ("lfm2", "qwen3_5", "granite_hybrid")
MODES = {"wallfacer": {"mode": "wallfacer", "ring_count": 1}, "hybrid": {"mode": "hybrid", "ulysses_degree": 2},
         "ulysses": {"mode": "ulysses"}, "multi-ring": {"mode": "wallfacer", "ring_count": 2}}
HIDDEN = 256
ATTENTION_KINDS = ("all_gather", "reduce_scatter", "ring", "skew", "all_to_all")


def build(family: str) -> Any:
    """Three mixer layers and one attention layer (the second), hidden 256, fp32."""
    import torch

    torch.manual_seed(0)
    common = dict(hidden_size=HIDDEN, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4,
                  vocab_size=256, max_position_embeddings=65536, attn_implementation="sdpa")
    if family == "lfm2":
        from transformers import Lfm2Config, Lfm2ForCausalLM

        return Lfm2ForCausalLM(Lfm2Config(**common, num_hidden_layers=4, conv_L_cache=3,
                                          layer_types=["conv", "full_attention", "conv", "conv"]))
    if family == "qwen3_5":
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        return Qwen3_5ForCausalLM(Qwen3_5TextConfig(
            **common, num_hidden_layers=4, head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8,
            linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"]))
    if family == "granite_hybrid":
        from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

        return GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(
            **common, num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "mamba"], num_local_experts=0,
            mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=4, mamba_d_state=64, mamba_d_conv=4, mamba_expand=2,
            mamba_chunk_size=256))
    raise ValueError(family)


def expected_bytes(model: Any, shards: Any, *, tokens: int, sp_size: int) -> dict[str, int]:
    """The mixers' bytes per rank and step (forward + backward) by the formulas, by kind."""
    from ds_wallfacer.adapters.delta_nets import is_delta_net
    from ds_wallfacer.adapters.mixer_layers import mixer_layers
    from ds_wallfacer.adapters.short_convs import is_short_conv
    from ds_wallfacer.mixers import halo_bytes, head_parallel_bytes

    ring = shards.ring(None)
    out = {"halo": 0, "heads": 0}
    for _, m in mixer_layers(model):
        if is_short_conv(m):
            k = m.conv.kernel_size[0]
            out["halo"] += sum(halo_bytes(ring, rows=1, channels=m.conv.in_channels, kernel=k, element_size=4,
                                          phase=phase) for phase in ("forward", "backward"))
            continue
        if is_delta_net(m):  # q, k, v, b, a in; the core out
            width_in, width_out = 2 * m.key_dim + m.value_dim + 2 * m.num_v_heads, m.value_dim
        else:  # Mamba-2: x, B and C of the groups (sent to every rank reading them), dt in; y out
            groups = max(m.n_groups, sp_size)
            width_in = m.intermediate_size + 2 * groups * m.ssm_state_size + m.num_heads
            width_out = m.intermediate_size
        one = sum(head_parallel_bytes(rows=1, tokens=tokens // sp_size, width=w, element_size=4, sp_size=sp_size)
                  for w in (width_in, width_out))
        out["heads"] += 2 * one  # forward, and the same again backward
    return out


def _rank(rank: int, world: int, spec: dict) -> dict:
    import torch
    import torch.distributed as dist

    from ds_wallfacer.integration import initialize
    from ds_wallfacer.adapters.mixer_layers import mixer_layers
    from ds_wallfacer.adapters.mixer_shards import shards_of

    model = build(spec["family"]).train()
    section = {**MODES[spec["mode"]], "sequence_parallel_size": world, "self_check": False}
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0, "zero_optimization": {"stage": 1},
              "zero_allow_untested_optimizer": True, "wallfacer": section}
    engine, sp = initialize(model=model, config=config, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
                            seq_len=spec["seq_len"])
    ids = torch.randint(1, 256, (1, spec["seq_len"]), generator=torch.Generator().manual_seed(1))
    batch = sp.shard({"input_ids": ids})
    times = []
    for _ in range(3):
        sp.comm.reset()
        dist.barrier()
        t0 = time.perf_counter()
        loss = engine(**batch)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
    sent: dict[str, int] = {}
    for (phase, kind), n in sp.comm.sent.items():
        if phase in ("forward", "backward"):
            sent[kind] = sent.get(kind, 0) + n
    shards = shards_of(mixer_layers(model)[0][1])
    want = expected_bytes(model, shards, tokens=spec["seq_len"], sp_size=len(shards.peers))
    from ds_wallfacer.adapters.hf import attention_modules

    layers = (len(mixer_layers(model)), len(attention_modules(model)))
    engine.destroy()
    return {"sent": sent, "want": want, "step_s": min(times[1:]), "layers": layers}


def run(args: argparse.Namespace) -> list[dict]:
    rows = []
    for family in args.families.split(","):
        for mode in args.modes.split(","):
            spec = {"family": family, "mode": mode, "seq_len": args.seq_len}
            per_rank = run_ranks(_rank, args.ranks, spec, timeout_s=900)
            if per_rank is None:  # a launched non-zero rank
                continue
            mixer = {k: max(r["sent"].get(k, 0) for r in per_rank) for k in ("halo", "heads")}
            want = {k: max(r["want"][k] for r in per_rank) for k in ("halo", "heads")}
            attention = max(sum(r["sent"].get(k, 0) for k in ATTENTION_KINDS) for r in per_rank)
            n_mixers, n_attention = per_rank[0]["layers"]
            if mixer != want:
                raise SystemExit(f"{family} {mode}: counted mixer bytes {mixer} != formula {want}")
            rows.append({"family": family, "mode": mode, "seq_len": args.seq_len, "halo_bytes": mixer["halo"],
                         "heads_bytes": mixer["heads"], "attention_bytes": attention,
                         "mixer_over_attention": (mixer["halo"] + mixer["heads"]) / max(attention, 1),
                         "per_layer": (mixer["halo"] + mixer["heads"]) / n_mixers / max(attention / n_attention, 1),
                         "formula_bytes": want["halo"] + want["heads"],
                         "step_s": max(r["step_s"] for r in per_rank)})
    return rows


def _draw(rows: list[dict], plt: Any) -> Any:
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['family']}\n{r['mode']}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["attention_bytes"] / 2**20 for r in rows], width=0.4, label="attention (1 layer)")
    ax.bar([i + 0.2 for i in x], [(r["halo_bytes"] + r["heads_bytes"]) / 2**20 for r in rows], width=0.4,
           label="mixers (3 layers)")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("MiB sent per rank and step")
    ax.legend()
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--modes", default="wallfacer,hybrid")
    add_out_option(ap, "mixers")
    args = ap.parse_args(argv)
    rows = run(args)
    print_table([("family", "s"), ("mode", "s"), ("seq_len", "d"), ("halo_bytes", "d"), ("heads_bytes", "d"),
                 ("formula_bytes", "d"), ("attention_bytes", "d"), ("mixer_over_attention", ".3f"),
                 ("per_layer", ".3f"), ("step_s", ".3f")],
                [[r[k] for k in ("family", "mode", "seq_len", "halo_bytes", "heads_bytes", "formula_bytes",
                                 "attention_bytes", "mixer_over_attention", "per_layer", "step_s")] for r in rows],
                title=f"bytes per rank and training step, {args.ranks} ranks (mixers: 3 layers; attention: 1 layer)")
    save_plot(plot_path(args), lambda plt: _draw(rows, plt))
    emit({"rows": rows}, args.out / "result.json",
         line={"per_layer": {f"{r['family']}/{r['mode']}": round(r["per_layer"], 4) for r in rows}})


if __name__ == "__main__":
    main()
