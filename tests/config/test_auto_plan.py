""""auto" values resolved by the topology planner at start-up: the planner's choice becomes the layout,
the user's values are respected, the planner's errors fall back to the safe rule with the message in the notes,
and the "ring-inner" placement maps ranks and data shards consistently. Pure: no processes."""
from __future__ import annotations

from pathlib import Path

import dataclasses

import pytest

from ds_wallfacer.comm.dims import ParallelDims
from ds_wallfacer.config import PLACEMENTS, WallFacerConfig, parse_ds_config
from ds_wallfacer.planner.auto import ParallelSetup, PlanInputs, resolve_auto

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "ds_configs").glob("*.json"))

# launch/train.py's model, as an HF config dict (8 query / 4 kv heads)
TINY = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 8,
        "num_key_value_heads": 4, "intermediate_size": 256, "vocab_size": 256}


def _resolve(section: dict, *, world: int = 8, seq_len: int | None = 4096, rpn: int | None = 8,
             heads: tuple[int, int] = (8, 4), **plan_kw) -> ParallelSetup:
    plan_kw = {"model": TINY, "seq_len": seq_len, "environ": {}, **plan_kw}
    return resolve_auto(WallFacerConfig.from_dict(section), world_size=world, num_heads=heads[0],
                        num_kv_heads=heads[1], ranks_per_node=rpn, planner_inputs=PlanInputs(**plan_kw))


def test_auto_is_resolved_by_the_planner() -> None:
    from ds_wallfacer import planner

    lay = _resolve({"mode": "auto", "cluster": "h100x8"})
    assert lay.planner_choice is not None and lay.dims.world_size == 8
    assert lay.dims.mode in ("wallfacer", "ulysses", "hybrid") and lay.dims.placement in PLACEMENTS
    assert lay.notes[0].startswith("planner chose mode = ")
    assert "cluster h100x8" in lay.notes[0] and "seq_len 4096" in lay.notes[0]
    assert any(n.startswith("planner: fastest of ") for n in lay.notes)
    # the very choice of planner.resolve, in the config's vocabulary
    want = planner.resolve("h100x8", TINY, 4096, 8, {"mini_sequence": False, "activation_checkpointing": False},
                           workload=planner.Workload(seq_len=4096, zero_stage=0))
    got = (lay.dims.mode, lay.dims.sp_size, lay.dims.ulysses_degree, lay.dims.ring_count, lay.dims.placement)
    assert got == (want.mode, want.sp_size, want.ulysses_degree, want.ring_count, want.placement)
    assert "planner chose" in lay.describe() and "placement=" in lay.describe()
    logged = lay.log_dict()  # what train.py sends to wandb
    assert logged["wallfacer/planner_used"] is True and logged["wallfacer/planner/cluster"] == "h100x8"
    assert logged["wallfacer/planner/reasons"] == list(want.reasons)
    assert logged["wallfacer/sequence_parallel_size"] == lay.dims.sp_size
    assert logged["wallfacer/auto_notes"] == list(lay.notes)


def test_user_values_are_fixed_for_the_planner() -> None:
    lay = _resolve({"mode": "hybrid", "sequence_parallel_size": 4, "ulysses_degree": 2, "cluster": "h100x8"})
    assert (lay.dims.mode, lay.dims.sp_size, lay.dims.dp_size, lay.dims.ulysses_degree) == ("hybrid", 4, 2, 2)
    assert lay.notes[0].startswith("planner chose ring_count = ")  # only the open values are named
    assert any("fixed by the user: mode=hybrid, sp_size=4, ulysses_degree=2" in n for n in lay.notes)
    lay = _resolve({"mode": "ulysses", "cluster": "h100x8"})  # ulysses: U = P whatever P the planner takes
    assert lay.dims.mode == "ulysses" and lay.dims.ulysses_degree == lay.dims.sp_size and lay.dims.ring_count == 1
    # the MsT settings the run will use are passed on, not chosen
    lay = _resolve({"cluster": "h100x8", "mini_sequence": {"mlp_chunk_tokens": 64}})
    assert lay.planner_choice["mini_sequence"] is True and lay.planner_choice["mlp_chunk_tokens"] == 64
    assert lay.planner_choice["activation_checkpointing"] is True  # MsT's default layer checkpointing
    # nothing left open: the user's layout, no notes; the planner only predicts its step time
    lay = _resolve({"sequence_parallel_size": 4, "ring_count": 2})
    assert lay.notes == () and lay.dims.placement == "team-inner" and (lay.dims.sp_size, lay.dims.ring_count) == (4, 2)
    assert lay.planner_choice["sp_size"] == 4 and lay.planner_choice["ring_count"] == 2
    assert lay.planner_choice["step_s"] > 0


