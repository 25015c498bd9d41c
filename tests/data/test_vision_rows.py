"""The loader's side of images in a row (``adapters/vision.py``), in one process: M-RoPE positions of a packed row
equal each conversation's own (the model's ``get_rope_index`` run alone), feature rows in order, the split of the
tower's frames, and the clear errors for malformed image batches."""
from __future__ import annotations

import pytest
import torch

from ds_wallfacer.adapters.vision import QwenVisionLanguage, frame_units, split_units, vision_language
from ds_wallfacer.data.loader import ShardSpec, prepare_batch, unshard_sequence
from ds_wallfacer.examples.vlm import IMAGE, conversation, conversation_batch, tiny_vlm


@pytest.fixture(scope="module")
def qwen() -> torch.nn.Module:
    return tiny_vlm("qwen2_5_vl")


def test_packed_positions_restart_per_conversation_and_are_sharded_with_the_tokens(qwen) -> None:
    rows = [conversation(qwen, text=11, images=[(2, 2)], seed=1),
            conversation(qwen, text=9, images=[(1, 3)], videos=[(2, 1, 2)], seed=2)]
    alone = []
    for r in rows:
        ids = r["input_ids"][None]
        types = (ids == IMAGE).int() + 2 * (ids == 91).int()
        grids = {k: r[k] for k in ("image_grid_thw", "video_grid_thw") if k in r}
        alone.append(qwen.model.get_rope_index(ids, types, **grids)[0])
    want = torch.cat(alone, dim=-1)  # [3, 1, N]
    batch = conversation_batch(rows, packed=True)
    vision = vision_language(qwen)
    full = prepare_batch(batch, ShardSpec(index=0, sp_size=1), vision=vision)
    n = want.shape[-1]
    assert torch.equal(full["mrope_position_ids"][..., :n], want)
    # on 4 ranks (zigzag), every rank's positions are the full row's at its tokens
    shards = [prepare_batch(batch, ShardSpec(index=r, sp_size=4), vision=vision) for r in range(4)]
    for key, dim in (("mrope_position_ids", 2), ("media_index", 1), ("input_ids", 1)):
        whole = unshard_sequence([s[key] for s in shards], dim=dim)
        assert torch.equal(whole[..., :n], full[key][..., :n]), key


def test_media_rows_count_each_kind_in_row_major_order() -> None:
    types = torch.tensor([[0, 1, 1, 0, 2, 2], [1, 0, 2, 0, 0, 0]])
    # one index over the batch's features: its 3 image tokens' rows, then its 3 video tokens' rows
    assert QwenVisionLanguage.media_index(types).tolist() == [[-1, 0, 1, -1, 3, 4], [2, -1, 5, -1, -1, -1]]


def test_frames_split_heaviest_first_to_the_least_loaded_rank(qwen) -> None:
    r = conversation(qwen, text=8, images=[(2, 2), (1, 1)], videos=[(3, 1, 2)], seed=0)
    units = frame_units(r, merge=2)
    assert [(u.kind, u.tokens) for u in units] == [("image", 4), ("image", 1), ("video", 2), ("video", 2),
                                                   ("video", 2)]
    assert [u.pixel_start for u in units] == [0, 16, 0, 8, 16]  # each frame's rows of its kind's pixel_values
    assert split_units([16, 4, 8, 8, 8], 4) == [0, 1, 1, 2, 3]  # 16 | 8 | 8 | 8, then 4 joins rank 1
    assert split_units([5], 4) == [0]


def test_malformed_image_batches_are_refused_with_the_fix(qwen) -> None:
    vision, spec = vision_language(qwen), ShardSpec(index=0, sp_size=2)
    a, b = (conversation(qwen, text=10, images=[(2, 2)], seed=s) for s in (1, 2))
    batch = conversation_batch([a, b], packed=True)
    # one image's tokens across two documents
    cut = dict(batch, document_lengths=[[9, len(batch["input_ids"][0]) - 9]])
    with pytest.raises(ValueError, match="cut across documents"):
        prepare_batch(cut, spec, vision=vision)
    with pytest.raises(ValueError, match="image_grid_thw has 3 rows"):
        prepare_batch(dict(batch, image_grid_thw=torch.cat([batch["image_grid_thw"], batch["image_grid_thw"][:1]])),
                      spec, vision=vision)
    with pytest.raises(ValueError, match="mm_token_type_ids disagrees"):
        prepare_batch(dict(batch, mm_token_type_ids=torch.zeros_like(batch["input_ids"])), spec, vision=vision)
    from tests.sweep.tiny_multimodal import build_tiny_vlm

    gemma = build_tiny_vlm("gemma4", "Gemma4ForConditionalGeneration")  # Gemma 3's images train (type_spans.py)
    with pytest.raises(ValueError, match="Gemma4ForConditionalGeneration: batches with images .* masks of its own"):
        prepare_batch({"input_ids": torch.ones(1, 8, dtype=torch.long), "pixel_values": torch.zeros(1, 3, 28, 28)},
                      spec, vision=vision_language(gemma))
