"""Vision-language models with images under sequence parallelism: tiny Qwen2.5-VL, Qwen3-VL (deepstack) and Qwen3.5
(dense, MoE: gated delta-net layers head-parallel), and the
placeholder pattern's LLaVA-OneVision (images and a video), InternVL, Idefics3 and Mistral 3, through the real
integration (``initialize``, a DeepSpeed engine, 4 gloo ranks) against the same HF model in one process, each
conversation run alone with its images and video (the model's own positions and vision tower): the loss at every
step and every parameter, the vision tower's included, after the SGD steps (fp32, clipping off). Rows of two
conversations right-padded, or packed into one row of documents; images cut across shard boundaries; a step without
images (the tower touched times 0). Modes and ZeRO stages spread over the families. Data-parallel replicas with and
without images in the same step. Gemma 3 (images attending both ways, packed, under a sliding window shorter than
an image) and PaliGemma 1 and 2 (the prefix attending both ways) with the spans their token_type_ids give; PaliGemma
2's prefix longer than its window is refused by name."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.dist_utils import run_distributed
from tests.integration.parity import param_failures, zero_section

LR = 0.5
STEPS = 2

# (family, wallfacer section, ZeRO stage, packed): ring, WallFacer C = 2, hybrid, MsT; ZeRO 1 / 2 / 3 (Ulysses with
# ZeRO-3: the replicas with and without images, _train_mixed)
CASES = [
    ("qwen2_5_vl", {"mode": "wallfacer", "ring_count": 1}, 1, True),
    ("qwen3_vl", {"mode": "wallfacer", "ring_count": 2}, 2, False),
    ("qwen3_vl", {"mode": "hybrid", "ulysses_degree": 2, "mini_sequence": {"mlp_chunk_tokens": 8, "lm_head_chunk_tokens": 8}}, 3, True),
    # Qwen3.5: images (and a video, each frame its own run) inside gated delta-net layers sharded head-parallel
    ("qwen3_5", {"mode": "ulysses"}, 2, True),
    ("qwen3_5_moe", {"mode": "hybrid", "ulysses_degree": 2}, 3, False),
]


def _rows(step: int, model) -> list[dict]:
    """Two conversations: one image; two images and (Qwen2.5-VL, Qwen3.5) a video of 2 temporal patches."""
    from ds_wallfacer.examples.vlm import conversation

    video = [(2, 1, 2)] if type(model).__name__.startswith(("Qwen2_5", "Qwen3_5")) else []
    return [conversation(model, text=21 + 4 * step, images=[(2, 2)], seed=10 * step),
            conversation(model, text=15, images=[(1, 3), (2, 1)], videos=video, seed=10 * step + 1)]


def _reference_loss(ref, rows: list[dict]) -> torch.Tensor:
    """The token mean over the conversations, each run alone (the model computes its own M-RoPE positions)."""
    from ds_wallfacer.examples.vlm import IMAGE, VIDEO

    total, count = 0.0, 0
    for r in rows:
        ids = r["input_ids"][None]
        media = {k: v for k, v in r.items() if k != "input_ids"}
        logits = ref(input_ids=ids, mm_token_type_ids=(ids == IMAGE).int() + 2 * (ids == VIDEO).int(),
                     **media).logits[0, :-1]
        total = total + F.cross_entropy(logits.float(), ids[0, 1:], reduction="sum")
        count += ids.shape[1] - 1
    return total / count


def _steps(engine, opt, ref, rows_at, reference_loss, shard) -> list[str]:
    """``STEPS`` SGD steps of the engine on ``shard(rows_at(step))`` and of ``ref`` on ``reference_loss(ref, rows)``:
    the losses at every step, then every parameter."""
    failures = []
    for step in range(STEPS):
        rows = rows_at(step)
        want = reference_loss(ref, rows)
        loss = engine(**shard(rows))
        if abs(loss.item() - want.item()) > 1e-5 * max(1.0, abs(want.item())):
            failures.append(f"step {step} loss {loss.item():.7f} != reference {want.item():.7f}")
        engine.backward(loss)
        engine.step()
        opt.zero_grad()
        want.backward()
        opt.step()
    return failures + param_failures(engine, {k: v.detach() for k, v in ref.named_parameters()}, steps=STEPS)


def _train(family: str, wallfacer: dict, stage: int, packed: bool) -> list[str]:
    from ds_wallfacer.examples.vlm import conversation_batch, tiny_vlm
    from ds_wallfacer.integration import initialize

    ours, ref = tiny_vlm(family), tiny_vlm(family)
    micro = 1 if packed else 2
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_clipping": 0, "zero_optimization": zero_section(stage),
              "zero_allow_untested_optimizer": True, "wallfacer": wallfacer}
    engine, sp = initialize(model=ours, config=config, optimizer=torch.optim.SGD(ours.parameters(), lr=LR))
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    failures = _steps(engine, opt, ref, lambda step: _rows(step, ref), _reference_loss,
                      lambda rows: sp.shard(conversation_batch(rows, packed=packed)))
    engine.destroy()
    return [f"{family} {wallfacer} zero {stage} packed={packed}: {f}" for f in failures]


def _train_mixed(rank: int) -> list[str]:
    """Ulysses P = 2 x D = 2, ZeRO-3: replica 0 trains rows with images, replica 1 text-only rows, in the
    same steps (every rank must call the tower once and give it a gradient, or ZeRO's parameter gathers and reduce
    buckets differ between replicas).
    Reference: the mean of the two replicas' losses on one process."""
    from ds_wallfacer.examples.vlm import conversation, conversation_batch, tiny_vlm
    from ds_wallfacer.integration import initialize

    ours, ref = tiny_vlm("qwen2_5_vl"), tiny_vlm("qwen2_5_vl")
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0, "zero_optimization": zero_section(3),
              "zero_allow_untested_optimizer": True, "wallfacer": {"mode": "ulysses", "sequence_parallel_size": 2}}
    engine, sp = initialize(model=ours, config=config, optimizer=torch.optim.SGD(ours.parameters(), lr=LR))
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    replica = rank // 2
    failures = []
    for step in range(STEPS):
        rows = [conversation(ref, text=30, images=[(2, 2)], seed=step), conversation(ref, text=30, images=[],
                                                                                  seed=50 + step)]
        want = [_reference_loss(ref, [rows[0]]), _reference_loss(ref, [rows[1]])]
        loss = engine(**sp.shard(conversation_batch([rows[replica]])))
        if abs(loss.item() - want[replica].item()) > 1e-5 * max(1.0, abs(want[replica].item())):
            failures.append(f"step {step} loss {loss.item():.7f} != reference {want[replica].item():.7f}")
        engine.backward(loss)
        engine.step()
        opt.zero_grad()
        ((want[0] + want[1]) / 2).backward()
        opt.step()
    failures += param_failures(engine, {k: v.detach() for k, v in ref.named_parameters()}, steps=STEPS)
    # the ranks of a group must hold the same images, not only the same token ids
    from ds_wallfacer.integration.parallel import check_same_batch

    row = conversation(ref, text=30, images=[(2, 2)], seed=0)
    row["pixel_values"] = row["pixel_values"] + (rank % 2)
    try:
        check_same_batch(row, group=sp.groups.sp_group, comm=sp.comm)
        failures.append("a group whose ranks hold different pixels passed check_same_batch")
    except ValueError:
        pass
    engine.destroy()
    return [f"replicas with and without images: {f}" for f in failures]


