"""The ds_config "wallfacer" section: parsing, defaults, validation messages, "auto", rank arithmetic, and every
example in ds_configs/. Pure: no processes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds_wallfacer.comm.dims import ParallelDims, valid_ulysses_degrees
from ds_wallfacer.config import WallFacerConfig, parse_ds_config
from ds_wallfacer.planner.auto import ParallelSetup, resolve_auto

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "ds_configs").glob("*.json"))


def _dims(**kw) -> ParallelDims:
    base = dict(world_size=8, sp_size=8, mode="hybrid", ulysses_degree=2, ring_count=1, num_heads=8, num_kv_heads=4)
    return ParallelDims(**{**base, **kw})


def test_defaults_and_documented_fields() -> None:
    cfg = WallFacerConfig.from_dict(None)
    assert cfg == WallFacerConfig.from_dict({})
    assert (cfg.sequence_parallel_size, cfg.mode, cfg.ring_count, cfg.ulysses_degree, cfg.sharding, cfg.kernel,
            cfg.mini_sequence) == ("auto", "wallfacer", "auto", "auto", "zigzag", "auto", None)
    src = (ROOT / "ds_wallfacer" / "config" / "schema.py").read_text()
    for name in WallFacerConfig.__dataclass_fields__:  # a one-line docstring under every field
        assert f'    {name}:' in src and '"""' in src.split(f"    {name}:")[1].split("\n")[1], name


@pytest.mark.parametrize(
    "section,message",
    [
        ({"ring_size": 2}, "unknown key(s) ['ring_size']; valid keys are ['sequence_parallel_size', 'mode'"),
        ({"mode": "ring"}, "wallfacer.mode = 'ring' is invalid: allowed are 'wallfacer', 'ulysses', 'hybrid'"),
        ({"ring_count": 0}, 'wallfacer.ring_count = 0 is invalid: allowed is a positive integer or "auto"'),
        ({"ring_count": True}, "wallfacer.ring_count = True is invalid"),
        ({"ulysses_degree": "4"}, "wallfacer.ulysses_degree = '4' is invalid"),
        ({"sequence_parallel_size": -2}, "wallfacer.sequence_parallel_size = -2 is invalid"),
        ({"sharding": "striped"}, "wallfacer.sharding = 'striped' is invalid: allowed are 'zigzag', 'contiguous'"),
        ({"balance_steps": "yes"}, "wallfacer.balance_steps = 'yes' is invalid: allowed are true and false"),
        ({"kernel": "flash"}, "wallfacer.kernel = 'flash' is invalid: allowed are 'auto', 'reference', 'cpu_flash', "
                              "'cuda_sdpa', 'flash_attn', 'cudnn', 'flash_attn3', 'flash_attn4'"),
        ({"mode": "wallfacer", "ulysses_degree": 2}, 'needs mode "hybrid"'),
        ({"mode": "ulysses", "ring_count": 2}, 'mode "ulysses" has no ring dimension'),
        ({"mini_sequence": {"chunks": 4}}, "wallfacer.mini_sequence: unknown key(s) ['chunks']"),
        ({"mini_sequence": 3}, "wallfacer.mini_sequence must be a JSON object"),
    ],
)
def test_section_errors_name_the_key(section: dict, message: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_ds_config({"wallfacer": section})
    assert message in str(e.value)


def test_mini_sequence_is_parsed_by_its_owner() -> None:
    from ds_wallfacer.mst.config import MiniSequenceConfig

    cfg = parse_ds_config({"wallfacer": {"mini_sequence": {"mlp_chunk_tokens": 64}}}).wallfacer
    assert cfg.mini_sequence == MiniSequenceConfig(mlp_chunk_tokens=64)
    assert parse_ds_config({"wallfacer": {"mini_sequence": None}}).wallfacer.mini_sequence is None


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(sp_size=3), "sequence_parallel_size = 3 does not divide the world size 8: valid sizes for 8 ranks are [1, 2, 4, 8]"),
        (dict(ulysses_degree=3), "ulysses_degree = 3 does not divide sequence_parallel_size 8: valid degrees are [1, 2, 4, 8]"),
        (dict(num_heads=6, num_kv_heads=6, ulysses_degree=4), "ulysses_degree = 4 does not fit the model's heads (6 query, 6 kv)"),
        (dict(num_heads=8, num_kv_heads=2, ulysses_degree=8, ring_count=1, mode="ulysses"), None),  # kv replicated
        (dict(num_heads=12, num_kv_heads=3, ulysses_degree=2), "Valid degrees for sequence_parallel_size 8: [1]"),
        (dict(ring_count=2, ulysses_degree=4), "ring_count = 2 is invalid for a ring dimension of 2 ranks (sequence_parallel_size / ulysses_degree): C*C must divide 2. Valid ring counts: [1]"),
        (dict(ulysses_degree=1, ring_count=3, mode="wallfacer"), "Valid ring counts: [1, 2]"),
        (dict(mode="ulysses", ulysses_degree=4), 'mode "ulysses" needs ulysses_degree = sequence_parallel_size = 8'),
        (dict(num_heads=6, num_kv_heads=4), "query heads are not a multiple of its 4 kv heads"),
    ],
)
def test_dims_validation(kw: dict, message: str | None) -> None:
    if message is None:
        _dims(**kw)
        return
    with pytest.raises(ValueError) as e:
        _dims(**kw)
    assert message in str(e.value)