def test_environment_and_cluster_preset() -> None:
    env = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}
    lay = _resolve({"cluster": "h100x64"}, world=16, rpn=None, environ=env)
    assert lay.planner_choice["cluster"] == "h100x64@env" and lay.ranks_per_node == 8
    assert "(2 x 8 ranks)" in lay.notes[0]
    lay = _resolve({}, world=4, rpn=4, default_cluster="cpu", seq_len=500)  # "auto" = the accelerator's preset
    assert lay.planner_choice["cluster"] == "cpu" and "seq_len 504 (padded from 500)" in lay.notes[0]
    with pytest.raises(ValueError, match=r"unknown cluster preset 'dgx'; presets are \["):
        _resolve({"cluster": "dgx"})


def test_planner_error_falls_back_to_the_safe_rule_with_its_message() -> None:
    # Llama-3-8B on the 10 GiB CPU preset: nothing fits
    lay = _resolve({"cluster": "cpu"}, world=4, rpn=4, model="llama3-8b", seq_len=65536)
    assert lay.planner_choice is None and (lay.dims.mode, lay.dims.sp_size, lay.dims.ring_count) == ("wallfacer", 4, 2)
    assert lay.notes[0].startswith("planner found no configuration for cluster cpu ")
    assert "nothing fits in memory" in lay.notes[0] and lay.notes[0].endswith("the safe rule chose instead")
    assert "sequence_parallel_size = 4 (the world size)" in lay.notes[1:]
    assert "planner found no configuration" in lay.describe()  # logged at start-up by initialize()
    # no valid configuration: the layout's own clear error, as without the planner
    with pytest.raises(ValueError, match=r"ring_count = 2 is invalid for a ring dimension of 2 ranks.*counts: \[1\]"):
        _resolve({"ring_count": 2}, world=2, rpn=2)


def test_without_a_length_the_safe_rule_says_so() -> None:
    lay = _resolve({"mode": "auto"}, seq_len=None)
    assert lay.planner_choice is None and lay.dims.mode == "wallfacer" and lay.dims.sp_size == 8
    assert lay.notes[0].startswith("planner not used: no sequence length known")
    assert "mode = wallfacer (the default when nothing was planned)" in lay.notes
    assert _resolve({"seq_len": 2048, "cluster": "h100x8"}, seq_len=None).planner_choice["seq_len"] == 2048
    with pytest.raises(ValueError, match="wallfacer.seq_len = 2048 but the training sequences have 4096 tokens"):
        _resolve({"seq_len": 2048})


