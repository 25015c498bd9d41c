"""Ulysses and the hybrid refuse mismatched shards with the same clear error on every rank: one metadata
all-gather over the whole sequence-parallel group, before the all-to-all that would otherwise abort inside gloo
("Received data size doesn't match") or hang. 4 gloo ranks, one launch for every case."""
from __future__ import annotations

import torch

from tests.dist_utils import run_distributed

MODES = (("ulysses", 4), ("hybrid", 2))


def _mismatched(rank: int, world: int) -> dict[str, list]:
    from ds_wallfacer.comm import CommLayer
    from ds_wallfacer.comm.dims import ParallelDims
    from ds_wallfacer.planner.auto import ParallelSetup
    from ds_wallfacer.integration.parallel import attention_for, build_sequence_parallel

    def mk(s: int, h: int = 4, dt: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(1, h, s, 8, dtype=dt)

    cases = [
        # (q, k, v) on this rank; the comment says which ranks differ
        lambda: (mk(8), mk(8), mk(8)) if rank != 3 else (mk(12), mk(12), mk(12)),  # length, rank 3
        lambda: (mk(8), mk(8), mk(8)) if rank < 2 else (mk(16), mk(16), mk(16)),  # length, ranks 2-3 (one U=2 group)
        lambda: (mk(8), mk(8), mk(8)) if rank != 1 else tuple(mk(8, dt=torch.bfloat16) for _ in range(3)),  # dtype
        lambda: (mk(8), mk(8), mk(8)) if rank != 2 else (mk(8, h=8), mk(8), mk(8)),  # query heads, rank 2
        lambda: (mk(8), mk(8), mk(8)) if rank != 0 else (mk(7), mk(7), mk(7)),  # odd local length, rank 0
    ]
    out = {}
    for mode, u in MODES:
        lay = ParallelSetup(ParallelDims(world_size=world, sp_size=world, mode=mode, ulysses_degree=u, num_heads=4,
                                         num_kv_heads=4))
        attn = attention_for(build_sequence_parallel(lay), comm=CommLayer())
        messages: list = []
        for make in cases:
            try:
                attn(*make(), causal=True)
                messages.append(None)
            except ValueError as e:
                messages.append(str(e))
        messages.append(tuple(attn(mk(8), mk(8), mk(8), causal=True).shape))  # the groups are still usable
        out[mode] = messages
    return out


def test_mismatched_shards_are_a_clear_error_on_every_rank() -> None:
    results = run_distributed(_mismatched, 4, timeout_s=120)
    for mode, _ in MODES:
        for rank, res in enumerate(results):
            length, group_length, dtype, heads, odd, good = res[mode]
            where = f"{mode}, rank {rank}"
            assert length.startswith("Ulysses attention: local seq len differs across sequence-parallel ranks: "
                                     "[8, 8, 8, 12] (by rank index)"), (where, length)
            assert "local seq len differs" in group_length and "[8, 8, 16, 16]" in group_length, (where, group_length)
            assert "dtype differs" in dtype and "torch.bfloat16" in dtype, (where, dtype)
            assert "q heads differs across sequence-parallel ranks: [4, 4, 8, 4]" in heads, (where, heads)
            if rank == 0:
                assert "local sequence length 7 is odd" in odd and "divisible by 2P" in odd, (where, odd)
            else:
                assert "sequence-parallel rank(s) [0] rejected their inputs" in odd, (where, odd)
            assert good == (1, 4, 8, 8), (where, good)
