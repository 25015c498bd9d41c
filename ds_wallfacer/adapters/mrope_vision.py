"""Vision-language models whose positions are M-RoPE's, computed by the model's own rope-index function: Qwen2-VL,
Qwen2.5-VL, Qwen3-VL (dense, MoE), Qwen3.5 (dense, MoE), GLM-4.1V / 4.5V / 4.6V / GLM-OCR, PaddleOCR-VL,
HunYuan-VL and the Qwen2.5-Omni / Qwen3-Omni thinkers (images and videos; their audio refused), on shards.

What these families share: a ``*Model`` (the class's ``model``) holding a tower and ``language_model``, whose
``get_rope_index`` numbers the full row with 3-D positions from the ``*_grid_thw`` rows of its images and videos,
whose ``get_image_features`` encodes patch rows described by ``[t, h, w]`` grid rows (one placeholder per
``merge x merge`` patches), whose towers attend within a frame, and whose forward writes the features into the
placeholder tokens in order. What differs per family is data (``MropeFamily``): the rope-index function's name and
arguments, the grid keys, the token ids (GLM's video frames are image tokens inside video spans), how a video's
frames lie in the row, the pixel layout, extra placeholders per frame, audio; deepstack or not (its vision config).
``MropeVisionLanguage`` runs any of them:

* **positions** (loader side): the rope-index function on the full row, each packed document on its own (its
  positions restart at 0 as when it is trained alone), then sharded along the sequence like the token ids;
* **which feature row each vision token takes** (``media_index``): one index over the batch's features, images first
  (the k-th image token, row-major, takes row k) then videos (row images + k), so a shard knows its tokens' rows
  without telling images from videos by id;
* **encoding** (loss side, ``encode``): the group splits the tower's work by frames, each rank encoding its frames in
  one tower call, and one all-gather hands every rank all the features (with Qwen3-VL's deepstack features);
* **embeddings** (``inputs``): each rank embeds its own token ids and puts its vision tokens' feature rows in place.

Design: Note [Images in a sequence-parallel row] in docs/design/documents.md.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..data.media import TOKEN_TYPES_KEY
from ..hf_config import text_config
from .media_tokens import GatherRows, token_types
from .media_units import pixel_row

__all__ = ["AUDIO_KEYS", "FAMILIES", "FrameUnit", "MropeFamily", "MropeVisionLanguage", "frame_units", "mrope_misses",
           "patch_shape", "split_units"]


AUDIO_KEYS = ("input_features", "feature_attention_mask", "audio_feature_lengths", "use_audio_in_video")
"""The Omni processors' audio keys."""


@dataclass(frozen=True)
class MropeFamily:
    """What one M-RoPE family's classes differ in; everything else is the shared pattern (module docstring)."""

    model_type: str
    """The family's ``model_type`` (the tiny builders' name)."""
    kinds: tuple[str, ...] = ("image", "video")
    """The media it takes; each kind's grid rows are the batch's ``{kind}_grid_thw``."""
    rope_index: str = "get_rope_index"
    """The inner model's function numbering a row: (ids [1, n], token types [1, n] (``types_arg``), grids) ->
    (positions [3, 1, n], deltas)."""
    types_arg: bool = True
    """Whether the rope index takes the token types (``mm_token_type_ids``) as its second argument."""
    seconds: tuple[str, str] | None = None
    """(batch key, the rope index's keyword) of a video's seconds per temporal patch: Qwen2.5-VL's
    ``second_per_grid_ts``; the Omni thinkers' ``video_second_per_grid``, which their rope index requires."""
    reads: tuple[str, ...] = ()
    """Further config ids the rope index reads (the Omni thinkers find each image by the token after its start)."""
    audio: bool = False
    """Whether the class takes audio too (the Omni thinkers): refused by name (``audio_refusal``)."""
    patch_images: bool = False
    """Whether ``pixel_values`` holds each patch as an image [channels, patch, patch] (PaddleOCR-VL), not as one
    flat row (``patch_shape``)."""
    layout: tuple[int, int] = (0, 0)
    """Placeholders a frame has beyond its merged patches: (per row of merged patches, per frame); HunYuan-VL's
    merger ends every row with a separator and brackets the image (1, 2) (``frame_tokens``)."""
    video_span: tuple[str, str] | None = None
    """GLM: a video's frames are image tokens between these two config ids (the video's start and end)."""
    bracket: tuple[str, str] = ("vision_start_token_id", "vision_end_token_id")
    """The config ids around an image (the self-check's sample places them)."""
    frames_apart: bool = False
    """Whether each video frame is its own run of placeholders (the processor puts a timestamp between frames, and
    the rope index takes one grid row per run): how a row must lay out its videos."""