def test_ring_count_two_in_a_ring_of_four_is_valid() -> None:
    lay = _dims(ring_count=2, ulysses_degree=2, sp_size=8)  # R = 4, C*C = 4
    assert (lay.ring_size, lay.dp_size) == (4, 1)


def test_rank_arithmetic() -> None:
    lay = _dims(world_size=16, sp_size=8, ulysses_degree=2, ring_count=2)
    assert lay.dp_size == 2 and lay.ring_size == 4
    assert lay.sp_ranks(1) == tuple(range(8, 16))
    assert lay.ulysses_ranks(1, 2) == (12, 13)
    assert lay.ring_ranks(1, 1) == (9, 11, 13, 15)
    assert (lay.sp_index(13), lay.dp_index(13)) == (5, 1)
    # every rank is in exactly one Ulysses group and one ring group
    ul = sorted(r for d in range(2) for i in range(4) for r in lay.ulysses_ranks(d, i))
    rg = sorted(r for d in range(2) for u in range(2) for r in lay.ring_ranks(d, u))
    assert ul == rg == list(range(16))
    ParallelSetup(lay).check_seq_len(32)
    with pytest.raises(ValueError, match="sequence length 30 is not divisible by 2 x sequence_parallel_size = 16: pad to 32 or truncate to 16"):
        ParallelSetup(lay).check_seq_len(30)


def test_auto_choices_are_valid_and_logged() -> None:
    lay = resolve_auto(WallFacerConfig(mode="hybrid"), world_size=16, num_heads=8, num_kv_heads=2, ranks_per_node=8)
    assert (lay.dims.sp_size, lay.dims.ulysses_degree, lay.dims.ring_count) == (16, 2, 2)  # U = 2 keeps kv heads split
    assert any("ulysses_degree = 2" in n for n in lay.notes) and any("ring_count = 2" in n for n in lay.notes)
    lay = resolve_auto(WallFacerConfig(mode="ulysses"), world_size=4, num_heads=4, num_kv_heads=2)
    assert lay.dims.ulysses_degree == 4 and lay.dims.ring_count == 1
    lay = resolve_auto(WallFacerConfig(), world_size=8, num_heads=4, num_kv_heads=2, ranks_per_node=1)
    assert (lay.dims.ulysses_degree, lay.dims.ring_count) == (1, 1)  # a team of 2 would cross nodes
    lay = resolve_auto(WallFacerConfig(sequence_parallel_size=4, ring_count=2), world_size=8, num_heads=4,
                       num_kv_heads=2)
    assert (lay.dims.sp_size, lay.dims.dp_size, lay.dims.ring_count) == (4, 2, 2) and lay.notes == ()
    with pytest.raises(ValueError, match="Valid ring counts"):
        resolve_auto(WallFacerConfig(ring_count=3), world_size=8, num_heads=4, num_kv_heads=2)
    assert valid_ulysses_degrees(8, 4, 2) == [1, 2, 4]


