"""Input checks shared by the sequence-parallel attentions: local shape/dtype checks, then one small metadata
all-gather over the sequence-parallel group so that every rank raises the same clear error together. Shards of
different shapes would otherwise abort inside a collective (gloo: "Received data size doesn't match") or hang.
One all-gather per new input signature: ``checked`` remembers the signatures already agreed on.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import CommLayer

__all__ = ["DTYPES", "check_inputs_agree", "local_error"]

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_NAMES = ("batch", "q heads", "kv heads", "local seq len", "head dim", "value head dim", "dtype", "causal")


def local_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return f"q, k, v must be 4-D [batch, heads, seq, head_dim]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
    if k.shape[:3] != v.shape[:3]:  # v's head dim may differ (multi-head latent attention)
        return f"k and v differ in batch, heads or sequence: {tuple(k.shape)} vs {tuple(v.shape)}"
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[3] != k.shape[3]:
        return f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree in batch, sequence or head_dim"
    if q.shape[1] % k.shape[1] != 0:
        return f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})"
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in DTYPES:
        return f"q, k, v dtypes must match and be one of {DTYPES}; got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.shape[2] % 2 != 0:
        return (
            f"local sequence length {q.shape[2]} is odd: each rank holds 2 of 2P chunks, so the full sequence "
            "length must be divisible by 2P; pad the batch"
        )
    return None


def check_inputs_agree(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, error: str | None, who: str,
    comm: CommLayer, group: dist.ProcessGroup, checked: set,
) -> None:
    """Raise ``ValueError`` on every rank of ``group`` if this rank's ``error`` (from ``local_error`` and the
    caller's own rules) is set on any rank, or if the ranks' shapes, dtypes or causality differ."""
    meta = (
        (0,) * len(_NAMES)
        if error
        else (q.shape[0], q.shape[1], k.shape[1], q.shape[2], q.shape[3], v.shape[3], DTYPES.index(q.dtype),
              int(causal))
    )
    key = (meta, error)
    if key in checked:
        return
    row = torch.tensor([int(bool(error)), *meta], dtype=torch.int64, device=q.device)
    rows = comm.all_gather(row, group, kind="check").tolist()
    bad = [i for i, r in enumerate(rows) if r[0]]
    if error:
        raise ValueError(f"{who}: {error}")
    if bad:
        raise ValueError(f"{who}: sequence-parallel rank(s) {bad} rejected their inputs")
    for i, name in enumerate(_NAMES):
        values = [r[1 + i] for r in rows]
        if len(set(values)) > 1:
            shown = [str(DTYPES[x]) for x in values] if name == "dtype" else values
            raise ValueError(
                f"{who}: {name} differs across sequence-parallel ranks: {shown} (by rank index); every rank must "
                "call attention with equally shaped shards of one sequence"
            )
    checked.add(key)