_OMNI = dict(types_arg=False, seconds=("video_second_per_grid", "second_per_grids"), audio=True,
             reads=("vision_start_token_id", "audio_start_token_id", "audio_token_id"))
_GLM = dict(video_span=("video_start_token_id", "video_end_token_id"),
            bracket=("image_start_token_id", "image_end_token_id"), frames_apart=True)
FAMILIES = {
    "Qwen2VLForConditionalGeneration": MropeFamily("qwen2_vl"),
    "Qwen2_5_VLForConditionalGeneration": MropeFamily("qwen2_5_vl", seconds=("second_per_grid_ts",) * 2),
    "Qwen3VLForConditionalGeneration": MropeFamily("qwen3_vl", frames_apart=True),
    "Qwen3VLMoeForConditionalGeneration": MropeFamily("qwen3_vl_moe", frames_apart=True),
    "Qwen3_5ForConditionalGeneration": MropeFamily("qwen3_5", frames_apart=True),
    "Qwen3_5MoeForConditionalGeneration": MropeFamily("qwen3_5_moe", frames_apart=True),
    "Glm4vForConditionalGeneration": MropeFamily("glm4v", **_GLM),
    "Glm4vMoeForConditionalGeneration": MropeFamily("glm4v_moe", **_GLM),
    "Glm46VForConditionalGeneration": MropeFamily("glm46v", **_GLM),
    "GlmOcrForConditionalGeneration": MropeFamily("glm_ocr", **_GLM),
    "PaddleOCRVLForConditionalGeneration": MropeFamily("paddleocr_vl", kinds=("image",), patch_images=True),
    "HunYuanVLForConditionalGeneration": MropeFamily("hunyuan_vl", kinds=("image",), layout=(1, 2), bracket=("", "")),
    "Qwen2_5OmniThinkerForConditionalGeneration": MropeFamily("qwen2_5_omni_thinker", **_OMNI),
    "Qwen3OmniMoeThinkerForConditionalGeneration": MropeFamily("qwen3_omni_moe_thinker", **_OMNI),
}
"""The classes whose images train on shards with their own M-RoPE positions, each checked exact by the sweep."""


def patch_shape(model: nn.Module) -> tuple[int, ...]:
    """The shape of one patch in the model's ``pixel_values`` (after the patch dimension): one flat row of
    ``media_units.pixel_row`` values, or PaddleOCR-VL's [channels, patch, patch]."""
    vc = model.config.vision_config
    family = FAMILIES.get(type(model).__name__)
    if family is not None and family.patch_images:
        return int(getattr(vc, "num_channels", 3)), int(vc.patch_size), int(vc.patch_size)
    return (pixel_row(vc),)


def mrope_misses(model: nn.Module, family: MropeFamily) -> str | None:
    """What this model lacks of its family's pattern (a transformers release that renamed or changed an argument):
    None when it has it all; checked at construction, so a changed model is refused, not trained wrong."""
    inner = getattr(model, "model", None)
    want = ["get_image_features", family.rope_index] + (["get_video_features"] if "video" in family.kinds else [])
    missing = [m for m in want if not callable(getattr(inner, m, None))]
    if missing or getattr(inner, "language_model", None) is None:
        return f"its inner model lacks {missing or ['language_model']}"
    params = list(inspect.signature(getattr(inner, family.rope_index)).parameters)
    args = ["input_ids"] + (["mm_token_type_ids"] if family.types_arg else []) + \
        [f"{k}_grid_thw" for k in family.kinds] + ["attention_mask"] + ([family.seconds[1]] if family.seconds else [])
    if params[:2] != args[:2] or any(a not in params for a in args):
        return f"its {family.rope_index} takes {params}, not {args}"
    cfg, vc = model.config, getattr(model.config, "vision_config", None)
    ids = ["image_token_id"] + (["video_token_id"] if "video" in family.kinds and not family.video_span else []) + \
        list(family.video_span or ()) + list(family.reads)
    if vc is None or getattr(vc, "spatial_merge_size", None) is None or any(getattr(cfg, i, None) is None
                                                                             for i in ids):
        return f"its config lacks vision_config.spatial_merge_size or one of {ids}"
    return None


