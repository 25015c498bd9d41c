"""DeepSpeed's own sequence-parallel keys (ALST / Ulysses configs) read with DeepSpeed's meaning.

A ds_config written for DeepSpeed's Ulysses (ALST) carries two top-level keys:

- ``sequence_parallel_size``: N ranks share each sequence, Ulysses all-to-all over heads; the data-parallel size
  is world / N. Here that is ``"wallfacer": {"mode": "ulysses", "sequence_parallel_size": N}``. With a
  ``"wallfacer"`` section as well, the section may name any mode (ring, WallFacer, hybrid) but its
  ``sequence_parallel_size`` must be N or absent / "auto" (then N); another value is a start-up error.
- ``seq_parallel_communication_data_type``: the dtype DeepSpeed reduces gradients in when sequence parallelism is
  on (fp32 by default, so bf16 gradients are summed in fp32). Our engine sees every rank as data-parallel (the
  sequence-parallel groups are ours), so the value becomes its ``communication_data_type``: the same reduction in
  the same dtype. A different explicit ``communication_data_type`` is a start-up error.

Both keys are removed from what DeepSpeed receives: left in, ``sequence_parallel_size`` would make ZeRO-3's
``zero.Init`` size its batch arithmetic by world / N, which our groups do not use. Pure: dicts in, dicts out.
"""
from __future__ import annotations

from typing import Any

__all__ = ["ALST_KEYS", "apply_alst_keys"]

SP_KEY = "sequence_parallel_size"
COMM_KEY = "seq_parallel_communication_data_type"
ALST_KEYS = (SP_KEY, COMM_KEY)
_DTYPES = ("fp32", "fp16", "bf16")


def _sp_section(raw: dict[str, Any], n: Any) -> dict[str, Any]:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"ds_config sequence_parallel_size = {n!r} is invalid: allowed is a positive integer "
                         "(DeepSpeed's Ulysses degree)")
    section = raw.get("wallfacer")
    if section is None:
        return {"mode": "ulysses", SP_KEY: n}
    if not isinstance(section, dict):
        return section  # the section's own parser reports its type
    ours = section.get(SP_KEY, "auto")
    if ours not in ("auto", n):
        raise ValueError(
            f"ds_config sequence_parallel_size = {n} (DeepSpeed's key) conflicts with wallfacer.sequence_parallel_size "
            f"= {ours!r}: keep one of them (the \"wallfacer\" section's also chooses the mode)"
        )
    return {**section, SP_KEY: n}


def apply_alst_keys(raw: dict[str, Any]) -> None:
    """Rewrite the ds_config ``raw`` in place: DeepSpeed's sequence-parallel keys become the ``"wallfacer"``
    section's size (and mode, when there is no section) and DeepSpeed's ``communication_data_type``; a conflict
    raises ValueError naming both keys. A ds_config without them is left unchanged."""
    if SP_KEY in raw:
        raw["wallfacer"] = _sp_section(raw, raw.pop(SP_KEY))
    if COMM_KEY in raw:
        dtype = raw.pop(COMM_KEY)
        if dtype is None:
            return
        if not isinstance(dtype, str) or dtype.lower() not in _DTYPES:
            raise ValueError(f"ds_config seq_parallel_communication_data_type = {dtype!r} is invalid: allowed are "
                             f"{list(_DTYPES)}")
        have = raw.get("communication_data_type")
        if have is not None and str(have).lower() != dtype.lower():
            raise ValueError(
                f"ds_config seq_parallel_communication_data_type = {dtype!r} conflicts with communication_data_type = "
                f"{have!r}: with ds_wallfacer every rank reduces gradients as data-parallel, so both name the same "
                "reduction; keep one"
            )
        raw["communication_data_type"] = dtype.lower()
