"""The rule for values that a trainer option and the ds_config both set (``ds_wallfacer.train.options``): for each
pair, the option applies where the ds_config leaves the key open (absent or "auto"), agrees where both give the same
value, and is refused, naming both values, where they differ. Pure: no processes, no torch."""
from __future__ import annotations

import json
from typing import Any

import pytest

from ds_wallfacer import examples
from ds_wallfacer.train.cli import parse_args
from ds_wallfacer.train.options import DEFAULTS, given_options, resolve_options

ADAMW = {"type": "AdamW", "params": {"weight_decay": 0.0}}


def _sched(kind: str, **params: Any) -> dict[str, Any]:
    return {"scheduler": {"type": kind, "params": params}}


def _at(cfg: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        cfg = cfg[part]
    return cfg


# option, its value, the ds_config around the key (without it), the key, another value of the key
PAIRS = [
    ("lr", 1e-4, {"optimizer": ADAMW}, "optimizer.params.lr", 3e-3),
    ("lr", 1e-4, _sched("WarmupLR", warmup_num_steps=5), "scheduler.params.warmup_max_lr", 3e-3),
    ("lr", 1e-4, _sched("WarmupDecayLR", total_num_steps=20), "scheduler.params.warmup_max_lr", 1e-3),
    ("steps", 8, _sched("WarmupCosineLR"), "scheduler.params.total_num_steps", 1000),
    ("steps", 8, _sched("WarmupDecayLR"), "scheduler.params.total_num_steps", 1000),
    ("warmup_steps", 4, _sched("WarmupLR"), "scheduler.params.warmup_num_steps", 1000),
    ("warmup_steps", 4, _sched("WarmupCosineLR", total_num_steps=20), "scheduler.params.warmup_num_steps", 10),
    ("min_lr_ratio", 0.25, _sched("WarmupCosineLR", total_num_steps=20), "scheduler.params.cos_min_ratio", 1e-4),
]
IDS = [f"{option}-{path.split('.')[-1]}-{(cfg.get('scheduler') or {}).get('type', 'optimizer')}"
       for option, _, cfg, path, _ in PAIRS]


def _with(cfg: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    cfg = json.loads(json.dumps(cfg))
    *head, last = path.split(".")
    d = cfg
    for part in head:
        d = d.setdefault(part, {})
    d[last] = value
    return cfg


@pytest.mark.parametrize("option, value, cfg, path, other", PAIRS, ids=IDS)
def test_an_option_applies_where_the_ds_config_leaves_the_key_open(option: str, value: Any, cfg: dict, path: str,
                                                                   other: Any) -> None:
    for open_cfg in (cfg, _with(cfg, path, "auto")):  # absent, then "auto"
        r = resolve_options(given={option: value}, ds_config=open_cfg)
        assert r.values[option] == value and _at(r.ds_config, path) == value
        note = next(n for n in r.notes if n.startswith(f"{option} = "))
        assert f"<- --{option}" in note and f"written to {path}" in note, note
        assert "auto" not in json.dumps(r.ds_config)


@pytest.mark.parametrize("option, value, cfg, path, other", PAIRS, ids=IDS)
def test_an_option_agrees_with_the_same_value_and_is_refused_with_another(option: str, value: Any, cfg: dict,
                                                                         path: str, other: Any) -> None:
    r = resolve_options(given={option: value}, ds_config=_with(cfg, path, value))
    assert r.values[option] == value and _at(r.ds_config, path) == value
    with pytest.raises(ValueError) as e:
        resolve_options(given={option: value}, ds_config=_with(cfg, path, other))
    msg = str(e.value)
    assert f"--{option} {value:g}" in msg and f"{path} = {other:g}" in msg, msg
    assert f"drop --{option}" in msg and '"auto"' in msg, msg


@pytest.mark.parametrize("option, value, cfg, path, other", PAIRS, ids=IDS)
def test_without_the_option_the_ds_config_counts_else_the_default(option: str, value: Any, cfg: dict, path: str,
                                                                  other: Any) -> None:
    r = resolve_options(given={}, ds_config=_with(cfg, path, other))
    assert r.values[option] == other and _at(r.ds_config, path) == other
    r = resolve_options(given={}, ds_config=_with(cfg, path, "auto"))
    written = max(1, DEFAULTS[option]) if option == "warmup_steps" else DEFAULTS[option]  # DeepSpeed refuses 0
    assert _at(r.ds_config, path) == written and r.values[option] == DEFAULTS[option]


def test_lr_decay_must_name_the_ds_config_schedulers_decay() -> None:
    for decay, kind in (("constant", "WarmupLR"), ("linear", "WarmupDecayLR"), ("cosine", "WarmupCosineLR")):
        r = resolve_options(given={"lr_decay": decay}, ds_config=_sched(kind, total_num_steps=20))
        assert r.values["lr_decay"] == decay
        assert resolve_options(given={}, ds_config=_sched(kind, total_num_steps=20)).values["lr_decay"] == decay
    with pytest.raises(ValueError, match=r"--lr_decay cosine and the ds_config's scheduler.type = WarmupDecayLR "
                                         r"\(linear decay\) disagree: drop --lr_decay, or .* change scheduler.type to "
                                         r'WarmupCosineLR, or set it to "auto"'):
        resolve_options(given={"lr_decay": "cosine"}, ds_config=_sched("WarmupDecayLR", total_num_steps=20))
    # "auto" (or no scheduler): the trainer's own schedule, shaped by the options
    r = resolve_options(given={"lr_decay": "linear", "warmup_steps": 3}, ds_config={"scheduler": {"type": "auto"}})
    assert "scheduler" not in r.ds_config and r.values["lr_decay"] == "linear" and r.values["warmup_steps"] == 3
    with pytest.raises(ValueError, match='scheduler.type = "auto" is the trainer\'s own schedule'):
        resolve_options(given={}, ds_config=_sched("auto", warmup_num_steps=3))


def test_min_lr_ratio_against_decay_and_constant_schedulers() -> None:
    decay = _sched("WarmupDecayLR", total_num_steps=20, warmup_max_lr=1e-3)  # ends at warmup_min_lr
    r = resolve_options(given={"min_lr_ratio": 0.25}, ds_config=decay)
    assert _at(r.ds_config, "scheduler.params.warmup_min_lr") == pytest.approx(2.5e-4)
    r = resolve_options(given={"min_lr_ratio": 0.25}, ds_config=_with(decay, "scheduler.params.warmup_min_lr", 2.5e-4))
    assert r.values["min_lr_ratio"] == pytest.approx(0.25)
    with pytest.raises(ValueError, match=r"--min_lr_ratio 0.5 \(x lr 0.001 = 0.0005\) and the ds_config's "
                                         r"scheduler.params.warmup_min_lr = 0.00025 disagree"):
        resolve_options(given={"min_lr_ratio": 0.5}, ds_config=_with(decay, "scheduler.params.warmup_min_lr", 2.5e-4))
    # WarmupLR keeps the peak: only a ratio of 1 means the same
    assert resolve_options(given={"min_lr_ratio": 1.0}, ds_config=_sched("WarmupLR")).values["min_lr_ratio"] == 1.0
    with pytest.raises(ValueError, match="--min_lr_ratio 0.1 decays the rate, but the ds_config's scheduler WarmupLR"):
        resolve_options(given={"min_lr_ratio": 0.1}, ds_config=_sched("WarmupLR"))


def test_schedulers_that_shape_the_rate_themselves_refuse_the_schedule_options() -> None:
    one_cycle = _sched("OneCycle", cycle_min_lr=1e-4, cycle_max_lr=1e-3)
    assert resolve_options(given={"steps": 8}, ds_config=one_cycle).values["steps"] == 8
    for option, value in (("lr", 1e-3), ("warmup_steps", 2), ("lr_decay", "cosine"), ("min_lr_ratio", 0.1)):
        with pytest.raises(ValueError, match=f"--{option} .* the ds_config's scheduler OneCycle .* drop --{option}"):
            resolve_options(given={option: value}, ds_config=one_cycle)
    step_lr = _sched("StepLR", step_size=10)  # a torch scheduler: it scales the optimizer's lr
    r = resolve_options(given={"lr": 1e-3}, ds_config={**step_lr, "optimizer": ADAMW})
    assert _at(r.ds_config, "optimizer.params.lr") == 1e-3
    with pytest.raises(ValueError, match="--warmup_steps 2 .* scheduler StepLR has no warm-up key"):
        resolve_options(given={"warmup_steps": 2}, ds_config=step_lr)


def test_no_ds_config_sections_takes_the_options_or_their_defaults() -> None:
    r = resolve_options(given={}, ds_config={"train_micro_batch_size_per_gpu": 1})
    assert r.values == dict(DEFAULTS) and r.ds_config == {"train_micro_batch_size_per_gpu": 1}
    assert all("<- default of --" in n for n in r.notes), r.notes
    given = {"lr": 1e-2, "steps": 7, "warmup_steps": 2, "lr_decay": "linear", "min_lr_ratio": 0.0}
    r = resolve_options(given=given, ds_config={"scheduler": None, "optimizer": {}})
    assert r.values == given and "scheduler" not in r.ds_config and r.ds_config["optimizer"] == {}
    assert "lr = 0.01 <- --lr (the trainer's AdamW: the ds_config has no optimizer)" in r.notes


def test_invalid_ds_config_values_are_refused() -> None:
    with pytest.raises(ValueError, match="scheduler.params.total_num_steps = 0 is invalid: allowed is an integer >= 1"):
        resolve_options(given={}, ds_config=_sched("WarmupCosineLR", total_num_steps=0))
    with pytest.raises(ValueError, match=r"optimizer.params.lr = 'fast' is invalid"):
        resolve_options(given={"lr": 1e-3}, ds_config={"optimizer": {"type": "AdamW", "params": {"lr": "fast"}}})
    with pytest.raises(ValueError, match='names no type: give "type"'):
        resolve_options(given={}, ds_config={"scheduler": {"params": {}}})


@pytest.mark.parametrize("name", examples.config_names())
def test_every_shipped_config_resolves_and_refuses_a_different_lr(name: str) -> None:
    raw = json.loads((examples.CONFIG_DIR / f"{name}.json").read_text())
    r = resolve_options(given={}, ds_config=raw)
    lr = _at(raw, "optimizer.params.lr") if "optimizer" in raw else DEFAULTS["lr"]
    assert r.values["lr"] == lr and r.values["steps"] == DEFAULTS["steps"]
    assert r.ds_config == raw  # every key set: nothing written
    if "optimizer" in raw:
        with pytest.raises(ValueError, match=rf"--lr 10000 and the ds_config's optimizer.params.lr = {lr:g} disagree"):
            resolve_options(given={"lr": 1e4}, ds_config=raw)


def test_only_options_given_on_the_command_line_count_as_given(tmp_path: Any) -> None:
    args = parse_args(["--output_dir", str(tmp_path), "--lr", "1e-4", "--lr_decay", "cosine"])
    assert given_options(args) == {"lr": 1e-4, "lr_decay": "cosine"}
    assert given_options(parse_args(["--output_dir", str(tmp_path)])) == {}
