"""The vision adapter seam (``data.media.VisionAdapter``) for a model with a vision tower and no adapter: every
image path raises the refusal, text batches shard as for a text model, and the self-check's sample is text."""
from __future__ import annotations

import pytest
import torch

from ds_wallfacer.adapters.vision import RefusedVision
from ds_wallfacer.data.loader import ShardSpec, prepare_batch


def test_a_refused_vision_adapter_refuses_images_and_passes_text() -> None:
    vision = RefusedVision("no adapter for this model")
    ids = torch.arange(16)[None]
    assert vision.sample(ids) == {"input_ids": ids}
    for call in (lambda: vision.token_types(ids), lambda: vision.media_index(ids),
                 lambda: vision.positions(ids, ids, {}, None), lambda: vision.inputs(ids, None, {})):
        with pytest.raises(ValueError, match="no adapter for this model"):
            call()
    spec = ShardSpec(index=0, sp_size=2)
    assert prepare_batch({"input_ids": ids}, spec, vision=vision)["input_ids"].shape == (1, 8)
    with pytest.raises(ValueError, match="no adapter for this model"):
        prepare_batch({"input_ids": ids, "pixel_values": torch.zeros(4, 12)}, spec, vision=vision)
