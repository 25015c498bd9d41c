"""One rule for a value that both a trainer option and the ds_config can set (learning rate, schedule, steps).

For each pair below, ``resolve_options`` decides ONE value:

- the option is given and the ds_config leaves the key open (absent, or ``"auto"``): the option's value is written
  into the ds_config;
- both give it and they are equal: fine;
- both give it and they differ: refused, naming both values and the ways out (drop the option; change or remove
  the key, or set it to ``"auto"``);
- the option is not given: the ds_config's value counts where it sets one, else the option's default (written into
  open keys; ``"auto"`` never reaches DeepSpeed, which refuses it for ``lr``).

=================  ===========================================================================================
option             ds_config key(s)
=================  ===========================================================================================
``--lr``           ``optimizer.params.lr``; ``scheduler.params.warmup_max_lr`` (WarmupLR, WarmupDecayLR)
``--steps``        ``scheduler.params.total_num_steps`` (WarmupDecayLR, WarmupCosineLR)
``--warmup_steps`` ``scheduler.params.warmup_num_steps`` (WarmupLR, WarmupDecayLR, WarmupCosineLR)
``--lr_decay``     ``scheduler.type``: constant = WarmupLR, linear = WarmupDecayLR, cosine = WarmupCosineLR
``--min_lr_ratio`` ``scheduler.params.cos_min_ratio`` (WarmupCosineLR); ``warmup_min_lr`` / lr (WarmupDecayLR,
                   which decays to warmup_min_lr); 1 (WarmupLR, which does not decay)
=================  ===========================================================================================

Without a ds_config scheduler (or with ``"scheduler": {"type": "auto"}``, which is dropped here) the trainer builds
its own schedule from the options (``schedule.py``). A DeepSpeed scheduler of another type (OneCycle, LRRangeTest,
a torch scheduler) shapes the rate itself: a schedule option given beside it is refused, and so is ``--lr``
beside OneCycle or LRRangeTest, which set the rate from keys of their own. Pure: no torch import. This reads the
raw dict before ``config.parse_ds_config`` does, because ``"auto"`` must be replaced before anything else sees it.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

__all__ = ["DEFAULTS", "Resolved", "given_options", "resolve_options"]

DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {"lr": 3e-3, "steps": 20, "warmup_steps": 0, "lr_decay": "cosine", "min_lr_ratio": 0.1})
"""The effective defaults of the options the rule decides (their argparse defaults are None, meaning "not given")."""

_DECAY_OF = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}
"""DeepSpeed's warm-up schedulers by the ``--lr_decay`` they match."""
_SCHEDULER_OF = {decay: name for name, decay in _DECAY_OF.items()}
_PEAK_KEY = ("WarmupLR", "WarmupDecayLR")
"""Schedulers whose ``warmup_max_lr`` is the peak rate (WarmupCosineLR scales the optimizer's)."""
_TOTAL_KEY = ("WarmupDecayLR", "WarmupCosineLR")
_OWN_RATE = {"OneCycle": "cycle_min_lr / cycle_max_lr", "LRRangeTest": "lr_range_test_min_lr"}
"""Schedulers that set the rate from keys of their own, whatever the optimizer's lr."""
_MISSING = object()


@dataclass(frozen=True)
class Resolved:
    """The ds_config to hand to DeepSpeed and the options' effective values, each with where it came from."""

    ds_config: dict[str, Any]
    """The ds_config with every open key written (no ``"auto"`` left in the keys above)."""
    values: dict[str, Any]
    """Effective ``lr``, ``steps``, ``warmup_steps``, ``lr_decay``, ``min_lr_ratio``."""
    notes: tuple[str, ...]
    """One ``"name = value <- source"`` per value, for the start-up line."""


def given_options(args: Any) -> dict[str, Any]:
    """The options of ``DEFAULTS`` given on the command line (argparse leaves the others None)."""
    return {k: getattr(args, k) for k in DEFAULTS if getattr(args, k, None) is not None}


def resolve_options(*, given: Mapping[str, Any], ds_config: Mapping[str, Any]) -> Resolved:
    """The one value of each option that the ds_config can also set, and the ds_config with it written; a
    ``ValueError`` naming both values where they differ. ``given``: only the options given on the command line."""
    unknown = set(given) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"resolve_options decides {sorted(DEFAULTS)}, not {sorted(unknown)}")
    cfg = copy.deepcopy(dict(ds_config))
    notes: list[str] = []
    kind = _scheduler_kind(cfg, notes)
    values = {"lr": _lr(cfg, kind, given.get("lr"), notes),
              "steps": _steps(cfg, kind, given.get("steps"), notes),
              "warmup_steps": _warmup(cfg, kind, given.get("warmup_steps"), notes)}
    values["lr_decay"] = _decay(kind, given.get("lr_decay"), notes)
    values["min_lr_ratio"] = _min_ratio(cfg, kind, given.get("min_lr_ratio"), lr=values["lr"], notes=notes)
    return Resolved(ds_config=cfg, values=values, notes=tuple(notes))