def test_batch_sizes_for_deepspeed() -> None:
    run = parse_ds_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
                           "train_batch_size": 12, "wallfacer": {}})
    assert "wallfacer" not in run.deepspeed
    d = run.deepspeed_dict(world_size=8, sp_size=4)  # D = 2 replicas: 2 x 3 x 2 = 12 sequences per step
    assert (d["train_micro_batch_size_per_gpu"], d["gradient_accumulation_steps"], d["train_batch_size"]) == (2, 3, 48)
    with pytest.raises(ValueError, match="train_batch_size = 12 must equal .* = 24"):
        run.deepspeed_dict(world_size=16, sp_size=4)
    only_total = parse_ds_config({"train_batch_size": 8, "wallfacer": {}})
    assert only_total.micro_batch(dp_size=2) == 4
    assert only_total.deepspeed_dict(world_size=8, sp_size=4)["train_batch_size"] == 32


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        parse_ds_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        parse_ds_config(bad)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_config_validates(path: Path) -> None:
    """ds_configs/*.json run as they are: on the 4 ranks of launch/main.sh's CPU default, for train.py's model
    (8 query / 4 kv heads) and its 512-token sequences; and DeepSpeed's own parser accepts what we hand it."""
    from deepspeed.runtime.config import DeepSpeedConfig

    run = parse_ds_config(path)
    lay = resolve_auto(run.wallfacer, world_size=4, num_heads=8, num_kv_heads=4, ranks_per_node=4)
    lay.check_seq_len(512)
    ds = run.deepspeed_dict(world_size=4, sp_size=lay.dims.sp_size)
    assert json.loads(json.dumps(ds)) == ds
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 4
    ds.pop("train_batch_size")  # no distributed backend here: DeepSpeed's parser takes world size 1
    DeepSpeedConfig(ds)


def test_there_are_examples_for_every_mode() -> None:
    modes = {parse_ds_config(p).wallfacer.mode for p in EXAMPLES}
    assert {"wallfacer", "ulysses", "hybrid"} <= modes


def test_deepspeed_ulysses_keys_are_read_with_deepspeeds_meaning() -> None:
    """An ALST ds_config (DeepSpeed's top-level ``sequence_parallel_size`` / ``seq_parallel_communication_data_type``)
    is Ulysses over that many ranks, gradients reduced in that dtype; neither key reaches DeepSpeed."""
    run = parse_ds_config({"sequence_parallel_size": 4, "seq_parallel_communication_data_type": "BF16",
                           "zero_optimization": {"stage": 3}})
    assert (run.wallfacer.mode, run.wallfacer.sequence_parallel_size) == ("ulysses", 4)
    assert run.deepspeed == {"zero_optimization": {"stage": 3}, "communication_data_type": "bf16"}
    # with a section: its mode, DeepSpeed's size
    run = parse_ds_config({"sequence_parallel_size": 4, "wallfacer": {"mode": "wallfacer", "ring_count": 2}})
    assert (run.wallfacer.mode, run.wallfacer.sequence_parallel_size, run.wallfacer.ring_count) == ("wallfacer", 4, 2)
    assert "sequence_parallel_size" not in run.deepspeed


@pytest.mark.parametrize("cfg,words", [
    ({"sequence_parallel_size": 4, "wallfacer": {"sequence_parallel_size": 2}},
     "sequence_parallel_size = 4 (DeepSpeed's key) conflicts with wallfacer.sequence_parallel_size = 2"),
    ({"sequence_parallel_size": 0}, "sequence_parallel_size = 0 is invalid: allowed is a positive integer"),
    ({"seq_parallel_communication_data_type": "fp8"}, "seq_parallel_communication_data_type = 'fp8' is invalid"),
    ({"seq_parallel_communication_data_type": "bf16", "communication_data_type": "fp32"},
     "conflicts with communication_data_type = 'fp32'"),
])
def test_conflicting_or_invalid_deepspeed_sequence_keys_are_refused(cfg: dict, words: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_ds_config(cfg)
    assert words in str(err.value)
