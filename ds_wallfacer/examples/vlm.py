"""Tiny vision-language models and synthetic image conversations: the VLM example (``launch/train_vlm.py``), the
parity tests and the sweep build from here, so every run uses the same shapes.

A synthetic conversation is text tokens with one or more images inside, each as the Qwen processors lay it out:
``<vision_start> <image> x k <vision_end>``, where an image of ``h x w`` merged patches is ``k = h * w`` tokens and its
``pixel_values`` are ``t * (merge h) * (merge w)`` rows of ``channels * temporal_patch * patch^2`` random values
(seeded). ``conversation_batch`` stacks rows (right-padded) or packs them into one row of documents.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["FAMILIES", "conversation", "conversation_batch", "example_conversations", "example_vlm", "tiny_vlm"]

IMAGE, VIDEO, START, END = 90, 91, 92, 93
"""The tiny models' placeholder ids (below their vocabulary of 128)."""

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen2_vl", "qwen3_vl_moe", "gemma3", "qwen3_5", "qwen3_5_moe")


def tiny_vlm(family: str, *, seed: int = 0) -> Any:
    """A tiny HF vision-language model in fp32 (2 text layers of 64, 4 query / 2 kv heads; a 2-layer vision tower),
    with the text model on ``attn_implementation="wallfacer"``'s reference (sdpa) and the vision tower on sdpa."""
    import transformers as tf

    torch.manual_seed(seed)
    text = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, pad_token_id=0)
    ids = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    if family in ("qwen2_5_vl", "qwen2_vl"):
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2)
        if family == "qwen2_5_vl":
            vision.update(window_size=112, fullatt_block_indexes=[1])
            cfg = tf.Qwen2_5_VLConfig(text_config=dict(text, rope_parameters=rope), vision_config=vision, **ids)
            cls = tf.Qwen2_5_VLForConditionalGeneration
        else:
            vision = dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, patch_size=14,
                          spatial_merge_size=2, temporal_patch_size=2)
            cfg = tf.Qwen2VLConfig(text_config=dict(text, rope_parameters=rope), vision_config=vision, **ids)
            cls = tf.Qwen2VLForConditionalGeneration
    elif family in ("qwen3_vl", "qwen3_vl_moe"):
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True}
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                      spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                      deepstack_visual_indexes=[0, 1])
        text = dict(text, head_dim=16, rope_parameters=rope)
        if family == "qwen3_vl":
            cfg, cls = tf.Qwen3VLConfig(text_config=text, vision_config=vision, **ids), tf.Qwen3VLForConditionalGeneration
        else:
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                        mlp_only_layers=[])
            cfg = tf.Qwen3VLMoeConfig(text_config=text, vision_config=vision, **ids)
            cls = tf.Qwen3VLMoeForConditionalGeneration
    elif family in ("qwen3_5", "qwen3_5_moe"):
        cfg, cls = _qwen3_5(tf, family, text, ids)
    elif family == "gemma3":
        cfg = tf.Gemma3Config(
            text_config=dict(text, head_dim=16, sliding_window=16, query_pre_attn_scalar=16),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               image_size=28, patch_size=7),
            mm_tokens_per_image=4, image_token_index=IMAGE, boi_token_index=START, eoi_token_index=END)
        cls = tf.Gemma3ForConditionalGeneration
    else:
        raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")
    for sub in ("text_config", "vision_config"):
        c = getattr(cfg, sub)
        for key in ("attention_dropout", "hidden_dropout", "dropout"):
            if hasattr(c, key):
                setattr(c, key, 0.0)
    model = cls(cfg).float().train()
    model.set_attn_implementation("sdpa")
    return model


