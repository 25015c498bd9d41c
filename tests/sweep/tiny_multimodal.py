"""Tiny vision-language models for the multimodal sweep, and their batches with images.

The shrunk config of ``tiny.tiny_config`` keeps the full model's image sizes and special token ids; a batch with
images needs both small: ``adjust`` moves every placeholder / special token id at or above the tiny vocabulary to a
free id below it, sets every vision config's ``image_size`` to ``_PATCHES`` patches a side (grid pinpoints scaled
alike), and sets the widths a projector must match to the tiny text width. ``_PER_CLASS`` holds what a class needs
beyond that (a config check the generic shrink breaks), each with its reason.

``vlm_batch`` is one row of random text with two units of every kind of media the model takes (images, videos),
built by the model's adapter (``PlaceholderVisionLanguage.sample``: the tower tried on one small unit).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from tests.sweep.tiny import HIDDEN, VOCAB, NotBuildable, build_tiny

__all__ = ["adjust", "build_tiny_vlm", "vlm_batch"]

_PATCHES = 4
"""Patches per image side: divisible by the 2 x 2 pixel shuffles and merges of the towers."""
_VISION_KEYS = ("vision_config", "vision_tower_config", "visual_config", "vision_model_config",
                "high_res_vision_config")
_TEXT_WIDTHS = ("out_hidden_size", "text_hidden_size", "projector_hidden_size", "adapter_out_dim",
                "text_config_hidden_size")
_RESERVED = set(range(8))
"""Ids the shrink gives pad / bos / eos / sep / cls / mask (``tiny._TOKEN_IDS``)."""


def _is_token_key(key: str) -> bool:
    return isinstance(key, str) and key.endswith(("_token_id", "_token_index", "_token_ids")) and key not in (
        "pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id", "cls_token_id",
        "mask_token_id", "forced_eos_token_id", "eod_token_id")


def _move_ids(d: dict[str, Any], free: list[int], moved: dict[int, int]) -> None:
    for key, value in list(d.items()):
        if isinstance(value, dict) and key not in _VISION_KEYS:
            _move_ids(value, free, moved)
        elif _is_token_key(key) and value is None and key in ("image_token_id", "video_token_id"):
            d[key] = free.pop()  # placeholders the released checkpoints set (MiniCPM-V: None by default)
        elif _is_token_key(key):
            fix = lambda t: moved.setdefault(t, free.pop()) if isinstance(t, int) and t not in _RESERVED else t  # noqa
            d[key] = [fix(t) for t in value] if isinstance(value, list) else fix(value)


def _small_images(vc: dict[str, Any]) -> float:
    """Set ``vc``'s image size to ``_PATCHES`` patches a side; returns new / old size (1 when it has none)."""
    patch = vc.get("patch_size")
    patch = patch[0] if isinstance(patch, list) else patch
    old = vc.get("image_size")
    if isinstance(vc.get("window_size"), int) and isinstance(patch, int):  # Qwen-like windows (the text rule cut
        vc["window_size"] = patch * int(vc.get("spatial_merge_size") or 1) * 2  # them to 16): whole merged cells
    if not isinstance(patch, int) or old is None:
        return 1.0
    side = patch * _PATCHES
    first = old[0] if isinstance(old, list) else old
    vc["image_size"] = [side, side] if isinstance(old, list) else side
    return side / float(first)


def _own_widths(d: dict[str, Any]) -> None:
    """Widths a tower's config checks against its own (shrunk) width: its adapter's input, its quantiser's codes."""
    for key, value in d.items():
        if isinstance(value, dict):
            _own_widths(value)
    if isinstance(d.get("hidden_size"), int):
        for key in ("adapter_in_dim", "adapter_input_size", "codebook_dim"):
            if isinstance(d.get(key), int):
                d[key] = d["hidden_size"]


def adjust(d: dict[str, Any], cls: str = "") -> dict[str, Any]:
    """The multimodal changes to a shrunk config dict (see the module docstring)."""
    d = dict(d)
    _move_ids(d, [t for t in range(VOCAB - 16, VOCAB) if t not in _RESERVED], {})
    if not any(isinstance(d.get(k), dict) for k in _VISION_KEYS):  # the tower's sizes in the model's own config
        _small_images(d)
    for key in _VISION_KEYS:
        vc = d.get(key)
        if isinstance(vc, dict):
            vc = d[key] = dict(vc)
            scale = _small_images(vc)
            for width in _TEXT_WIDTHS:
                if isinstance(vc.get(width), int):
                    vc[width] = HIDDEN
            if isinstance(d.get("image_grid_pinpoints"), list) and scale != 1.0:
                d["image_grid_pinpoints"] = [[round(x * scale) for x in p] for p in d["image_grid_pinpoints"]]
    for width in _TEXT_WIDTHS:
        if isinstance(d.get(width), int):
            d[width] = HIDDEN
    if isinstance(d.get("audio_config"), dict):  # an audio tower's output feeds the text model too
        d["audio_config"] = {**d["audio_config"], **{w: HIDDEN for w in _TEXT_WIDTHS if w in d["audio_config"]}}
    _own_widths(d)
    fix = _PER_CLASS.get(cls)
    return fix(d) if fix is not None else d


