"""What every vision-language adapter (``mrope_vision.py``'s M-RoPE, ``placeholder_vision.py``'s placeholder pattern)
does alike with the placeholder tokens and the features: each token's kind, each placeholder's feature row, and the
all-gather that hands every rank the rows the group's towers computed.

Design: Note [Images in a sequence-parallel row] in docs/design/documents.md.
"""
from __future__ import annotations

from typing import Any

import torch

from ..data.media import TOKEN_TYPES_KEY

__all__ = ["GatherRows", "media_index", "token_types"]


def token_types(ids: torch.Tensor, image_id: int | None, video_id: int | None, given: Any = None, *,
                types: torch.Tensor | None = None) -> torch.Tensor:
    """[B, N] int: 0 text, 1 image, 2 video, from the token ids (added to ``types``, the kinds an adapter found
    otherwise); the processor's ``mm_token_type_ids`` (``given``, before the loader's padding) must agree."""
    types = torch.zeros_like(ids, dtype=torch.long) if types is None else types.long().clone()
    if image_id is not None:
        types += (ids == image_id).long()
    if video_id is not None:
        types += 2 * (ids == video_id).long()
    if given is not None:
        g = torch.as_tensor(given).long()
        if g.dim() == 1:
            g = g[None]
        if g.shape[0] != ids.shape[0] or not torch.equal(g, types[:, :g.shape[1]]) or \
                bool(types[:, g.shape[1]:].any()):
            raise ValueError(f"{TOKEN_TYPES_KEY} disagrees with the image / video placeholder tokens of input_ids "
                             f"(ids {image_id} / {video_id})")
    return types


def media_index(types: torch.Tensor) -> torch.Tensor:
    """[B, N]: the k-th image (video) token of the batch, row-major, gets k (the row ``masked_scatter`` gives it in
    the model's own forward); text -1."""
    out = torch.full_like(types, -1)
    for kind in (1, 2):
        mask = types == kind
        out[mask] = torch.arange(int(mask.sum()), dtype=out.dtype)
    return out


class GatherRows(torch.autograd.Function):
    """[m, D] on each rank -> [P, m, D] (the group's rows, in rank order); backward: a reduce-scatter, each rank
    getting the sum over ranks of the gradient of its own rows."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Any, group: Any) -> torch.Tensor:
        ctx.comm, ctx.group = comm, group
        return comm.all_gather(x, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        with ctx.comm.phase("vision"):
            return ctx.comm.reduce_scatter(g.contiguous(), ctx.group), None, None
