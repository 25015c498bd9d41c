"""MsT and mixture-of-experts blocks: the position-wise probe tells a sparse-MoE block from a dense MLP without
crashing, ``apply_mini_sequence`` leaves MoE blocks alone with a note (their router logits feed the aux loss with
their gradient) and still chunks the dense MLPs of the same model; the model then trains as before."""
from __future__ import annotations

import pytest
import torch

from ds_wallfacer.mst import apply_mini_sequence
from ds_wallfacer.mst.mlp import check_position_wise
from tests.adapters.models import MOE_FAMILIES, tiny_moe


def test_probe_rejects_a_block_that_needs_batch_and_sequence_dims() -> None:
    block = tiny_moe("mixtral").model.layers[0].mlp  # unpacks [B, S, d]: a flat [c, d] mini-sequence breaks it
    why = check_position_wise(block, block.forward, 64)
    assert why is not None and "flat" in why, why


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_blocks_are_left_alone_and_the_loss_is_unchanged(family: str) -> None:
    ref, ours = tiny_moe(family), tiny_moe(family)
    handle = apply_mini_sequence(ours, {"mlp_chunk_tokens": 3, "activation_checkpointing": "none"})
    moe = {n for n, m in ours.named_modules() if n.endswith(".mlp") and hasattr(m, "experts")}
    assert set(handle.skipped) == moe and all("mixture-of-experts" in w for w in handle.skipped.values())
    dense = {n for n, m in ours.named_modules() if n.endswith(".mlp") and not hasattr(m, "experts")}
    assert set(handle.mlp_modules) == dense  # Qwen2-MoE's dense layer is still chunked
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    want, got = ref(input_ids=ids, labels=ids), ours(input_ids=ids, labels=ids)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=1e-6)
    assert got.aux_loss is not None
    want.loss.backward()
    got.loss.backward()
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
