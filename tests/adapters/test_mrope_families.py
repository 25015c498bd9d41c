"""The M-RoPE adapter's per-family data (``adapters/mrope_vision.py``), in one process: GLM's video frames (image
tokens inside video spans) told apart from its images, the Omni thinkers' audio refused by name, and a class whose
rope index no longer takes its family's arguments refused rather than trained wrong. Training with images is
tests/adapters/test_vlm_parity.py's; every adapted class's verdict is the multimodal sweep's."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from ds_wallfacer.adapters.mrope_vision import FAMILIES, MropeVisionLanguage, mrope_misses
from ds_wallfacer.adapters.vision import RefusedVision, vision_language
from ds_wallfacer.data.loader import ShardSpec, prepare_batch

AUDIO, IMAGE, VIDEO, AUDIO_START, VISION_START = 100, 101, 102, 103, 105


@pytest.fixture(scope="module")
def omni() -> torch.nn.Module:
    """A tiny Qwen2.5-Omni thinker (one text, vision and audio layer)."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Qwen2_5OmniThinkerConfig(
        text_config=dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=1, out_hidden_size=32,
                           fullatt_block_indexes=[0]),
        audio_config=dict(encoder_layers=1, d_model=16, encoder_attention_heads=1, encoder_ffn_dim=32, output_dim=32,
                          num_mel_bins=8),
        audio_token_index=AUDIO, image_token_index=IMAGE, video_token_index=VIDEO, audio_start_token_id=AUDIO_START,
        audio_end_token_id=104)
    cfg.vision_start_token_id, cfg.vision_end_token_id = VISION_START, 106  # the released configs carry them
    return tf.Qwen2_5OmniThinkerForConditionalGeneration(cfg)


def test_glm_video_frames_are_image_tokens_inside_video_spans() -> None:
    from ds_wallfacer.adapters.mrope_vision import _span_types

    img, vs, ve = 9, 7, 8  # GLM: <video_start> (<image_start> image x k <image_end> timestamp)* <video_end>
    ids = torch.tensor([[1, img, img, 2, vs, 3, img, 4, 5, 3, img, 4, 6, ve, img, 0]])
    assert _span_types(ids, img, vs, ve).tolist() == [[0, 1, 1, 0, 0, 0, 2, 0, 0, 0, 2, 0, 0, 0, 1, 0]]
    assert MropeVisionLanguage.media_index(_span_types(ids, img, vs, ve)).tolist() == \
        [[-1, 0, 1, -1, -1, -1, 3, -1, -1, -1, 4, -1, -1, -1, 2, -1]]  # images' rows, then the video's


def test_a_frames_placeholders_follow_its_family_layout() -> None:
    from ds_wallfacer.adapters.mrope_vision import frame_tokens

    assert frame_tokens(4, 6, 2) == 6  # Qwen: 2 x 3 merged patches
    assert frame_tokens(4, 6, 2, FAMILIES["HunYuanVLForConditionalGeneration"].layout) == 2 * (3 + 1) + 2


def test_omni_audio_is_refused_by_name(omni) -> None:
    vision = vision_language(omni)
    assert isinstance(vision, MropeVisionLanguage)
    spec = ShardSpec(index=0, sp_size=2)
    name = "Qwen2_5OmniThinkerForConditionalGeneration: audio is not supported"
    with pytest.raises(ValueError, match=name):  # the processor's audio keys
        prepare_batch({"input_ids": torch.ones(1, 16, dtype=torch.long), "input_features": torch.zeros(1, 8, 10)},
                      spec, vision=vision)
    ids = torch.tensor([[5, 6, VISION_START, IMAGE, 106, AUDIO_START, AUDIO, AUDIO, 104, 7]])
    with pytest.raises(ValueError, match=name):  # audio placeholders without them
        prepare_batch({"input_ids": ids, "pixel_values": torch.zeros(4, 1176), "image_grid_thw": torch.tensor(
            [[1, 2, 2]])}, spec, vision=vision)
    sample = vision.sample(torch.full((1, 32), AUDIO))  # the self-check's row: no audio, an image with its marks
    assert not bool((sample["input_ids"] == AUDIO).any()) and bool((sample["input_ids"] == VISION_START).any())


def test_a_rope_index_that_changed_is_refused(omni) -> None:
    family = dataclasses.replace(FAMILIES[type(omni).__name__], seconds=("video_second_per_grid", "seconds"))
    why = mrope_misses(omni, family)
    assert why is not None and "get_rope_index takes" in why and "'seconds'" in why
    assert mrope_misses(omni, FAMILIES[type(omni).__name__]) is None
    del omni.config.vision_start_token_id  # a config without the id its rope index finds images by
    try:
        assert isinstance(vision_language(omni), RefusedVision)
        assert "vision_start_token_id" in vision_language(omni).refusal
    finally:
        omni.config.vision_start_token_id = VISION_START