# (model type, class, wallfacer section, ZeRO stage, packed): the placeholder pattern (adapters/placeholder_vision.py)
PLACEHOLDER_CASES = [
    ("llava_onevision", "LlavaOnevisionForConditionalGeneration", {"mode": "wallfacer", "ring_count": 2}, 2, False),
    ("internvl", "InternVLForConditionalGeneration", {"mode": "hybrid", "ulysses_degree": 2}, 3, True),
    ("idefics3", "Idefics3ForConditionalGeneration", {"mode": "ulysses"}, 1, False),
    ("mistral3", "Mistral3ForConditionalGeneration",
     {"mode": "wallfacer", "ring_count": 1, "mini_sequence": {"lm_head_chunk_tokens": 8}}, 2, True),
    # token_type_ids -> bidirectional spans (adapters/type_spans.py): Gemma 3's images of 16 tokens under a window
    # of 6 (sliding layers cut the keys before a query inside an image), PaliGemma 1's prefix, PaliGemma 2's prefix
    # within its window of 36 in rows longer than it
    ("gemma3", "Gemma3ForConditionalGeneration", {"mode": "wallfacer", "ring_count": 2}, 3, True),
    ("gemma3", "Gemma3ForConditionalGeneration", {"mode": "ulysses"}, 1, False),
    ("paligemma", "PaliGemmaForConditionalGeneration", {"mode": "hybrid", "ulysses_degree": 2}, 2, True),
    ("paligemma2", "PaliGemmaForConditionalGeneration", {"mode": "wallfacer", "ring_count": 1}, 1, False),
]
_WITH = {"gemma3": {"mm_tokens_per_image": 16, "text_config": {"sliding_window": 6}},
         "paligemma2": {"text_config": {"model_type": "gemma2", "sliding_window": 36}}}