def _qwen3_5(tf: Any, family: str, text: dict, ids: dict) -> tuple[Any, Any]:
    """Qwen3.5 (dense, MoE): gated delta-net (linear attention: 4 key / 8 value heads of 8) and full-attention
    layers, half-rotary M-RoPE; a Qwen3-VL tower without deepstack."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1], "mrope_interleaved": True,
            "partial_rotary_factor": 0.5}
    text = dict(text, head_dim=16, rope_parameters=rope, num_hidden_layers=3,
                layer_types=["linear_attention", "full_attention", "linear_attention"], linear_conv_kernel_dim=4,
                linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=4, linear_num_value_heads=8)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
    if family == "qwen3_5":
        return tf.Qwen3_5Config(text_config=text, vision_config=vision, **ids), tf.Qwen3_5ForConditionalGeneration
    text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    return tf.Qwen3_5MoeConfig(text_config=text, vision_config=vision, **ids), tf.Qwen3_5MoeForConditionalGeneration


def conversation(model: Any, *, text: int, images: Sequence[tuple[int, int]], seed: int,
                 videos: Sequence[tuple[int, int, int]] = (),
                 tokens: tuple[int, int | None, int | None, int | None] | None = None) -> dict[str, torch.Tensor]:
    """One row: ``text`` random text tokens with the ``images`` ((h, w) merged patches each) and then the ``videos``
    ((t, h, w): t temporal patches of h x w merged patches) spread evenly among them; ``input_ids`` [N],
    ``pixel_values`` / ``image_grid_thw`` [images, 3], ``pixel_values_videos`` / ``video_grid_thw`` [videos, 3].
    ``tokens``: the (image, video, start, end) ids of a model not built by ``tiny_vlm`` (words stay below them; no
    start / end: None). An item has the placeholders of its family's layout (``mrope_vision.frame_tokens``)."""
    from ..adapters.mrope_vision import FAMILIES, frame_tokens, patch_shape

    g = torch.Generator().manual_seed(seed)
    vc = model.config.vision_config
    merge = int(getattr(vc, "spatial_merge_size", 1))
    image, video, start, end = tokens or (IMAGE, VIDEO, START, END)
    words = torch.randint(4, min(t for t in (image, start) if t is not None) - 1, (text,), generator=g)
    media = [(image, 1, h, w) for h, w in images] + [(video, t, h, w) for t, h, w in videos]
    cuts = [round(text * (i + 1) / (len(media) + 1)) for i in range(len(media))]
    pieces, at = [], 0
    grids: dict[int, list[torch.Tensor]] = {image: [], video: []}
    pixels: dict[int, list[torch.Tensor]] = {image: [], video: []}
    row = patch_shape(model)
    family = FAMILIES.get(type(model).__name__)
    apart = family is not None and family.frames_apart
    layout = family.layout if family is not None else (0, 0)
    for cut, (token, t, h, w) in zip(cuts, media):
        frame = frame_tokens(h * merge, w * merge, merge, layout)
        body = [torch.full((t * frame,), token)]
        if apart and token == video:  # each frame its own run, a timestamp (text) between frames
            body = [x for k in range(t) for x in ([torch.tensor([4 + k])] if k else []) + [torch.full((frame,), token)]]
        marks = [[torch.tensor([x])] if x is not None else [] for x in (start, end)]
        pieces += [words[at:cut], *marks[0], *body, *marks[1]]
        grid = torch.tensor([t, h * merge, w * merge])
        grids[token].append(grid)
        pixels[token].append(torch.randn(int(grid.prod()), *row, generator=g))
        at = cut
    pieces.append(words[at:])
    out = {"input_ids": torch.cat(pieces)}
    if images:
        out.update(pixel_values=torch.cat(pixels[image]), image_grid_thw=torch.stack(grids[image]))
    if videos:
        out.update(pixel_values_videos=torch.cat(pixels[video]), video_grid_thw=torch.stack(grids[video]))
    return out


def conversation_batch(rows: Sequence[dict[str, torch.Tensor]], *, packed: bool = False,
                       token_ids: tuple[int, int] | None = (IMAGE, VIDEO)) -> dict[str, Any]:
    """Rows of ``conversation`` -> one full batch: right-padded rows (``attention_mask``), or one packed row of
    documents (``document_lengths``); images concatenated in row order, ``mm_token_type_ids`` from the ids
    (``token_ids``: the image and video placeholders; None: none)."""
    from ..data.loader import collate_right_padded
    from ..data.media import MEDIA_KEYS

    if packed:
        ids = torch.cat([r["input_ids"] for r in rows])
        batch: dict[str, Any] = {"input_ids": ids[None], "document_lengths": [[len(r["input_ids"]) for r in rows]]}
        for key in (*MEDIA_KEYS, "token_type_ids"):
            parts = [r[key] for r in rows if key in r]
            if parts:
                batch[key] = torch.cat(parts)
    else:
        batch = collate_right_padded(list(rows), token_keys=("token_type_ids",))
    if token_ids is not None:
        image, video = token_ids
        batch["mm_token_type_ids"] = (batch["input_ids"] == image).int() + 2 * (batch["input_ids"] == video).int()
    return batch


def example_vlm(family: str, *, path: str | None = None) -> Any:
    """The VLM example's model: ``tiny_vlm(family)``, or a Qwen-VL folder (``path``) through ``from_pretrained`` on
    sdpa, in training mode."""
    if path:
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText.from_pretrained(path, attn_implementation="sdpa").train()
    return tiny_vlm(family)


def example_conversations(model: Any, n: int, *, text: int, images: int, side: int) -> list[dict[str, torch.Tensor]]:
    """The VLM example's ``n`` conversations (seeds 0 .. n-1): ``text`` tokens and ``images`` images each, whose
    shapes vary (side x side, 2side x side/2, side/2 x 2side merged patches)."""
    shapes = [(side, side), (2 * side, max(1, side // 2)), (max(1, side // 2), 2 * side)]
    return [conversation(model, text=text, images=[shapes[(i + j) % 3] for j in range(images)], seed=i)
            for i in range(n)]
