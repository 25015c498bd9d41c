"""Vision-language models: images and videos inside a sequence-parallel row.

The language model of a VLM is sharded like any text model; what the images add is computed on the full row first
and then cut with the tokens:

* **positions** (loader side, ``positions``): Qwen's 3-D M-RoPE positions [3, B, N] come from the model's own
  ``get_rope_index`` on the full row (each packed document on its own, so a document's positions restart at 0 as
  when it is trained alone), then are sharded along the sequence like the token ids;
* **which feature row each vision token takes** (``media_index``): the k-th image (video) token of the batch, in
  row-major order, takes row k of the batch's concatenated image (video) features; sharded like the tokens;
* **encoding** (loss side, ``encode``): the group (which sees the same batch) splits the vision tower's work by
  frames, each rank encoding its frames in one tower call, and one all-gather hands every rank all the features
  (with Qwen3-VL's "deepstack" features, added to the hidden states after the first text layers);
* **embeddings** (``inputs``): each rank embeds its own token ids and puts its vision tokens' feature rows in place.

The language model then runs on the shard with ``inputs_embeds`` and the sharded M-RoPE positions; the attention,
MsT and the loss are the text path. The all-gather's backward is a reduce-scatter, so each rank's tower gets its
frames' share of the one-process gradient; every rank calls the tower once per forward (a rank without frames on a
blank patch, times 0), so ZeRO's parameter gathers and gradient hooks run alike on every rank.

Only the families checked exact are adapted (``ADAPTED``); any other model with a vision tower gets a batch with
pixels refused with the reason (``media_refusal``). Design: Note [Images in a sequence-parallel row] in
docs/design/documents.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, NoReturn, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..data.media import TOKEN_TYPES_KEY, VisionAdapter
from ..hf_config import text_config
from .media_tokens import GatherRows, media_index, token_types
from .media_units import pixel_row
from .placeholder_forms import PlaceholderForm, placeholder_form
from .placeholder_vision import PlaceholderVisionLanguage

__all__ = ["ADAPTED", "FrameUnit", "QwenVisionLanguage", "RefusedVision", "frame_units", "has_vision_tower",
           "media_refusal", "pixel_row", "runs_images", "split_units", "vision_language"]

ADAPTED = {
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "Qwen3VLForConditionalGeneration": "qwen3_vl",
    "Qwen3VLMoeForConditionalGeneration": "qwen3_vl_moe",
}
"""The Qwen-VL classes (M-RoPE positions: ``QwenVisionLanguage``), checked exact by the sweep. Every other class
with the placeholder pattern is recognised from its code (``placeholder_vision.py``)."""

_REFUSED = {
    "Gemma3nForConditionalGeneration": "its image and audio tokens attend bidirectionally, like Gemma 3",
}


def has_vision_tower(model: nn.Module) -> bool:
    """Whether the model takes images (or audio): a vision or audio config next to its language model, or a forward
    that takes ``pixel_values``."""
    import inspect

    cfg = getattr(model, "config", None)
    if any(getattr(cfg, k, None) is not None for k in ("vision_config", "audio_config", "vision_tower_config")):
        return True
    forward = getattr(model, "forward", None)
    try:
        return forward is not None and "pixel_values" in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False


def media_refusal(model: nn.Module, why: str | None = None) -> str:
    """Why this model's batches with pixels are refused (a model without an adapter); ``why``: what its forward
    does that no adapter reproduces (``placeholder_form``'s answer)."""
    name = type(model).__name__
    why = _REFUSED.get(name) or why or "ds_wallfacer has no adapter that places its image features on shards"
    return (f"{name}: batches with images or videos are not supported under sequence parallelism: {why}. Train it on "
            "text only, or a model whose images train on shards (docs/models.md, the multimodal table)")


class RefusedVision:
    """A model with a vision tower but no adapter (a ``VisionAdapter`` that refuses): a batch with pixels raises
    ``refusal``; text batches train as a text model's, and the self-check runs text."""

    def __init__(self, refusal: str) -> None:
        self.refusal = refusal

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise ValueError(self.refusal)

    token_types = positions = media_index = inputs = _refuse  # any batch with pixels: the reason, not a crash

    def sample(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"input_ids": ids}


def vision_language(model: nn.Module) -> VisionAdapter | None:
    """The adapter of an HF vision-language model: ``QwenVisionLanguage`` (``ADAPTED``), else
    ``PlaceholderVisionLanguage`` for a model whose code has the placeholder pattern; ``RefusedVision`` for one
    with a vision tower and neither (saying what its forward does); None for a text model."""
    name = type(model).__name__
    if name in ADAPTED:
        return QwenVisionLanguage(model)
    if not has_vision_tower(model):
        return None
    form = placeholder_form(model) if name not in _REFUSED else None
    if isinstance(form, PlaceholderForm):
        return PlaceholderVisionLanguage(model, form)
    return RefusedVision(media_refusal(model, form))


def runs_images(model: nn.Module) -> bool:
    """Whether the model's images run on shards with an adapter (its tower then keeps its own attention)."""
    return isinstance(vision_language(model), (QwenVisionLanguage, PlaceholderVisionLanguage))


def _take_grids(grids: torch.Tensor | None, start: int, tokens: int, merge: int, what: str) -> int:
    """The end of the run of ``grids`` rows from ``start`` whose features fill exactly ``tokens`` placeholders."""
    end, got = start, 0
    while got < tokens:
        if grids is None or end >= grids.shape[0]:
            raise ValueError(f"the batch has more {what} tokens than its {what}_grid_thw rows describe: give one row "
                             f"per {what}, in the order they appear")
        got += int(grids[end].prod()) // merge**2
        end += 1
    if got != tokens:
        raise ValueError(f"a {what} is cut across documents (or rows): its tokens must all lie in one document")
    return end


@dataclass(frozen=True)
class FrameUnit:
    """One frame of one image or video: its rows of ``pixel_values`` (``key``) and its merged tokens."""

    kind: str
    key: str
    pixel_start: int
    height: int
    width: int
    merge: int

    @property
    def patches(self) -> int:
        return self.height * self.width

    @property
    def tokens(self) -> int:
        return self.patches // self.merge**2


def frame_units(media: Mapping[str, Any], merge: int) -> list[FrameUnit]:
    """Every frame of the batch's images, then of its videos, in order (pure). Frame k of an item of grid (t, h, w)
    holds that item's pixel rows k·h·w ... (k+1)·h·w and feature rows in the same order."""
    out = []
    for kind, key in (("image", "pixel_values"), ("video", "pixel_values_videos")):
        grids = media.get(f"{kind}_grid_thw")
        if media.get(key) is None or grids is None:
            continue
        start = 0
        for t, h, w in torch.as_tensor(grids).reshape(-1, 3).tolist():
            for _ in range(int(t)):
                out.append(FrameUnit(kind, key, start, int(h), int(w), merge))
                start += int(h) * int(w)
    return out


def split_units(work: Sequence[int], ranks: int) -> list[int]:
    """Each unit's rank: the heaviest unit first to the least-loaded rank (ties: the lower rank); pure, so every
    rank computes the same split."""
    load = [0] * ranks
    owner = [0] * len(work)
    for i in sorted(range(len(work)), key=lambda i: (-work[i], i)):
        r = min(range(ranks), key=lambda q: (load[q], q))
        owner[i] = r
        load[r] += work[i]
    return owner


class QwenVisionLanguage:
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL (dense and MoE): the model's ``get_rope_index``, ``get_image_features``,
    ``get_video_features`` and its language model, used on shards (a ``VisionAdapter``)."""

    refusal: str | None = None

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        cfg = model.config
        self.image_token_id = int(cfg.image_token_id)
        self.video_token_id = int(cfg.video_token_id)
        self.merge = int(cfg.vision_config.spatial_merge_size)
        self.deepstack = bool(getattr(cfg.vision_config, "deepstack_visual_indexes", None))

    @property
    def inner(self) -> nn.Module:
        """The ``*Model`` holding ``visual``, ``language_model`` and ``get_rope_index``."""
        return self._model.model

    # ---- loader side: pure functions of the full (padded) row and the media descriptions ----

    def token_types(self, ids: torch.Tensor, given: Any = None) -> torch.Tensor:
        """[B, N] int: 0 text, 1 image, 2 video (``media_tokens.token_types``)."""
        return token_types(ids, self.image_token_id, self.video_token_id, given)

    def positions(self, ids: torch.Tensor, types: torch.Tensor, media: Mapping[str, Any],
                  documents: Sequence[Sequence[int]] | None) -> torch.Tensor:
        """[3, B, N] M-RoPE positions of the full row: each document (``documents``: every row's lengths, the last
        one padding) through ``get_rope_index`` on its own; text-only pieces count 0, 1, 2, ... on all three."""
        grids = {k: media.get(f"{k}_grid_thw") for k in ("image", "video")}
        grids = {k: (torch.as_tensor(v).long().reshape(-1, 3) if v is not None else None) for k, v in grids.items()}
        seconds = media.get("second_per_grid_ts")
        at = {"image": 0, "video": 0}
        b, n = ids.shape
        out = torch.arange(n, dtype=torch.long).expand(3, b, n).clone()
        for r in range(b):
            lengths = list(documents[r]) if documents is not None else [n]
            s = 0
            for length in lengths:
                e = s + int(length)
                piece_types = types[r, s:e]
                counts = {"image": int((piece_types == 1).sum()), "video": int((piece_types == 2).sum())}
                if counts["image"] or counts["video"]:
                    ends = {k: _take_grids(grids[k], at[k], counts[k], self.merge, k) if counts[k] else at[k]
                            for k in at}
                    kw: dict[str, Any] = {}
                    if counts["image"]:
                        kw["image_grid_thw"] = grids["image"][at["image"]:ends["image"]]
                    if counts["video"]:
                        kw["video_grid_thw"] = grids["video"][at["video"]:ends["video"]]
                        if seconds is not None:
                            kw["second_per_grid_ts"] = torch.as_tensor(seconds).reshape(-1)[at["video"]:ends["video"]]
                    pos, _ = self.inner.get_rope_index(ids[r:r + 1, s:e], piece_types[None].int(), **kw)
                    out[:, r, s:e] = pos[:, 0].long().cpu()
                    at = ends
                else:
                    out[:, r, s:e] = torch.arange(e - s)
                s = e
            if s < n:  # the loader's padding: text positions, never attended to by real tokens
                out[:, r, s:] = torch.arange(n - s)
        for k, g in grids.items():
            if g is not None and at[k] != g.shape[0]:
                raise ValueError(f"{k}_grid_thw has {g.shape[0]} rows but the batch's {k} tokens fill {at[k]}: give "
                                 f"one row per {k} that appears in input_ids")
        return out

    media_index = staticmethod(media_index)

    # ---- loss side: this rank's embeddings ----

    def inputs(self, input_ids: torch.Tensor, media_index: torch.Tensor | None, media: Mapping[str, Any], *,
               group: Any = None, comm: Any = None) -> tuple[torch.Tensor, dict[str, Any]]:
        """(inputs_embeds [B, S_l, H], extra language-model keywords) of this rank's tokens: its token embeddings
        with its vision tokens' feature rows in place (and Qwen3-VL's deepstack rows); the tower's work split over
        the ``group`` (``encode``)."""
        emb = self.inner.get_input_embeddings()(input_ids)
        if not any(media.get(k) is not None for k in ("pixel_values", "pixel_values_videos")):
            return self._touch_tower(emb), {}
        feats = self.encode(media, group=group, comm=comm, dtype=emb.dtype, device=emb.device)
        masks, deep = {}, {}
        for kind, token in (("image", self.image_token_id), ("video", self.video_token_id)):
            if kind not in feats:
                continue
            mask = input_ids == token
            rows = media_index[mask].to(emb.device)
            main, *stack = feats[kind]
            emb = emb.masked_scatter(mask[..., None], main.index_select(0, rows))
            masks[kind] = mask
            deep[kind] = [f.index_select(0, rows) for f in stack]
        extra: dict[str, Any] = {}
        layers = len(next(iter(deep.values())))
        if self.deepstack and layers:
            visual = torch.zeros_like(input_ids, dtype=torch.bool)
            for m in masks.values():
                visual = visual | m
            joint_layers = []
            for i in range(layers):
                joint = emb.new_zeros(int(visual.sum()), emb.shape[-1])
                for kind, m in masks.items():
                    at = m[visual].nonzero().reshape(-1)
                    joint = joint.index_put((at,), deep[kind][i])
                joint_layers.append(joint)
            extra = {"visual_pos_masks": visual, "deepstack_visual_embeds": joint_layers}
        return emb, extra

    def encode(self, media: Mapping[str, Any], *, group: Any, comm: Any, dtype: torch.dtype,
               device: torch.device) -> dict[str, list[torch.Tensor]]:
        """{"image" / "video": [features [tokens, H], *deepstack features]} of every image (video) of the batch, the
        tower's work split over the P ranks of ``group`` (None: this rank alone). Every frame of every image and
        video is a unit (the Qwen towers attend within a frame only, so a unit's features do not depend on the
        others); each rank encodes the units ``split_units`` gives it in one tower call, and one all-gather (whose
        backward is a reduce-scatter: each rank gets the gradient of its own rows from every rank) hands every rank
        all the features. A rank with no unit runs the tower on one blank patch (``_touch_tower``): every rank calls
        the tower exactly once per forward, which ZeRO-3's parameter gathers and ZeRO 1/2's gradient hooks need."""
        units = frame_units(media, self.merge)
        p = dist.get_world_size(group) if group is not None and comm is not None else 1
        me = dist.get_rank(group) if p > 1 else 0
        owner = split_units([u.patches for u in units], p)
        mine = [u for u, r in zip(units, owner) if r == me]
        hidden = int(text_config(self._model).hidden_size)  # not the embedding's weight: ZeRO-3 would gather it
        rows = max(sum(u.tokens for u, r in zip(units, owner) if r == q) for q in range(p))
        if mine:
            pixels = torch.cat([torch.as_tensor(media[u.key])[u.pixel_start:u.pixel_start + u.patches]
                                for u in mine]).to(device)  # only this rank's frames move to its device
            grid = torch.tensor([[1, u.height, u.width] for u in mine], device=device)
            res = self.inner.get_image_features(pixels, grid, return_dict=True)
            parts = [torch.cat(tuple(res.pooler_output), dim=0)]
            if self.deepstack:
                parts += [torch.cat(tuple(f), dim=0) for f in res.deepstack_features]
            local = torch.cat(parts, dim=-1).to(device, dtype)
        else:
            zero = self._touch_tower(torch.zeros((), device=device, dtype=dtype))
            local = torch.zeros(0, hidden * (1 + self._deepstack_layers()), device=device, dtype=dtype) + zero
        flat = local
        if p > 1:
            local = torch.cat([local, local.new_zeros(rows - local.shape[0], local.shape[1])])
            with comm.phase("vision"):
                flat = GatherRows.apply(local, comm, group).reshape(p * rows, -1)
        at = [0] * p
        order: dict[str, list[int]] = {"image": [], "video": []}
        for u, r in zip(units, owner):
            order[u.kind] += range(r * rows + at[r], r * rows + at[r] + u.tokens)
            at[r] += u.tokens
        return {kind: list(flat.index_select(0, torch.tensor(idx, device=flat.device)).split(hidden, dim=-1))
                for kind, idx in order.items() if idx}

    def _deepstack_layers(self) -> int:
        return len(getattr(self._model.config.vision_config, "deepstack_visual_indexes", None) or ()) \
            if self.deepstack else 0

    def _touch_tower(self, emb: torch.Tensor) -> torch.Tensor:
        """A batch (or a rank's share) without images: ``emb`` + 0 x the tower's output on one blank merged patch, so
        the tower runs once and its parameters get a (zero) gradient on every rank. Data-parallel replicas may hold
        batches with and without images in the same step: ZeRO 1/2 fill their reduce buckets in gradient-hook order,
        so a replica whose tower got no gradient would reduce different buckets than one whose did (measured: the
        step fails), and ZeRO-3 gathers the tower's parameters collectively at each call."""
        row = pixel_row(self._model.config.vision_config)
        grid = torch.tensor([[1, self.merge, self.merge]], device=emb.device)
        blank = torch.zeros(self.merge**2, row, device=emb.device, dtype=emb.dtype)
        out = self.inner.get_image_features(blank, grid, return_dict=True)
        total = torch.cat(tuple(out.pooler_output)).sum()
        for f in getattr(out, "deepstack_features", None) or ():
            total = total + torch.cat(tuple(f)).sum()
        return emb + 0.0 * total.to(emb.dtype)

    # ---- the self-check's sample ----

    def sample(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """A one-row batch with one image in the middle of ``ids`` [1, N] (random pixels; a square grid of about
        N / 4 merged patches, at least 2 x 2): the start-up self-check's image + text sequence."""
        cfg = self._model.config
        vc = cfg.vision_config
        ids = ids.clone()
        special = [self.image_token_id, self.video_token_id, getattr(cfg, "vision_start_token_id", None),
                   getattr(cfg, "vision_end_token_id", None)]
        for t in special:
            if t is not None:
                ids[ids == int(t)] = 0
        n = ids.shape[1]
        side = max(2, int((n // 4) ** 0.5))
        grid = torch.tensor([[1, side * self.merge, side * self.merge]])
        tokens = side * side
        if n < tokens + 4:
            return {"input_ids": ids}
        at = n // 2 - tokens // 2
        ids[0, at:at + tokens] = self.image_token_id
        if getattr(cfg, "vision_start_token_id", None) is not None:
            ids[0, at - 1] = int(cfg.vision_start_token_id)
            ids[0, at + tokens] = int(cfg.vision_end_token_id)
        row = pixel_row(vc)
        pixels = torch.randn(int(grid.prod()), row, generator=torch.Generator().manual_seed(0x1A6E))
        return {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": grid,
                TOKEN_TYPES_KEY: self.token_types(ids).int()}