"""Config changes beyond the sweep's tiny ones (``tiny_multimodal.build_tiny_vlm``)."""


def _build(model_type: str, cls: str):
    from tests.sweep.tiny import build_tiny
    from tests.sweep.tiny_multimodal import adjust, build_tiny_vlm

    if model_type not in _WITH:
        return build_tiny_vlm(model_type, cls)
    extra = _WITH[model_type]

    def fix(d: dict) -> dict:
        d = adjust(d, cls)
        return {**d, **extra, "text_config": {**d["text_config"], **extra["text_config"]}}

    model = build_tiny(model_type.removesuffix("2"), cls, check=False, adjust=fix)
    w = getattr(getattr(model.model, "multi_modal_projector", None), "mm_input_projection_weight", None)
    if w is not None:  # zeros at init: image rows of 0 meet the text model's RMSNorm where its gradient is 1/sqrt(eps)
        with torch.no_grad():
            w.copy_(torch.randn(w.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
    return model


def _with_types(model, row: dict) -> dict:
    """``token_type_ids`` where the model builds its masks from them: Gemma 3's 1 at its image tokens; PaliGemma's
    images first (in their order), then the text: the prefix (0) is the images and 3 prompt tokens, the rest 1."""
    from ds_wallfacer.adapters.vision import vision_language

    adapter = vision_language(model)
    ts = getattr(adapter, "type_spans", None)
    if ts is None:
        return row
    ids = row["input_ids"]
    image = ids == adapter.kinds["image"].token_id
    if ts.single:
        row = {**row, "input_ids": torch.cat([ids[image], ids[~image]])}
        image = torch.arange(len(ids)) < int(image.sum()) + 3
    return {**row, "token_type_ids": torch.where(image, ts.value, 1 - ts.value).long()}


def _placeholder_row(model, *, text: int, images: int, videos: int, seed: int) -> dict:
    """One conversation: ``text`` random tokens with ``images`` images and ``videos`` videos spread among them, each
    a unit of the layout the model's tower took at the probe (fresh random pixels)."""
    from ds_wallfacer.adapters.vision import vision_language

    adapter = vision_language(model)
    found = adapter.probed()
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(8, 100, (text,), generator=g)
    items = ["image"] * images + ["video"] * videos
    pieces, media, at = [], {}, 0
    for i, kind in enumerate(items):
        cut = round(text * (i + 1) / (len(items) + 1))
        unit = found[kind]
        pieces += [words[at:cut], torch.full((unit.rows,), adapter.kinds[kind].token_id)]
        for key, value in unit.args.items():
            media.setdefault(key, []).append(torch.randn(value.shape, generator=g) if value.is_floating_point()
                                             else value)
        at = cut
    return {"input_ids": torch.cat(pieces + [words[at:]]), **{k: torch.cat(v) for k, v in media.items()}}


def _placeholder_rows(model, step: int) -> list[dict]:
    """Two conversations (one image; two images and, where the model takes videos, a video); none at step 1 for
    the packed runs (a batch without images: every rank touches the tower)."""
    videos = 1 if "video" in type(model).__name__.lower() or "Onevision" in type(model).__name__ else 0
    images = (0, 0) if step == 1 and model.config.model_type in ("internvl",) else (1, 2)
    rows = [_placeholder_row(model, text=21 + 4 * step, images=images[0], videos=0, seed=10 * step),
            _placeholder_row(model, text=15, images=images[1], videos=videos if images[1] else 0, seed=10 * step + 1)]
    return [_with_types(model, r) for r in rows]


def _placeholder_loss(ref, rows: list[dict]) -> torch.Tensor:
    """The token mean over the conversations, each run alone through the model's own forward."""
    total, count = 0.0, 0
    for r in rows:
        ids = r["input_ids"][None]
        media = {k: v[None] if k == "token_type_ids" else v for k, v in r.items() if k != "input_ids"}
        logits = ref(input_ids=ids, use_cache=False, **media).logits
        total = total + F.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="sum")
        count += ids.shape[1] - 1
    return total / count


def _train_placeholder(model_type: str, cls: str, wallfacer: dict, stage: int, packed: bool) -> list[str]:
    from ds_wallfacer.examples.vlm import conversation_batch
    from ds_wallfacer.integration import initialize

    ours, ref = _build(model_type, cls), _build(model_type, cls)
    config = {"train_micro_batch_size_per_gpu": 1 if packed else 2, "gradient_clipping": 0,
              "zero_optimization": zero_section(stage), "zero_allow_untested_optimizer": True, "wallfacer": wallfacer}
    engine, sp = initialize(model=ours, config=config, optimizer=torch.optim.SGD(ours.parameters(), lr=LR))
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    failures = _steps(engine, opt, ref, lambda step: _placeholder_rows(ref, step), _placeholder_loss,
                      lambda rows: sp.shard(conversation_batch(rows, packed=packed, token_ids=None)))
    if model_type == "paligemma2":
        failures += _prefix_refusal(sp, ref)
    engine.destroy()
    return [f"{cls} {wallfacer} zero {stage} packed={packed}: {f}" for f in failures]


def _prefix_refusal(sp, model) -> list[str]:
    """PaliGemma 2's sliding layers see a prefix whole: one longer than the window is refused at batch time, with
    the class, the prefix length and the window named."""
    row = _placeholder_row(model, text=30, images=1, videos=0, seed=3)
    n = len(row["input_ids"])
    batch = {**{k: v[None] if k == "input_ids" else v for k, v in row.items()},
             "token_type_ids": (torch.arange(n) >= 40).long()[None]}
    try:
        sp.shard(batch)
    except ValueError as err:
        msg = str(err)
        if all(w in msg for w in ("PaliGemmaForConditionalGeneration", "40 tokens", "window of 36")):
            return []
        return [f"the refusal of a prefix longer than the window does not name the class, 40 tokens, the window: {msg}"]
    return ["a PaliGemma 2 prefix of 40 tokens under a window of 36 was sharded"]


def _body(rank: int, world: int) -> dict:
    failures = [f for case in CASES for f in _train(*case)] + _train_mixed(rank)
    failures += [f for case in PLACEHOLDER_CASES for f in _train_placeholder(*case)]
    return {"failures": failures}


def test_vision_language_models_with_images_train_like_one_process() -> None:
    pytest.importorskip("transformers.models.qwen3_vl")
    results = run_distributed(_body, 4, timeout_s=900)
    failures = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res["failures"]]
    assert not failures, "\n".join(failures[:30])
