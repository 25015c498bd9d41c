"""Vision-language models: images and videos inside a sequence-parallel row.

The language model of a VLM is sharded like any text model; what the images add is computed on the full row first
and then cut with the tokens:

* **positions** (loader side, ``positions``): Qwen's 3-D M-RoPE positions [3, B, N] come from the model's own
  ``get_rope_index`` on the full row (each packed document on its own, so a document's positions restart at 0 as
  when it is trained alone), then are sharded along the sequence like the token ids;
* **which feature row each vision token takes** (``media_index``): the k-th image (video) token of the batch, in
  row-major order, takes row k of the batch's concatenated image (video) features; sharded like the tokens;
* **embeddings** (loss side, ``inputs``): the vision tower runs on every image of the batch on every rank of the
  group (the group sees the same batch), the rank embeds its own token ids and puts its vision tokens' feature rows
  in place; Qwen3-VL's "deepstack" features (added to the hidden states after the first text layers) are selected
  the same way.

The language model then runs on the shard with ``inputs_embeds`` and the sharded M-RoPE positions; the attention,
MsT and the loss are the text path. Every rank backpropagates through the whole vision tower (rows it did not
select get zero gradient), so DeepSpeed's gradient hooks fire alike on every rank, and the summed gradient is the
one-process gradient exactly as for the token embeddings.

Only the families checked exact are adapted (``ADAPTED``); any other model with a vision tower gets a batch with
pixels refused with the reason (``media_refusal``). Design: Note [Images in a sequence-parallel row] in
docs/design/documents.md.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import nn

from ..data.loader import MEDIA_KEYS, TOKEN_TYPES_KEY

__all__ = ["ADAPTED", "MEDIA_INDEX_KEY", "MEDIA_KEYS", "ROPE_KEY", "QwenVisionLanguage", "RefusedVision",
           "has_vision_tower", "media_refusal", "vision_language"]

ROPE_KEY = "mrope_position_ids"
"""The loader's output: this rank's M-RoPE positions [3, B, N / P]."""
MEDIA_INDEX_KEY = "media_index"
"""The loader's output: [B, N / P], the feature row of each vision token (-1 for text)."""

ADAPTED = {
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "Qwen3VLForConditionalGeneration": "qwen3_vl",
    "Qwen3VLMoeForConditionalGeneration": "qwen3_vl_moe",
}
"""The classes whose image and video batches run under sequence parallelism (checked exact by the sweep)."""

