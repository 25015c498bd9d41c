"""The causal depthwise convolution on sequence shards (``mixers.short_conv``) on 4 gloo ranks against the whole
sequence in one process: outputs and the gradients of input, weight and bias (fp64, 1e-12), for zigzag,
contiguous and hybrid (U = 2) pieces and a balanced assignment, kernels 2-4, one sequence per row (the grouped
convolution, or the masked taps with global positions) or packed documents
(positions restarting, including a document that starts inside a piece's first K - 1 tokens); the bytes sent equal
``halo_bytes`` in each direction, and over the group one halo per piece boundary that crosses ranks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.dist_utils import run_distributed

B, D, N = 2, 6, 48
DOC_STARTS = (0, 13, 25, 26, 40)  # 25 and 26: documents of one token; with P = 4 zigzag, 26 is 2 into piece 4 (L 6)


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, starts: tuple[int, ...] | None) -> torch.Tensor:
    """transformers' torch path (F.conv1d, K - 1 zeros before), per document when ``starts`` is given."""
    k = w.shape[-1]
    if starts is None:
        return F.conv1d(x, w.unsqueeze(1), bias, padding=k - 1, groups=x.shape[1])[..., : x.shape[-1]]
    ends = [*starts[1:], x.shape[-1]]
    return torch.cat([reference(x[..., s:e], w, bias, None) for s, e in zip(starts, ends)], dim=-1)


def positions(starts: tuple[int, ...] | None) -> torch.Tensor:
    if starts is None:
        return torch.arange(N).expand(B, N)
    pos = torch.empty(N, dtype=torch.long)
    for s, e in zip(starts, [*starts[1:], N]):
        pos[s:e] = torch.arange(e - s)
    return pos.expand(B, N)


CASES = [  # (sharding, ulysses degree, kernel, documents: None, "global" positions or "packed")
    ("zigzag", 1, 4, None), ("zigzag", 1, 3, "packed"), ("contiguous", 1, 4, "packed"), ("zigzag", 2, 4, "packed"),
    ("zigzag", 1, 2, None), ("balanced", 1, 3, "packed"), ("zigzag", 2, 3, "global"), ("contiguous", 1, 3, None),
]
ASSIGNMENT = ((0, 5), (1, 7), (2, 3), (4, 6))  # 8 ring chunks over 4 ranks, unordered


def _run(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    from ds_wallfacer.comm import CommLayer
    from ds_wallfacer.data.pieces import shard_sequence
    from ds_wallfacer.mixers import ChunkRing, halo_bytes, sharded_causal_conv1d

    failures = []
    for i, (sharding, u, k, documents) in enumerate(CASES):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(B, D, N, generator=g, dtype=torch.float64)
        w = torch.randn(D, k, generator=g, dtype=torch.float64)
        bias = torch.randn(D, generator=g, dtype=torch.float64)
        dy = torch.randn(B, D, N, generator=g, dtype=torch.float64)
        starts = DOC_STARTS if documents == "packed" else None
        xr, wr, br = (t.clone().requires_grad_() for t in (x, w, bias))
        want = reference(xr, wr, br, starts)
        want.backward(dy)
        assignment = ASSIGNMENT if sharding == "balanced" else None
        ring = ChunkRing(peers=tuple(range(world)), index=rank, sharding=sharding, ulysses_degree=u,
                         assignment=assignment)

        def sh(t: torch.Tensor) -> torch.Tensor:
            return shard_sequence(t, dim=-1, index=rank, sp_size=world, ulysses_degree=u, scheme=sharding,
                                  assignment=assignment)

        comm = CommLayer()
        xl, wl, bl = sh(x).requires_grad_(), w.clone().requires_grad_(), bias.clone().requires_grad_()
        with comm.phase("forward"):
            pos = None if documents is None else sh(positions(starts))
            out = sharded_causal_conv1d(xl, wl, bl, positions=pos, ring=ring, comm=comm,
                                        group=dist.group.WORLD)
        with comm.phase("backward"):
            out.backward(sh(dy))
        for t in (wl.grad, bl.grad):
            dist.all_reduce(t)
        name = f"{sharding} U={u} K={k} {documents}"
        for what, a, b in (("output", out, sh(want)), ("input grad", xl.grad, sh(xr.grad)),
                           ("weight grad", wl.grad, wr.grad), ("bias grad", bl.grad, br.grad)):
            if not torch.allclose(a, b, rtol=1e-12, atol=1e-12):
                failures.append(f"{name}: {what} off by {(a - b).abs().max().item():.2e}")
        for phase in ("forward", "backward"):
            totals = torch.tensor([comm.by_kind(phase).get("halo", 0)])
            dist.all_reduce(totals)
            crossing = sum(1 for i in range(ring.count - 1) if ring.holder(i)[0] != ring.holder(i + 1)[0])
            if int(totals) != crossing * B * D * (k - 1) * 8:
                failures.append(f"{name}: {phase} group total {int(totals)} != {crossing} boundaries' halos")
            want_bytes = halo_bytes(ring, rows=B, channels=D, kernel=k, element_size=8, phase=phase)
            got = comm.by_kind(phase).get("halo", 0)
            if got != want_bytes:
                failures.append(f"{name}: {phase} halo bytes {got} != {want_bytes}")
    return failures


def test_sharded_convolution_equals_the_whole_sequence_and_sends_only_the_halos() -> None:
    failures = [f"rank {r}: {f}" for r, fs in enumerate(run_distributed(_run, 4, timeout_s=120)) for f in fs]
    assert not failures, "\n".join(failures)


def test_a_rank_holding_consecutive_pieces_sends_nothing_to_itself() -> None:
    from ds_wallfacer.mixers import ChunkRing, halo_bytes

    # zigzag, P = 4: rank 3 holds pieces 3 and 4, so piece 3's tail stays on the rank (a local copy, no bytes)
    ring = ChunkRing(peers=(0, 1, 2, 3), index=3)
    assert ring.sends() == [(0, 3), (1, 2)] and ring.recvs() == [(0, 2), (1, 3)]
    assert halo_bytes(ring, rows=1, channels=8, kernel=4, element_size=2) == 1 * 8 * 3 * 2
    assert halo_bytes(ring, rows=1, channels=8, kernel=4, element_size=2, phase="backward") == 1 * 8 * 3 * 2
    # the first and last pieces have no predecessor / successor
    assert ChunkRing(peers=(0, 1, 2, 3), index=0).sends() == [(0, 1)]
    assert ChunkRing(peers=(0, 1, 2, 3), index=0).recvs() == [(1, 1)]