def _nested(key: str, **values: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda d: {**d, key: {**d[key], **values}}


def _sam(d: dict[str, Any], patches: int) -> dict[str, Any]:
    vc = dict(d["vision_config"])
    sam = vc["sam_config"] = dict(vc["sam_config"])
    sam["image_size"] = sam["patch_size"] * patches
    width = vc["encoder_config"]["hidden_size"]
    sam["downsample_channels"] = [width, width]
    return {**d, "vision_config": vc}


def _mrope(d: dict[str, Any], section: list[int]) -> dict[str, Any]:
    text = d["text_config"]
    return {**d, "text_config": {**text, "rope_parameters": {**text["rope_parameters"], "mrope_section": section}}}


_PER_CLASS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    # the pixel-shuffle MLP takes the shuffled width (4 x hidden) and its output is the projector's input
    # five feature layers (-11 among them) of a 24-layer tower; the tiny tower has 2
    "VipLlavaForConditionalGeneration": lambda d: {**d, "vision_feature_layers": [-2, -1]},
    # its sliding layers need a window (None by default: the released checkpoints set it)
    "Step3p7ForConditionalGeneration": _nested("text_config", sliding_window=16),
    # the projector normalises the tower's width, 1152 in the full model
    "Kimi_K25ForConditionalGeneration": lambda d: {**d, "projection_hidden_size": HIDDEN},
    # the projector takes the tower's 2 x 2 merged patches: 4 x its width
    "MuseGlimmerForConditionalGeneration": lambda d: {**d, "out_hidden_size": 4 * HIDDEN},
    # M-RoPE sections split the rotary half of MLA's rope dims (8): 4, not the 8 of a plain head
    "HYV4VLForConditionalGeneration": lambda d: {**d, "text_config": {**d["text_config"], "rope_parameters": {
        **d["text_config"]["rope_parameters"], "mrope_section": [2, 1, 1]}}},
    # image and audio codes are token ranges of the vocabulary: 16 codes each inside the tiny one
    "Apertus1p5ForConditionalGeneration": lambda d: {
        **d, "image_token_offset": 64, "audio_token_offset": 80, "vision_config": {**d["vision_config"], "codebook_size": 16},
        "audio_config": {**d["audio_config"], "codebook_size": 16}},
    # the experts' width, None by default
    "DiffusionGemmaForBlockDiffusion": _nested("text_config", moe_intermediate_size=32),
    # the indexer's sizes, None by default (as for the text model, tiny._DEFAULT_PATCHES)
    "Qwen4ExpForConditionalGeneration": _nested("text_config", indexer_n_heads=4, indexer_kv_heads=1,
                                                indexer_head_dim=16, indexer_budget=16, indexer_compress_ratio=4),
    # RoPE per layer type, as for the text model (tiny._DEFAULT_PATCHES)
    "CohereCompassForConditionalGeneration": _nested("text_config", rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 5e4},
        "sliding_attention": {"rope_type": "default", "rope_theta": 5e4}}),
    # its sparse-attention layers take no rotary dims
    "Glm5NextForConditionalGeneration": _nested("text_config", qk_rope_head_dim=0),
    # the adapter reads two of the tower's layers (24 and 18 of the full tower)
    "Molmo2ForConditionalGeneration": lambda d: {**d, "adapter_config": {**d["adapter_config"],
                                                                         "vision_feature_layer": [-1, -2]}},
    # its 3-D rotary sections default to [22, 22, 20] of a 128-wide head; the tiny head has 8 frequencies
    "Ernie4_5_VLMoeForConditionalGeneration": lambda d: {**d, "text_config": {**d["text_config"], "rope_parameters": {
        **d["text_config"]["rope_parameters"], "mrope_section": [3, 3, 2]}}},
    # which tower layer feeds which text layer, None by default: the tiny stacks' layers
    "Granite4VisionForConditionalGeneration": lambda d: {**d, "deepstack_layer_map": [[-1, 0], [-2, 1]],
                                                         "downsample_rate": "1/2", "spatial_target_layers": [0, 1, 0, 1]},
    # the image tokens' names in the vocabulary, None by default (every checkpoint's tokenizer gives them)
    "ChameleonForConditionalGeneration": lambda d: {**d, "vocabulary_map": {"<image>": 120, "IMGIMGAZ": 121,
                                                                            "IMGIMGBZ": 122}},
    "Emu3ForConditionalGeneration": lambda d: {**d, "vocabulary_map": {"<image>": 120, "IMGIMGAZ": 121,
                                                                       "IMGIMGBZ": 122}},
    # SAM's 1024-pixel images and its neck's 512 / 896 channels into the encoder: 8 x 8 patches, the encoder's width
    # (and its per-layer MLP kinds, None by default: one dense, one sparse layer)
    "DeepseekOcr2ForConditionalGeneration": lambda d: _nested("text_config", mlp_layer_types=["dense", "sparse"])(
        _sam(d, 8)),
    "UnlimitedOcrForConditionalGeneration": lambda d: _sam(d, 8),
    # the aligner's width is the text width (2048 in the full model)
    "JanusForConditionalGeneration": _nested("vision_config", projection_dim=HIDDEN),
    # the resampler's 64 latents are 64 placeholders per image: 4 keep the row short
    "Idefics2ForConditionalGeneration": _nested("perceiver_config", resampler_n_latents=4),
    # the projector's query count is looked up by the tower's patch count
    "AriaForConditionalGeneration": lambda d: {**d, "projector_patch_to_query_dict": {_PATCHES**2: 4}},
    # 256 pooled tokens per image by default: the tiny tower's 4 x 4 patches pool to 2 x 2
    "Gemma3ForConditionalGeneration": lambda d: {**d, "mm_tokens_per_image": 4},
    # the projector's width is the text width (2048 by default; a wider one gives each patch several placeholders)
    "PaliGemmaForConditionalGeneration": lambda d: {**d, "projection_dim": HIDDEN},
    # M-RoPE sections of a 128-wide head ([8, 12, 12]); the tiny head's rotary half has 8 frequencies (4: MoE's
    # partial rotary)
    "Glm4vForConditionalGeneration": lambda d: _mrope(d, [2, 3, 3]),
    "Glm46VForConditionalGeneration": lambda d: _mrope(d, [2, 3, 3]),
    "GlmOcrForConditionalGeneration": lambda d: _mrope(d, [2, 3, 3]),
    "Glm4vMoeForConditionalGeneration": lambda d: _mrope(d, [1, 1, 2]),
    "PaddleOCRVLForConditionalGeneration": lambda d: _mrope(d, [2, 3, 3]),  # [16, 24, 24] in the full model
    # M-RoPE sections, none by default (the checkpoints set them; at least width, height, image index): 8 frequencies
    "HunYuanVLForConditionalGeneration": lambda d: _mrope(d, [2, 2, 2, 2]),
    # the ids around an image, which the rope index finds images by (the released configs set them)
    # (and its M-RoPE sections, [16, 24, 24] of a 128-wide head: the tiny head's 8 frequencies)
    "Qwen2_5OmniThinkerForConditionalGeneration": lambda d: _mrope({**d, "vision_start_token_id": 120,
                                                                    "vision_end_token_id": 121}, [2, 3, 3]),
    "Qwen3OmniMoeThinkerForConditionalGeneration": lambda d: {**d, "vision_start_token_id": 120,
                                                              "vision_end_token_id": 121},
    "Llama4ForConditionalGeneration": _nested("vision_config", intermediate_size=4 * HIDDEN, projector_input_dim=HIDDEN,
                                              projector_output_dim=HIDDEN, vision_output_dim=HIDDEN),
}
"""Class name -> what its tiny config needs beyond ``adjust``'s generic changes."""


def build_tiny_vlm(model_type: str, cls: str, *, seed: int = 0) -> torch.nn.Module:
    """``tiny.build_tiny`` with ``adjust`` (no text-only forward check: a VLM's forward is checked with images)."""
    return build_tiny(model_type, cls, seed=seed, check=False, adjust=lambda d: adjust(d, cls))


def vlm_batch(model: torch.nn.Module, *, seed: int = 7, text: int = 40) -> dict[str, Any]:
    """One row: ``text`` random tokens with two units of each kind of media spread among them (the adapter's
    ``sample``); raises ``NotBuildable`` when the tower accepts none of the probed layouts."""
    from ds_wallfacer.adapters.vision import vision_language

    adapter = vision_language(model)
    units = adapter.probed()
    if not any(units.values()):
        raise NotBuildable("no batch with images: its tower takes none of the probed layouts (media_units.probe_unit)")
    rows = sum(2 * (u.rows + 1) for u in units.values() if u is not None)
    n = -(-(text + rows) // 8) * 8
    low = min([k.token_id for k in adapter.kinds.values()] + [VOCAB - 16])
    ids = torch.randint(8, low, (1, n), generator=torch.Generator().manual_seed(seed))
    return adapter.sample(ids)
