"""The placeholder pattern, one process: which classes have it (read from their code), what the others are refused
for, how a batch's media cut into units and runs of units, and the probe that says whether a tower treats its units
on their own (LLaVA's does; QianfanOCR's rows change when two images share a call)."""
from __future__ import annotations

import pytest
import torch

from ds_wallfacer.adapters.media_units import contiguous_split, unit_slice, units


def test_contiguous_runs_keep_order_and_minimise_the_largest() -> None:
    assert contiguous_split([1, 2, 3, 4, 5], 2) == [(0, 3), (3, 5)]
    assert contiguous_split([5, 5], 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert contiguous_split([4, 1, 1, 1, 1], 2) == [(0, 1), (1, 5)]
    assert contiguous_split([], 3) == [(0, 0)] * 3


def test_units_of_the_two_layouts() -> None:
    leading = {"pixel_values": torch.zeros(3, 3, 8, 8), "image_sizes": torch.ones(3, 2, dtype=torch.long)}
    u = units(leading, "pixel_values")
    assert u is not None and u.count == 3 and u.grid is None
    assert unit_slice(leading, u, "pixel_values", 1, 3)["image_sizes"].shape == (2, 2)
    grid = {"pixel_values": torch.arange(20.0)[:, None], "image_grid_thw": torch.tensor([[1, 2, 2], [1, 4, 4]])}
    g = units(grid, "pixel_values")
    assert g is not None and g.count == 2 and g.work == (4, 16)
    assert torch.equal(unit_slice(grid, g, "pixel_values", 1, 2)["pixel_values"][:, 0], torch.arange(4.0, 20.0))
    # a per-sample argument (not one row per unit): the batch runs whole
    assert units({**leading, "batch_num_images": torch.tensor([3, 0])}, "pixel_values") is None


def test_forms_recognised_and_refused_from_the_code() -> None:
    from ds_wallfacer.adapters.placeholder_forms import PlaceholderForm, placeholder_form
    from ds_wallfacer.examples.vlm import tiny_vlm
    from tests.sweep.tiny_multimodal import build_tiny_vlm

    llava = placeholder_form(build_tiny_vlm("llava_onevision", "LlavaOnevisionForConditionalGeneration"))
    assert isinstance(llava, PlaceholderForm) and [k.name for k in llava.kinds] == ["image", "video"]
    assert "3-D (M-RoPE) positions" in placeholder_form(tiny_vlm("qwen2_vl"))
    assert "attention masks of its own" in placeholder_form(build_tiny_vlm("gemma4", "Gemma4ForConditionalGeneration"))


def _paligemma2(window: int):
    """PaliGemma 2: a Gemma 2 language model, whose sliding layers see the prefix whole."""
    from tests.sweep.tiny import build_tiny
    from tests.sweep.tiny_multimodal import adjust

    cls = "PaliGemmaForConditionalGeneration"
    return build_tiny("paligemma", cls, check=False, adjust=lambda d: {**adjust(d, cls), "text_config": {
        **adjust(d, cls)["text_config"], "model_type": "gemma2", "sliding_window": window}})


def test_token_type_masks_measure_as_spans() -> None:
    """Gemma 3's images and PaliGemma's prefix read from their forwards and measured on their own mask builders; the
    loader derives the spans per document from token_type_ids, and refuses what the masks and spans would not
    agree on."""
    from ds_wallfacer.adapters.vision import vision_language
    from ds_wallfacer.data.loader import ShardSpec, prepare_batch
    from ds_wallfacer.examples.vlm import tiny_vlm
    from tests.sweep.tiny_multimodal import build_tiny_vlm

    forms = {name: vision_language(m).type_spans for name, m in (
        ("gemma3", tiny_vlm("gemma3")), ("pali", build_tiny_vlm("paligemma", "PaliGemmaForConditionalGeneration")),
        ("pali2", _paligemma2(8)))}
    assert [(f.value, f.single, f.whole_window) for f in forms.values()] == [(1, False, None), (0, True, None),
                                                                             (0, True, 8)]
    vision = vision_language(tiny_vlm("gemma3"))
    spec = ShardSpec(index=0, sp_size=2)
    ids = torch.arange(10, 22)[None]
    types = torch.tensor([[0, 1, 1, 1, 1, 1, 0, 0, 1, 0, 1, 1]])
    out = prepare_batch({"input_ids": ids, "token_type_ids": types, "document_lengths": [[4, 8]]}, spec, vision=vision)
    assert out["bidirectional_spans"].tolist() == [[[1, 4], [4, 6], [8, 9], [10, 12]]]  # cut at the document
    with pytest.raises(ValueError, match="not both"):
        prepare_batch({"input_ids": ids, "token_type_ids": types, "bidirectional_spans": [[(1, 3)]]}, spec,
                      vision=vision)
    pali2 = vision_language(_paligemma2(8))
    padded = {"input_ids": ids, "attention_mask": (torch.arange(12) < 10).long()[None]}
    out = prepare_batch({**padded, "token_type_ids": (torch.arange(12) >= 6).long()[None]}, spec, vision=pali2)
    assert out["bidirectional_spans"].tolist() == [[[0, 6]]]
    pali = vision_language(build_tiny_vlm("paligemma", "PaliGemmaForConditionalGeneration"))
    whole = prepare_batch({**padded, "token_type_ids": torch.zeros(1, 12, dtype=torch.long)}, spec, vision=pali)
    assert whole["bidirectional_spans"].tolist() == [[[0, 10]]]  # the padding is no prefix
    with pytest.raises(ValueError, match="PaliGemmaForConditionalGeneration.*10 tokens.*window of 8"):
        prepare_batch({**padded, "token_type_ids": torch.zeros(1, 12, dtype=torch.long)}, spec, vision=pali2)
    with pytest.raises(ValueError, match="runs"):
        prepare_batch({"input_ids": ids, "token_type_ids": types}, spec, vision=pali2)


def test_the_probe_measures_whether_units_are_independent() -> None:
    from ds_wallfacer.adapters.vision import vision_language
    from tests.sweep.tiny_multimodal import build_tiny_vlm

    for model_type, cls, independent in (("internvl", "InternVLForConditionalGeneration", True),
                                         ("qianfan_ocr", "QianfanOCRForConditionalGeneration", False)):
        unit = vision_language(build_tiny_vlm(model_type, cls)).probed()["image"]
        assert unit is not None and unit.rows > 0 and unit.independent is independent, (cls, unit)


def test_a_batch_whose_placeholders_and_rows_disagree_is_refused() -> None:
    from ds_wallfacer.adapters.vision import vision_language
    from tests.sweep.tiny_multimodal import build_tiny_vlm

    model = build_tiny_vlm("internvl", "InternVLForConditionalGeneration")
    adapter = vision_language(model)
    batch = adapter.sample(torch.randint(8, 100, (1, 48), generator=torch.Generator().manual_seed(0)))
    ids = batch["input_ids"].clone()
    ids[0, (ids[0] == adapter.kinds["image"].token_id).nonzero()[0]] = 9  # one placeholder less than rows
    media = {k: v for k, v in batch.items() if k != "input_ids"}
    with pytest.raises(ValueError, match="placeholder tokens"):
        adapter.inputs(ids, adapter.media_index(adapter.token_types(ids)), media)
