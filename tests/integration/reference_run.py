"""The training run shared by test_packed.py and the adapter parity tests (tests/adapters/): a tiny model through
the real integration (``initialize``, a DeepSpeed engine) against the same model in one process, loss at every step
and every parameter after ``STEPS`` SGD steps (fp32, clipping off); with packed documents the reference runs each
document alone; with bidirectional spans it gets transformers' own masks of Gemma 3's image tokens there."""
from __future__ import annotations

from typing import Callable

import torch

from tests.integration.parity import LOSS_RTOL, param_failures, parity_config

__all__ = ["LR", "SEQ", "STEPS", "doc_lengths", "gemma3_image_masks", "per_document_loss", "train_like_reference"]

LR = 0.5
STEPS = 2
SEQ = 64


def doc_lengths(seed: int) -> list[int]:
    """Documents of 2..40 tokens summing to SEQ: several straddle rank boundaries, one is longer than a shard."""
    g = torch.Generator().manual_seed(seed)
    out, left = [], SEQ
    while left:
        n = min(left, int(torch.randint(2, 41, (1,), generator=g)))
        if left - n == 1:
            n += 1
        out.append(n)
        left -= n
    return out


def per_document_loss(model: torch.nn.Module, ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """The reference: each document alone through the model; sum of token losses / number of targets."""
    total, count, start = 0.0, 0, 0
    for n in lengths:
        doc = ids[:, start : start + n]
        total = total + model(input_ids=doc, labels=doc).loss * (n - 1)
        count += n - 1
        start += n
    return total / count


def gemma3_image_masks(config, spans: list[tuple[int, int]], n: int) -> dict[str, torch.Tensor]:
    """The masks transformers gives a Gemma 3 language model when ``spans`` of a row of ``n`` tokens are image
    tokens (``create_masks_for_vision_model``, per layer type), for the model's own attention."""
    from transformers.models.gemma3.modeling_gemma3 import create_masks_for_vision_model, \
        get_block_sequence_ids_for_mask

    types = torch.zeros(1, n, dtype=torch.long)
    for a, b in spans:
        types[0, a:b] = 1
    return create_masks_for_vision_model(config, torch.zeros(1, n, config.hidden_size), None, None,
                                         torch.arange(n)[None], get_block_sequence_ids_for_mask(types))


def train_like_reference(make: Callable[[], torch.nn.Module], wallfacer: dict, *, stage: int = 1,
                         packed: bool, spans: Callable[[int], list[tuple[int, int]]] | None = None) -> list[str]:
    """``make()`` twice (same seed): one model under ``initialize``, one in this process; what differs, labelled.
    ``spans(step)``: the row's bidirectional spans, as Gemma 3's image tokens (``gemma3_image_masks``)."""
    from ds_wallfacer.integration import initialize

    ours, ref = make(), make()
    engine, sp = initialize(model=ours, config=parity_config(stage=stage, wallfacer=wallfacer),
                            optimizer=torch.optim.SGD(ours.parameters(), lr=LR))
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    failures = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(1, 256, (1, SEQ), generator=g)
        if packed:
            lengths = doc_lengths(step)
            batch = {"input_ids": ids, "document_lengths": [lengths]}
            want = per_document_loss(ref, ids, lengths)
        elif spans is not None:
            batch = {"input_ids": ids, "bidirectional_spans": [spans(step)]}
            want = ref(input_ids=ids, labels=ids, attention_mask=gemma3_image_masks(ref.config, spans(step), SEQ)).loss
        else:
            batch = {"input_ids": ids}
            want = ref(input_ids=ids, labels=ids).loss
        loss = engine(**sp.shard(batch))
        got, ref_loss = loss.item(), want.item()
        if abs(got - ref_loss) > LOSS_RTOL * max(1.0, abs(ref_loss)):
            failures.append(f"{wallfacer} stage {stage}: step {step} loss {got:.7f} != reference {ref_loss:.7f}")
        engine.backward(loss)
        engine.step()
        opt.zero_grad()
        want.backward()
        opt.step()
    failures += [f"{wallfacer} stage {stage}: {f}" for f in
                 param_failures(engine, {k: v.detach() for k, v in ref.named_parameters()}, steps=STEPS)]
    engine.destroy()
    return failures