# -- the ds_config's sections ------------------------------------------------------------------------------------
def _scheduler_kind(cfg: dict[str, Any], notes: list[str]) -> str | None:
    """The ds_config scheduler's type, or None where the trainer builds its own schedule (no section, null, or
    type "auto", which is dropped here)."""
    sched = cfg.get("scheduler", _MISSING)
    if sched is _MISSING or sched is None:
        cfg.pop("scheduler", None)
        return None
    if not isinstance(sched, dict) or not isinstance(sched.get("type"), str):
        raise ValueError(f"scheduler = {sched!r} names no type: give \"type\" (a DeepSpeed scheduler such as "
                         f"{', '.join(_DECAY_OF)}), or \"auto\" for the trainer's schedule from the options")
    if sched["type"] == "auto":
        if sched.get("params"):
            raise ValueError('scheduler.type = "auto" is the trainer\'s own schedule (--warmup_steps, --lr_decay, '
                             "--min_lr_ratio), which takes no scheduler.params: remove them, or name a DeepSpeed "
                             "scheduler")
        del cfg["scheduler"]
        notes.append('schedule = the trainer\'s <- ds_config scheduler.type "auto"')
        return None
    if sched.get("params") is None:
        sched["params"] = {}
    if not isinstance(sched["params"], dict):
        raise ValueError(f"scheduler.params = {sched['params']!r} must be an object")
    return sched["type"]


def _keys(cfg: dict[str, Any], *paths: str) -> list[str]:
    """The paths whose section exists (an optimizer's ``params`` is made where missing)."""
    out = []
    for path in paths:
        section = path.split(".")[0]
        if isinstance(cfg.get(section), dict) and cfg[section]:  # {} names no optimizer: the trainer builds one
            if path.count(".") == 2 and cfg[section].get("params") is None:
                cfg[section]["params"] = {}
            if not isinstance(cfg[section].get("params", {}), dict):
                raise ValueError(f"{section}.params = {cfg[section]['params']!r} must be an object")
            out.append(path)
    return out


def _get(cfg: dict[str, Any], path: str) -> Any:
    d: Any = cfg
    for part in path.split("."):
        if not isinstance(d, dict) or part not in d:
            return _MISSING
        d = d[part]
    return d


def _put(cfg: dict[str, Any], path: str, value: Any) -> None:
    *head, last = path.split(".")
    d = cfg
    for part in head:
        d = d[part]
    d[last] = value


def _is_open(v: Any) -> bool:
    return v is _MISSING or v == "auto"