_REFUSED = {
    "Gemma3ForConditionalGeneration": (
        "its image tokens attend to each other in both directions (token_type_ids build a bidirectional mask per "
        "image), and ds_wallfacer's attention computes causal attention only"),
    "Gemma3nForConditionalGeneration": "its image and audio tokens attend bidirectionally, like Gemma 3",
    "PaliGemmaForConditionalGeneration": "its prefix (image and prompt) attends bidirectionally",
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


def media_refusal(model: nn.Module) -> str:
    """Why this model's batches with pixels are refused (a model without an adapter)."""
    name = type(model).__name__
    why = _REFUSED.get(name, "ds_wallfacer has no adapter that places its image features and positions on shards")
    return (f"{name}: batches with images or videos are not supported under sequence parallelism: {why}. Train it on "
            f"text only, or use one of {', '.join(sorted(ADAPTED))} (docs/models.md, the multimodal table)")


class RefusedVision:
    """A model with a vision tower but no adapter: the loader raises ``refusal`` for a batch with pixels."""

    def __init__(self, refusal: str) -> None:
        self.refusal = refusal


def vision_language(model: nn.Module) -> "QwenVisionLanguage | RefusedVision | None":
    """The adapter of an HF vision-language model; ``RefusedVision`` for one with a vision tower and no adapter;
    None for a text model."""
    if type(model).__name__ in ADAPTED:
        return QwenVisionLanguage(model)
    if has_vision_tower(model):
        return RefusedVision(media_refusal(model))
    return None


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


class QwenVisionLanguage:
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL (dense and MoE): the model's ``get_rope_index``, ``get_image_features``,
    ``get_video_features`` and its language model, used on shards."""

    refusal = None

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        cfg = model.config
        self.image_token_id = int(cfg.image_token_id)
        self.video_token_id = int(cfg.video_token_id)
        self.merge = int(cfg.vision_config.spatial_merge_size)
        self.deepstack = bool(getattr(cfg.vision_config, "deepstack_visual_indexes", None))
        self.name = type(model).__name__

    @property
    def inner(self) -> nn.Module:
        """The ``*Model`` holding ``visual``, ``language_model`` and ``get_rope_index``."""
        return self._model.model

    # ---- loader side: pure functions of the full (padded) row and the media descriptions ----

    def token_types(self, ids: torch.Tensor, given: Any = None) -> torch.Tensor:
        """[B, N] int: 0 text, 1 image, 2 video, from the token ids; the processor's ``mm_token_type_ids``
        (``given``, before the loader's padding) must agree."""
        types = (ids == self.image_token_id).long() + 2 * (ids == self.video_token_id).long()
        if given is not None:
            g = torch.as_tensor(given).long()
            if g.dim() == 1:
                g = g[None]
            if g.shape[0] != ids.shape[0] or not torch.equal(g, types[:, :g.shape[1]]) or \
                    bool(types[:, g.shape[1]:].any()):
                raise ValueError(f"{TOKEN_TYPES_KEY} disagrees with the image / video placeholder tokens of "
                                 f"input_ids (ids {self.image_token_id} / {self.video_token_id})")
        return types

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

    @staticmethod
    def media_index(types: torch.Tensor) -> torch.Tensor:
        """[B, N]: the k-th image (video) token of the batch, row-major, gets k; text -1."""
        out = torch.full_like(types, -1)
        for kind in (1, 2):
            mask = types == kind
            out[mask] = torch.arange(int(mask.sum()), dtype=out.dtype)
        return out

    # ---- loss side: this rank's embeddings ----

    def inputs(self, input_ids: torch.Tensor, media_index: torch.Tensor, media: Mapping[str, Any]
               ) -> tuple[torch.Tensor, dict[str, Any]]:
        """(inputs_embeds [B, S_l, H], extra language-model keywords) of this rank's tokens: its token embeddings
        with its vision tokens' feature rows in place (and Qwen3-VL's deepstack rows)."""
        inner = self.inner
        emb = inner.get_input_embeddings()(input_ids)
        if not any(media.get(k) is not None for k in ("pixel_values", "pixel_values_videos")):
            return self._touch_tower(emb), {}
        masks, deep = {}, {}
        for kind, token, key in (("image", self.image_token_id, "pixel_values"),
                                 ("video", self.video_token_id, "pixel_values_videos")):
            if media.get(key) is None:
                continue
            encode = inner.get_image_features if kind == "image" else inner.get_video_features
            out = encode(media[key], media[f"{kind}_grid_thw"], return_dict=True)
            feats = torch.cat(tuple(out.pooler_output), dim=0).to(emb.device, emb.dtype)
            mask = input_ids == token
            rows = media_index[mask].to(feats.device)
            emb = emb.masked_scatter(mask[..., None], feats.index_select(0, rows))
            masks[kind] = mask
            if self.deepstack and getattr(out, "deepstack_features", None) is not None:
                deep[kind] = [torch.cat(tuple(f), dim=0).to(emb.device, emb.dtype).index_select(0, rows)
                              for f in out.deepstack_features]
        extra: dict[str, Any] = {}
        if self.deepstack and masks:
            visual = torch.zeros_like(input_ids, dtype=torch.bool)
            for m in masks.values():
                visual = visual | m
            layers = []
            for i in range(len(next(iter(deep.values())))):
                joint = emb.new_zeros(int(visual.sum()), emb.shape[-1])
                for kind, m in masks.items():
                    at = m[visual].nonzero().reshape(-1)
                    joint = joint.index_put((at,), deep[kind][i])
                layers.append(joint)
            extra = {"visual_pos_masks": visual, "deepstack_visual_embeds": layers}
        return emb, extra

    def _touch_tower(self, emb: torch.Tensor) -> torch.Tensor:
        """A batch without images, in training: ``emb`` + 0 x the tower's output on one blank merged patch, so the
        tower's parameters get a (zero) gradient on every rank. Data-parallel replicas may hold batches with and
        without images in the same step, and ZeRO 1/2 fill their reduce buckets in gradient-hook order: a replica
        whose tower got no gradient would reduce different buckets than one whose did (measured: the step fails)."""
        if not (torch.is_grad_enabled() and self._model.training):
            return emb
        vc = self._model.config.vision_config
        row = int(getattr(vc, "in_channels", getattr(vc, "in_chans", 3))) * int(vc.temporal_patch_size) * \
            int(vc.patch_size) ** 2
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
        row = int(getattr(vc, "in_channels", getattr(vc, "in_chans", 3))) * int(vc.temporal_patch_size) * \
            int(vc.patch_size) ** 2
        pixels = torch.randn(int(grid.prod()), row, generator=torch.Generator().manual_seed(0x1A6E))
        return {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": grid,
                TOKEN_TYPES_KEY: self.token_types(ids).int()}