def frame_tokens(height: int, width: int, merge: int, layout: tuple[int, int] = (0, 0)) -> int:
    """Placeholders of one frame of ``height`` x ``width`` patches: its merged patches, and ``layout``'s extra
    tokens per merged row and per frame."""
    return (height // merge) * (width // merge + layout[0]) + layout[1]


def _take_grids(grids: torch.Tensor | None, start: int, tokens: int, merge: int, what: str,
                layout: tuple[int, int] = (0, 0)) -> int:
    """The end of the run of ``grids`` rows from ``start`` whose features fill exactly ``tokens`` placeholders."""
    end, got = start, 0
    while got < tokens:
        if grids is None or end >= grids.shape[0]:
            raise ValueError(f"the batch has more {what} tokens than its {what}_grid_thw rows describe: give one row "
                             f"per {what}, in the order they appear")
        t, h, w = (int(x) for x in grids[end])
        got += t * frame_tokens(h, w, merge, layout)
        end += 1
    if got != tokens:
        raise ValueError(f"a {what} is cut across documents (or rows): its tokens must all lie in one document")
    return end


@dataclass(frozen=True)
class FrameUnit:
    """One frame of one image or video: its rows of ``pixel_values`` (``key``) and its placeholders."""

    kind: str
    key: str
    pixel_start: int
    height: int
    width: int
    merge: int
    layout: tuple[int, int] = (0, 0)

    @property
    def patches(self) -> int:
        return self.height * self.width

    @property
    def tokens(self) -> int:
        return frame_tokens(self.height, self.width, self.merge, self.layout)


def frame_units(media: Mapping[str, Any], merge: int, layout: tuple[int, int] = (0, 0)) -> list[FrameUnit]:
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
                out.append(FrameUnit(kind, key, start, int(h), int(w), merge, layout))
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


def _span_types(ids: torch.Tensor, image_id: int, start_id: int, end_id: int) -> torch.Tensor:
    """[B, N] int: GLM's kinds from the ids alone: image tokens 1, those between a video's start and end ids 2."""
    inside = (ids == start_id).long().cumsum(-1) - (ids == end_id).long().cumsum(-1) > 0
    image = (ids == image_id).long()
    return image + image * inside.long()


class MropeVisionLanguage:
    """An M-RoPE family's class (``FAMILIES``): the model's rope index, ``get_image_features`` and its language
    model, used on shards (a ``VisionAdapter``)."""

    refusal: str | None = None

    def __init__(self, model: nn.Module, family: MropeFamily | None = None) -> None:
        self._model = model
        self.family = family or FAMILIES[type(model).__name__]
        cfg = model.config
        self.image_token_id = int(cfg.image_token_id)
        video = None if "video" not in self.family.kinds else getattr(cfg, "video_token_id", None)
        self.video_token_id = None if self.family.video_span or video is None else int(video)
        self.merge = int(cfg.vision_config.spatial_merge_size)
        self.deepstack = bool(getattr(cfg.vision_config, "deepstack_visual_indexes", None))

    @property
    def inner(self) -> nn.Module:
        """The ``*Model`` holding ``visual``, ``language_model`` and the rope index."""
        return self._model.model

    # ---- loader side: pure functions of the full (padded) row and the media descriptions ----

    @property
    def refused_keys(self) -> dict[str, str]:
        """Batch keys the loader refuses with the reason: the Omni thinkers' audio."""
        return dict.fromkeys(AUDIO_KEYS, self.audio_refusal()) if self.family.audio else {}

    def audio_refusal(self) -> str:
        return (f"{type(self._model).__name__}: audio is not supported under sequence parallelism: ds_wallfacer "
                "places the features of its images and videos on shards, not those of its audio tower (nor the "
                "positions its audio spans take in the row). Train it with images, videos and text, without audio")

    def token_types(self, ids: torch.Tensor, given: Any = None) -> torch.Tensor:
        """[B, N] int: 0 text, 1 image, 2 video (``media_tokens.token_types``; GLM: by video spans); audio
        placeholders refused (``audio_refusal``)."""
        if self.family.audio and bool((ids == int(self._model.config.audio_token_id)).any()):
            raise ValueError(self.audio_refusal())
        span = self.family.video_span
        if span is None:
            return token_types(ids, self.image_token_id, self.video_token_id, given)
        cfg = self._model.config
        types = _span_types(ids, self.image_token_id, int(getattr(cfg, span[0])), int(getattr(cfg, span[1])))
        return token_types(ids, None, None, given, types=types)

    def positions(self, ids: torch.Tensor, types: torch.Tensor, media: Mapping[str, Any],
                  documents: Sequence[Sequence[int]] | None) -> torch.Tensor:
        """[3, B, N] M-RoPE positions of the full row (HunYuan-VL: one axis per section): each document
        (``documents``: every row's lengths, the last one padding) through the rope index on its own; text-only
        pieces count 0, 1, 2, ... on every axis."""
        kinds = self.family.kinds
        if "video" not in kinds and any(media.get(k) is not None for k in ("pixel_values_videos", "video_grid_thw")):
            raise ValueError(f"{type(self._model).__name__} takes no videos: give its frames as images")
        grids = {k: media.get(f"{k}_grid_thw") for k in kinds}
        grids = {k: (torch.as_tensor(v).long().reshape(-1, 3) if v is not None else None) for k, v in grids.items()}
        at = {k: 0 for k in kinds}
        b, n = ids.shape
        out = torch.arange(n, dtype=torch.long).expand(3, b, n).clone()
        for r in range(b):
            s = 0
            for length in (list(documents[r]) if documents is not None else [n]):
                e = s + int(length)
                piece = types[r, s:e]
                counts = {k: int((piece == i + 1).sum()) for i, k in enumerate(kinds)}
                if any(counts.values()):
                    ends = {k: _take_grids(grids[k], at[k], counts[k], self.merge, k, self.family.layout)
                            if counts[k] else at[k] for k in kinds}
                    pos = self._rope_piece(ids[r:r + 1, s:e], piece, grids, at, ends, media)
                    out = out.to(torch.promote_types(out.dtype, pos.dtype))
                    if pos.shape[0] != out.shape[0]:  # HunYuan-VL: an axis per section (the first piece says)
                        out = out[:1].expand(pos.shape[0], -1, -1).clone()  # so far text: equal on every axis
                    out[:, r, s:e] = pos
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

    def _rope_piece(self, ids: torch.Tensor, piece: torch.Tensor, grids: Mapping[str, torch.Tensor | None],
                    at: Mapping[str, int], ends: Mapping[str, int], media: Mapping[str, Any]) -> torch.Tensor:
        """[3, n] positions of one document (``ids`` [1, n]) with its grid rows ``at`` ... ``ends``."""
        fam = self.family
        kw: dict[str, Any] = {f"{k}_grid_thw": grids[k][at[k]:ends[k]] for k in fam.kinds if ends[k] > at[k]}
        if fam.seconds and ends.get("video", 0) > at.get("video", 0):
            seconds = media.get(fam.seconds[0])
            if seconds is None and fam.audio:
                raise ValueError(f"{type(self._model).__name__}: a batch with videos needs {fam.seconds[0]} (the "
                                 "processor's seconds per temporal patch), which its positions read")
            if seconds is not None:
                kw[fam.seconds[1]] = torch.as_tensor(seconds).reshape(-1)[at["video"]:ends["video"]]
        args = (ids, piece[None].int()) if fam.types_arg else (ids,)
        kw["attention_mask"] = torch.ones_like(ids)  # the whole document (Qwen3-Omni's rope index requires a mask)
        pos, _ = getattr(self.inner, fam.rope_index)(*args, **kw)
        pos = pos[:, 0].cpu()
        return pos if pos.is_floating_point() else pos.long()  # Qwen3-Omni's are float (seconds x 25 per frame)

    @staticmethod
    def media_index(types: torch.Tensor) -> torch.Tensor:
        """[B, N]: one index over the batch's features, images then videos: the k-th image token (row-major) gets
        k, the k-th video token (images' tokens) + k; text -1."""
        out = torch.full_like(types, -1)
        base = 0
        for kind in (1, 2):
            mask = types == kind
            count = int(mask.sum())
            out[mask] = torch.arange(base, base + count, dtype=out.dtype)
            base += count
        return out

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
        visual = media_index >= 0
        main, *stack = feats.index_select(0, media_index[visual].to(feats.device)).split(emb.shape[-1], dim=-1)
        emb = emb.masked_scatter(visual[..., None].to(emb.device), main)
        if self.deepstack and stack:
            return emb, {"visual_pos_masks": visual.to(emb.device), "deepstack_visual_embeds": list(stack)}
        return emb, {}

    def encode(self, media: Mapping[str, Any], *, group: Any, comm: Any, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
        """[image + video tokens, H x (1 + deepstack layers)]: the features of every image, then every video, of the
        batch (``media_index``'s rows), the tower's work split over the P ranks of ``group`` (None: this rank alone).
        Every frame is a unit (these towers attend within a frame, so a unit's features do not depend on the
        others); each rank encodes the units ``split_units`` gives it in one tower call, and one all-gather (whose
        backward is a reduce-scatter: each rank gets the gradient of its own rows from every rank) hands every rank
        all the features. A rank with no unit runs the tower on one blank patch (``_touch_tower``): every rank calls
        the tower exactly once per forward, which ZeRO-3's parameter gathers and ZeRO 1/2's gradient hooks need."""
        units = frame_units(media, self.merge, self.family.layout)
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
        return flat.index_select(0, torch.tensor(order["image"] + order["video"], device=flat.device,
                                                 dtype=torch.long))

    def _deepstack_layers(self) -> int:
        return len(getattr(self._model.config.vision_config, "deepstack_visual_indexes", None) or ()) \
            if self.deepstack else 0

    def _touch_tower(self, emb: torch.Tensor) -> torch.Tensor:
        """A batch (or a rank's share) without images: ``emb`` + 0 x the tower's output on one blank merged patch, so
        the tower runs once and its parameters get a (zero) gradient on every rank. Data-parallel replicas may hold
        batches with and without images in the same step: ZeRO 1/2 fill their reduce buckets in gradient-hook order,
        so a replica whose tower got no gradient would reduce different buckets than one whose did (measured: the
        step fails), and ZeRO-3 gathers the tower's parameters collectively at each call."""
        grid = torch.tensor([[1, self.merge, self.merge]], device=emb.device)
        blank = torch.zeros(self.merge**2, *patch_shape(self._model), device=emb.device, dtype=emb.dtype)
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
        start, end = (getattr(cfg, k, None) if k else None for k in self.family.bracket)
        ids = ids.clone()
        special = [self.image_token_id, self.video_token_id, start, end,
                   *(getattr(cfg, k, None) for k in (*(self.family.video_span or ()), *self.family.reads))]
        for t in special:
            if t is not None:
                ids[ids == int(t)] = 0
        n = ids.shape[1]
        side = max(2, int((n // 4) ** 0.5))
        grid = torch.tensor([[1, side * self.merge, side * self.merge]])
        tokens = frame_tokens(side * self.merge, side * self.merge, self.merge, self.family.layout)
        if n < tokens + 4:
            return {"input_ids": ids}
        at = n // 2 - tokens // 2
        ids[0, at:at + tokens] = self.image_token_id
        if start is not None and end is not None:
            ids[0, at - 1], ids[0, at + tokens] = int(start), int(end)
        pixels = torch.randn(int(grid.prod()), *patch_shape(self._model),
                             generator=torch.Generator().manual_seed(0x1A6E))
        # the mask: the Omni thinkers compute their M-RoPE positions only when given one (1-D positions without)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels,
                "image_grid_thw": grid, TOKEN_TYPES_KEY: self.token_types(ids).int()}