@pytest.mark.parametrize("section,message", [
    ({"placement": "ring"}, "wallfacer.placement = 'ring' is invalid"),
    ({"seq_len": 0}, "wallfacer.seq_len = 0 is invalid: allowed is a positive integer or null"),
    ({"cluster": ""}, "wallfacer.cluster = '' is invalid"),
    ({"mode": "ring"}, "allowed are 'wallfacer', 'ulysses', 'hybrid', 'auto'"),
])
def test_new_keys_are_validated(section: dict, message: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_ds_config({"wallfacer": section})
    assert message in str(e.value)


def test_placements_match_the_planner() -> None:
    from ds_wallfacer import planner

    assert PLACEMENTS == planner.PLACEMENTS


@pytest.mark.parametrize("u", [1, 2])
def test_ring_inner_ranks_and_shards_agree_with_the_planner(u: int) -> None:
    from ds_wallfacer import planner
    from ds_wallfacer.comm import RankLayout

    dims = ParallelDims(world_size=32, sp_size=16, ulysses_degree=u, ring_count=2, num_heads=8, num_kv_heads=8,
                        placement="ring-inner")
    cand = planner.Candidate(sp_size=16, ring_count=2, ulysses_degree=u, placement="ring-inner")
    rings = [dims.ring_ranks(d, k) for d in range(dims.dp_size) for k in range(u)]
    assert rings == [tuple(x.ranks) for x in planner.layouts(cand, 32)]
    assert rings[0] != tuple(sorted(rings[0]))  # a real permutation (G = 16 / u / 4 > 1)
    assert sorted(r for ring in rings for r in ring) == list(range(32))
    for ring in rings:  # the data shard of each rank is the ring chunk its WallFacer index attends with
        wf = RankLayout(ring, 2)
        for rank in ring:
            i, k = divmod(dims.shard_index(rank), u)
            assert i == wf.place_of_rank(rank).index and k == rank % u
            assert dims.ulysses_ranks(dims.dp_index(rank), dims.sp_index(rank) // u)[k] == rank
    team = dataclasses.replace(dims, placement="team-inner")
    assert all(team.shard_index(r) == team.sp_index(r) for r in range(32))


def test_planner_can_choose_ring_inner() -> None:
    from ds_wallfacer import planner

    lay = _resolve({"sequence_parallel_size": 32, "ring_count": 2, "cluster": "h100x64"}, world=32,
                   heads=(32, 32), model="llama2-7b", seq_len=65536,
                   run=parse_ds_config({"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}))
    assert lay.dims.placement == "ring-inner" and lay.notes[0].startswith("planner chose placement = ring-inner")
    cand = planner.Candidate(sp_size=32, ring_count=2, ulysses_degree=1, placement="ring-inner")
    assert lay.dims.ring_ranks(0, 0) == planner.layouts(cand, 32)[0].ranks


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_config_plans_for_train_py(path: Path) -> None:
    """What launch/train.py gets on launch/main.sh's 4 CPU ranks at its default 512 tokens."""
    run = parse_ds_config(path)
    plan = PlanInputs(model=TINY, seq_len=512, run=run, default_cluster="cpu", environ={})
    lay = resolve_auto(run.wallfacer, world_size=4, num_heads=8, num_kv_heads=4, ranks_per_node=4, planner_inputs=plan)
    lay.check_seq_len(512)
    assert not any("safe rule" in n for n in lay.notes), lay.notes
    run.deepspeed_dict(world_size=4, sp_size=lay.dims.sp_size)


def test_one_rank_says_so_in_one_line() -> None:
    lay = _resolve({"mini_sequence": {}}, world=1, rpn=1)
    assert lay.notes == ("one rank: no sequence parallelism (attention over the whole sequence on this rank)",)
    assert (lay.dims.sp_size, lay.dims.ring_count, lay.dims.ulysses_degree) == (1, 1, 1)


@pytest.mark.parametrize("seq_len", [4096, None], ids=["planner", "safe rule"])
def test_auto_sizes_let_layers_scan_whole_heads(seq_len: int | None) -> None:
    """Gated delta-nets with 4 key / 8 value heads and Mamba-2 mixers in 2 groups on 8 ranks: every P chosen for
    "auto" splits the heads (P divides 4) and the groups (divides 2 or is a multiple); the safe rule says why it
    took less than the world."""
    lay = _resolve({"mode": "wallfacer", "cluster": "h100x8"}, seq_len=seq_len, whole_heads=(4, 8),
                   head_groups=(2,))
    p = lay.dims.sp_size
    assert 4 % p == 0 and (2 % p == 0 or p % 2 == 0), p
    if seq_len is None:
        assert p == 4 and any("sequence_parallel_size = 4 (the largest divisor" in n for n in lay.notes), lay.notes
    from ds_wallfacer.planner.candidate import Workload

    w = Workload(seq_len=1, whole_heads=(16, 32), head_groups=(1,))
    assert [p for p in (1, 2, 4, 8, 16, 32) if w.splits_heads(p)] == [1, 2, 4, 8, 16]
