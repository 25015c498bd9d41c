"""The head-parallel layout (``mixers.head_parallel``) on 4 gloo ranks: ``gather_heads`` hands rank j exactly heads
[j H / P, (j + 1) H / P) of the whole sequence in order, ``scatter_heads`` returns this rank's pieces bitwise, the
gradient of each is the other's layout (fp64), and each sends ``head_parallel_bytes``, for zigzag, contiguous,
hybrid (U = 2) pieces and a balanced assignment."""
from __future__ import annotations

import torch

from tests.dist_utils import run_distributed

B, N, H, D = 2, 48, 8, 3
CASES = [("zigzag", 1, None), ("contiguous", 1, None), ("zigzag", 2, None),
         ("balanced", 1, ((0, 5), (1, 7), (2, 3), (4, 6)))]


def _run(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    from ds_wallfacer.comm import CommLayer
    from ds_wallfacer.data.pieces import shard_sequence
    from ds_wallfacer.mixers import ChunkRing, gather_heads, head_parallel_bytes, scatter_heads

    failures = []
    heads = slice(rank * H // world, (rank + 1) * H // world)
    for i, (sharding, u, assignment) in enumerate(CASES):
        g = torch.Generator().manual_seed(i)
        x, w, v = (torch.randn(B, N, h, D, generator=g, dtype=torch.float64) for h in (H, H, H // world))
        y_all = [torch.randn(B, N, H // world, D, generator=torch.Generator().manual_seed(100 + i * 10 + j),
                             dtype=torch.float64) for j in range(world)]
        y = y_all[rank]

        def sh(t: torch.Tensor) -> torch.Tensor:
            return shard_sequence(t, dim=1, index=rank, sp_size=world, ulysses_degree=u, scheme=sharding,
                                  assignment=assignment)

        ring = ChunkRing(peers=tuple(range(world)), index=rank, sharding=sharding, ulysses_degree=u,
                         assignment=assignment)
        kw = dict(ring=ring, group_shards=tuple(range(world)), group=dist.group.WORLD)
        comm = CommLayer()
        xl = sh(x).requires_grad_()
        (got,) = gather_heads([xl], comm=comm, **kw)
        name = f"{sharding} U={u}"
        if not torch.equal(got, x[:, :, heads]):
            failures.append(f"{name}: gathered heads differ from the sequence's")
        (got * w[:, :, heads]).sum().backward()
        if not torch.equal(xl.grad, sh(w)):
            failures.append(f"{name}: gather's gradient is not this rank's pieces of the upstream gradient")
        yl = y.clone().requires_grad_()
        back = scatter_heads(yl, comm=comm, **kw)
        want = sh(torch.cat(y_all, dim=2))
        if not torch.equal(back, want):
            failures.append(f"{name}: scattered pieces differ")
        (back * sh(torch.cat([v] * world, dim=2))).sum().backward()
        if not torch.equal(yl.grad, v):
            failures.append(f"{name}: scatter's gradient is not the sequence of this rank's heads")
        # each way: the gather (H x D per local token) and the scatter (the same width), forward and backward
        one = head_parallel_bytes(rows=B, tokens=N // world, width=H * D, element_size=8, sp_size=world)
        for phase in ("forward", "backward"):
            got_bytes, want_bytes = comm.by_kind(phase).get("heads", 0), 2 * one
            if got_bytes != want_bytes:
                failures.append(f"{name}: {phase} all-to-all bytes {got_bytes} != {want_bytes}")
    return failures


def test_gather_and_scatter_heads_are_exact_inverse_layouts() -> None:
    failures = [f"rank {r}: {f}" for r, fs in enumerate(run_distributed(_run, 4, timeout_s=120)) for f in fs]
    assert not failures, "\n".join(failures)
