"""A causal depthwise convolution (kernel K, ``out[t] = b + sum_k w[k] x[t - (K-1) + k]``) on this rank's shard.

Each rank holds pieces of the sequence (two of 2P, ``data.pieces``). Every output of a piece needs the K - 1 inputs
before it, and for the chunk's first K - 1 tokens those are the last K - 1 inputs of the chunk before it, held by
another rank (or this one: zigzag's rank P - 1 holds chunks P - 1 and P). So each chunk sends its tail (K - 1
positions, all channels) to the holder of the next chunk and receives the previous chunk's tail: one
point-to-point exchange per convolution, ``halo_bytes`` bytes per rank, instead of any all-gather; the backward
sends the halo's gradient back the same way. The exchange needs the tails only, so it can start as soon as they are
computed. Per rank and convolution: ``halo_bytes``; over the group, (pieces - 1 - boundaries inside one rank) x
B x D x (K - 1) x element size each way, against attention's O(N x heads x head_dim) per layer.

Documents: a token at position p within its document has p tokens of that document before it, so the term of the
input j steps back (j = K - 1 - k) is kept only where ``positions >= j``. With global positions (no packing) that is
exactly the zero padding before the sequence; with packed rows (positions restart per document) it resets the
convolution at every document start, as the CUDA kernels do with ``seq_idx``.

Design: Note [Short convolutions on shards] in docs/design/mixers.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..comm import CommLayer
from ..data.pieces import Assignment, sequence_chunk_ids

__all__ = ["ChunkRing", "halo_bytes", "sharded_causal_conv1d"]


@dataclass(frozen=True)
class ChunkRing:
    """Who holds the pieces before and after this rank's: ``peers`` are the global ranks of the sequence-parallel
    group in group order, ``index`` this rank's place in it; the pieces are ``data.pieces.sequence_chunk_ids``'s
    (two of 2P, or a balanced ``assignment``'s, each cut ``ulysses_degree`` ways)."""

    peers: tuple[int, ...]
    index: int
    sharding: str = "zigzag"
    ulysses_degree: int = 1
    assignment: Assignment | None = None

    def pieces_of(self, index: int) -> tuple[int, ...]:
        return sequence_chunk_ids(index, sp_size=len(self.peers), ulysses_degree=self.ulysses_degree,
                                  scheme=self.sharding, assignment=self.assignment)

    @property
    def chunks(self) -> tuple[int, ...]:
        """This rank's pieces, in local order."""
        return self.pieces_of(self.index)

    @cached_property
    def _holders(self) -> dict[int, tuple[int, int]]:
        """Global piece -> (global rank, local slot), for every piece (worked out once per ring)."""
        return {c: (peer, slot) for i, peer in enumerate(self.peers) for slot, c in enumerate(self.pieces_of(i))}

    @property
    def count(self) -> int:
        """Pieces in the whole sequence."""
        return len(self._holders)

    def holder(self, chunk: int) -> tuple[int, int]:
        """(global rank, local slot) of global piece ``chunk``."""
        if chunk not in self._holders:
            raise ValueError(f"piece {chunk} is outside the {self.count} pieces of the sequence")
        return self._holders[chunk]

    def sends(self) -> list[tuple[int, int]]:
        """(local slot, destination rank) for each local piece that has a successor."""
        last = self.count - 1
        return [(slot, self.holder(c + 1)[0]) for slot, c in enumerate(self.chunks) if c < last]

    def recvs(self) -> list[tuple[int, int]]:
        """(local slot, source rank) for each local piece that has a predecessor."""
        return [(slot, self.holder(c - 1)[0]) for slot, c in enumerate(self.chunks) if c > 0]


def halo_bytes(ring: ChunkRing, *, rows: int, channels: int, kernel: int, element_size: int,
               phase: str = "forward") -> int:
    """Bytes this rank sends in one exchange, rows x channels x (K - 1) x element size per piece boundary that
    crosses ranks: forward, each tail whose next piece is held by another rank; backward, each halo gradient whose
    previous piece is (the same boundaries, so the same total over the group)."""
    me = ring.peers[ring.index]
    peers = ring.sends() if phase == "forward" else ring.recvs()
    remote = sum(1 for _, peer in peers if peer != me)
    return remote * rows * channels * (kernel - 1) * element_size


def _pass(x: torch.Tensor, sends: list[tuple[int, int]], recvs: list[tuple[int, int]], *, comm: CommLayer,
          group: dist.ProcessGroup) -> torch.Tensor:
    """x [B, D, m, h]: send slot s to its (slot, peer) in ``sends``, receive each (slot, peer) of ``recvs`` into
    that slot of the result; slots that receive nothing are zeros."""
    bufs = [torch.empty_like(x[:, :, 0]) for _ in recvs]
    pending = comm.exchange([(x[:, :, slot].contiguous(), peer) for slot, peer in sends],
                            [(buf, peer) for buf, (_, peer) in zip(bufs, recvs)], kind="halo", group=group)
    out = torch.zeros_like(x)
    for (slot, _), buf in zip(recvs, pending.wait()):
        out[:, :, slot] = buf
    return out


class _Halo(torch.autograd.Function):
    """tails [B, D, m, h] (each local piece's last h inputs) -> halos [B, D, m, h] (the previous piece's tail,
    zeros before the first piece); the backward returns each halo's gradient to the piece it came from."""

    @staticmethod
    def forward(ctx, tails: torch.Tensor, ring: ChunkRing, comm: CommLayer, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.ring, ctx.comm, ctx.group = ring, comm, group
        return _pass(tails, ring.sends(), ring.recvs(), comm=comm, group=group)

    @staticmethod
    def backward(ctx, d_halos: torch.Tensor):
        # each halo's gradient goes back to the holder of the piece it came from: the forward's exchange reversed
        ring = ctx.ring
        return _pass(d_halos, ring.recvs(), ring.sends(), comm=ctx.comm, group=ctx.group), None, None, None


def sharded_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
                          positions: torch.Tensor | None, ring: ChunkRing, comm: CommLayer,
                          group: dist.ProcessGroup) -> torch.Tensor:
    """x [B, D, S_l] (this rank's pieces, local order), weight [D, K], bias [D] or None -> [B, D, S_l]: the model's
    causal convolution of the whole sequence, restricted to this rank's tokens. ``positions`` [B, S_l]: each
    token's position inside its document, for packed rows (the convolution restarts at every document start);
    None for one sequence per row (the zero halo before the first piece is the zero padding)."""
    b, d, s_local = x.shape
    k = weight.shape[-1]
    h = k - 1
    m = len(ring.chunks)
    if s_local % m:
        raise ValueError(f"a shard of {s_local} tokens is not {m} equal pieces")
    length = s_local // m
    if h > length:
        raise ValueError(f"a convolution of kernel {k} needs pieces of at least {h} tokens, got {length}: use "
                         "longer sequences or fewer sequence-parallel ranks")
    chunks = x.unflatten(-1, (m, length))  # [B, D, m, L]
    if h == 0:
        out = chunks * weight[:, 0, None, None]
    else:
        halos = _Halo.apply(chunks[..., -h:].contiguous(), ring, comm, group)
        ext = torch.cat([halos.to(chunks.dtype), chunks], dim=-1)  # [B, D, m, h + L]
        if positions is None:  # one depthwise convolution over every piece with its halo
            rows = ext.transpose(1, 2).reshape(b * m, d, h + length)
            out = F.conv1d(rows, weight.unsqueeze(1), None, groups=d).reshape(b, m, d, length).transpose(1, 2)
        else:
            pos = positions.reshape(b, 1, m, length)
            out = chunks * weight[:, h, None, None]  # j = 0: the token itself
            for j in range(1, k):
                term = ext[..., h - j:h - j + length] * weight[:, h - j, None, None]
                out = out + term * (pos >= j).to(term.dtype)
    if bias is not None:
        out = out + bias[:, None, None]
    return out.reshape(b, d, s_local)