def _show(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _check_number(path: str, v: Any, *, integer: bool, least: float) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v >= least and math.isfinite(v)
    if not ok or (integer and not isinstance(v, int)):
        what = "an integer" if integer else "a number"
        raise ValueError(f'{path} = {v!r} is invalid: allowed is {what} >= {_show(least)} or "auto"')


# -- the rule ------------------------------------------------------------------------------------------------------
def _settle(cfg: dict[str, Any], option: str, given: Any, paths: list[str], notes: list[str], *,
            integer: bool = False, least: float = 0.0, write: Any = None) -> Any:
    """The one value of ``--option`` against the ds_config keys ``paths`` (in the order DeepSpeed reads them: the
    first set one counts when the option is not given); open keys get it written (``write`` maps it first)."""
    set_ = [(p, _get(cfg, p)) for p in paths if not _is_open(_get(cfg, p))]
    for p, v in set_:
        _check_number(p, v, integer=integer, least=least)
    if given is not None:
        for p, v in set_:
            if not math.isclose(v, given, rel_tol=1e-9, abs_tol=0.0):
                raise ValueError(_clash(option, f"--{option} {_show(given)}", p, v, f"{p} to {_show(given)}"))
        value, source = given, f"--{option}" + "".join(f" = ds_config {p}" for p, _ in set_)
    elif set_:
        value, source = set_[0][1], f"ds_config {set_[0][0]}"
    else:
        value, source = DEFAULTS[option], f"default of --{option}"
    written = [p for p in paths if _is_open(_get(cfg, p))]
    for p in written:
        _put(cfg, p, value if write is None else write(value))
    notes.append(f"{option} = {_show(value)} <- {source}" + (f" (written to {', '.join(written)})" if written else ""))
    return value


def _clash(option: str, said: str, path: str, value: Any, change: str) -> str:
    return (f"{said} and the ds_config's {path} = {_show(value)} disagree: drop --{option}, or in the ds_config "
            f"change {change}, remove it or set it to \"auto\"")


def _refuse_beside(kind: str, option: str, given: Any, why: str) -> None:
    if given is not None:
        raise ValueError(f"--{option} {_show(given)} shapes the trainer's own schedule, but the ds_config's scheduler "
                         f"{kind} {why}: drop --{option}, or set scheduler.type to \"auto\" (or remove the "
                         "scheduler) for the trainer's schedule")


def _lr(cfg: dict[str, Any], kind: str | None, given: float | None, notes: list[str]) -> float:
    if kind in _OWN_RATE:
        _refuse_beside(kind, "lr", given, f"sets the rate itself (its {_OWN_RATE[kind]})")
    paths = _keys(cfg, *(["scheduler.params.warmup_max_lr"] if kind in _PEAK_KEY else []), "optimizer.params.lr")
    value = float(_settle(cfg, "lr", given, paths, notes))
    if "optimizer.params.lr" not in paths:
        notes[-1] += " (the trainer's AdamW: the ds_config has no optimizer)"
    return value


def _steps(cfg: dict[str, Any], kind: str | None, given: int | None, notes: list[str]) -> int:
    paths = ["scheduler.params.total_num_steps"] if kind in _TOTAL_KEY else []
    return int(_settle(cfg, "steps", given, paths, notes, integer=True, least=1))


def _warmup(cfg: dict[str, Any], kind: str | None, given: int | None, notes: list[str]) -> int:
    if kind is not None and kind not in _DECAY_OF:
        _refuse_beside(kind, "warmup_steps", given, "has no warm-up key the trainer knows")
        return DEFAULTS["warmup_steps"] if given is None else given
    paths = ["scheduler.params.warmup_num_steps"] if kind is not None else []
    # DeepSpeed refuses 0 warm-up steps (and warms up over at least 2): an open key gets at least 1
    value = int(_settle(cfg, "warmup_steps", given, paths, notes, integer=True, write=lambda w: max(1, w)))
    if kind is not None and value < 2:
        notes[-1] += f" (DeepSpeed's {kind} warms up over at least 2 steps)"
    return value


def _decay(kind: str | None, given: str | None, notes: list[str]) -> str:
    if kind is None:
        value = DEFAULTS["lr_decay"] if given is None else given
        source = "--lr_decay" if given is not None else "default of --lr_decay"
        notes.append(f"lr_decay = {value} <- {source} (the trainer's schedule)")
        return value
    if kind not in _DECAY_OF:
        _refuse_beside(kind, "lr_decay", given, "decays the rate its own way")
        notes.append(f"schedule = {kind} <- ds_config scheduler.type")
        return DEFAULTS["lr_decay"]
    if given is not None and given != _DECAY_OF[kind]:
        raise ValueError(
            f"--lr_decay {given} and the ds_config's scheduler.type = {kind} ({_DECAY_OF[kind]} decay) disagree: "
            f"drop --lr_decay, or in the ds_config change scheduler.type to {_SCHEDULER_OF[given]}, or set it to "
            "\"auto\" (or remove the scheduler) for the trainer's schedule")
    source = "ds_config scheduler.type" if given is None else "--lr_decay = ds_config scheduler.type"
    notes.append(f"lr_decay = {_DECAY_OF[kind]} <- {source} {kind}")
    return _DECAY_OF[kind]


def _min_ratio(cfg: dict[str, Any], kind: str | None, given: float | None, *, lr: float, notes: list[str]) -> float:
    """``--min_lr_ratio``: the final rate / the peak. WarmupDecayLR ends at ``warmup_min_lr`` (where its warm-up
    also starts), so the ratio is that over the peak; WarmupLR never decays (ratio 1)."""
    if kind is None or kind == "WarmupCosineLR":
        paths = ["scheduler.params.cos_min_ratio"] if kind else []
        return float(_settle(cfg, "min_lr_ratio", given, paths, notes))
    if kind == "WarmupDecayLR":
        path = "scheduler.params.warmup_min_lr"
        set_v = _get(cfg, path)
        if not _is_open(set_v):
            _check_number(path, set_v, integer=False, least=0.0)
            ratio = set_v / lr
            if given is not None and not math.isclose(ratio, given, rel_tol=1e-9):
                raise ValueError(_clash("min_lr_ratio", f"--min_lr_ratio {_show(given)} (x lr {_show(lr)} = "
                                        f"{_show(given * lr)})",
                                        path, set_v, f"{path} to {_show(given * lr)}"))
            notes.append(f"min_lr_ratio = {_show(ratio)} <- ds_config {path} / lr")
            return ratio
        value = DEFAULTS["min_lr_ratio"] if given is None else given
        _put(cfg, path, value * lr)
        source = "--min_lr_ratio" if given is not None else "default of --min_lr_ratio"
        notes.append(f"min_lr_ratio = {_show(value)} <- {source} (written to {path} = {_show(value * lr)})")
        return value
    if kind == "WarmupLR":
        if given is not None and given != 1.0:
            raise ValueError(f"--min_lr_ratio {_show(given)} decays the rate, but the ds_config's scheduler WarmupLR "
                             "keeps it at the peak after the warm-up: drop --min_lr_ratio, or in the ds_config change "
                             "scheduler.type to WarmupCosineLR or WarmupDecayLR, or set it to \"auto\" (or remove the "
                             "scheduler) for the trainer's schedule")
        notes.append("min_lr_ratio = 1 <- ds_config scheduler.type WarmupLR (no decay)"
                     + (" = --min_lr_ratio" if given is not None else ""))
        return 1.0
    _refuse_beside(kind, "min_lr_ratio", given, "decays the rate its own way")
    return DEFAULTS["min_lr_ratio"]
