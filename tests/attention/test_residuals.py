"""Attention runs once per step under layer checkpointing (``attention/residuals.py``), at the attention level on 4
gloo ranks: a two-layer model of attention blocks (q/k/v and output projections around ring, WallFacer C = 2,
Ulysses, hybrid and local attention), each block checkpointed by torch's non-reentrant or reentrant checkpoint or
DeepSpeed's (through ``KeepAttention``).

Per step and phase (one document per row, and packed documents), the block-kernel calls, the bytes sent by kind and
the attention work must equal the run without checkpointing, and the loss and every gradient must match it (fp32);
without ``KeepAttention`` the forward kernels and forward bytes double (what the residuals remove). What is kept must
equal ``kept_bytes_per_layer`` and be freed by the end of backward. Entries never cross steps: two forwards before
their backwards, an evaluation under no_grad, and a recompute that differs from its first forward (another window)
each compute correctly, the last one for real. A replayed node is freed without the garbage collector.
"""
from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
from torch import nn

from tests.attention.counting import count_kernels
from tests.dist_utils import run_distributed

B, HQ, HK, D, N, E = 2, 4, 2, 8, 32, 24
LAYERS = 2
# name -> (mode, U, C) on 4 ranks; None: local attention on each rank (P = 1)
MODES = {"local": None, "ring": ("wallfacer", 1, 1), "wallfacer": ("wallfacer", 1, 2), "ulysses": ("ulysses", 4, 1),
         "hybrid": ("hybrid", 2, 1)}
OPS_PER_LAYER = {"local": 1, "ring": 1, "wallfacer": 1, "ulysses": 3, "hybrid": 3}  # all-to-all, inner, all-to-all
KEEP = ("torch", "torch_reentrant", "deepspeed")
RECOMPUTE = ("torch_recompute", "deepspeed_recompute")
TOL = dict(rtol=1e-6, atol=1e-7)


class _Block(nn.Module):
    def __init__(self, attn, window: list, batch) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, (HQ + 2 * HK) * D)
        self.out = nn.Linear(HQ * D, E)
        self.attn, self.window, self.batch = attn, window, batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, -1, D).transpose(1, 2) for t in self.qkv(x).split([HQ * D, HK * D, HK * D], -1))
        w = self.window.pop(0) if len(self.window) > 1 else self.window[0]  # the mismatch case changes it once
        o = self.attn(q, k, v, causal=True, window=w, batch=self.batch)
        return x + self.out(o.transpose(1, 2).reshape(b, s, HQ * D))


class _Model(nn.Module):
    def __init__(self, attn, layers: int = LAYERS, window: list | None = None, batch=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_Block(attn, window or [None], batch) for _ in range(layers))

    def forward(self, x: torch.Tensor, ckpt) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x) if ckpt is None else ckpt(blk, x)
        return x


def _checkpoint(variant: str):
    from torch.utils.checkpoint import checkpoint

    from ds_wallfacer.attention.residuals import KeepAttention
    from ds_wallfacer.mst.checkpointing import _DeepSpeedCheckpoint

    if variant == "none":
        return None
    base = {"torch": functools.partial(checkpoint, use_reentrant=False),
            "torch_reentrant": functools.partial(checkpoint, use_reentrant=True),
            "deepspeed": _DeepSpeedCheckpoint(None, None)}[variant.removesuffix("_recompute")]
    return base if variant.endswith("_recompute") else KeepAttention(base)


def _attention(rank: int, world: int, mode: str, cache: dict):
    from ds_wallfacer.attention.ulysses import LocalAttention
    from ds_wallfacer.comm import CommLayer
    from ds_wallfacer.comm.dims import ParallelDims
    from ds_wallfacer.planner.auto import ParallelSetup
    from ds_wallfacer.integration.parallel import attention_for, build_sequence_parallel

    if MODES[mode] is None:
        return LocalAttention(), CommLayer(), lambda x: x, None
    if mode not in cache:  # groups are collective to build: once per layout
        kind, u, c = MODES[mode]
        lay = ParallelSetup(ParallelDims(world_size=world, sp_size=world, mode=kind, ulysses_degree=u, ring_count=c,
                                         num_heads=HQ, num_kv_heads=HK))
        cache[mode] = (lay, build_sequence_parallel(lay))
    lay, groups = cache[mode]
    comm = CommLayer()
    from ds_wallfacer.data import shard_sequence

    def shard(x: torch.Tensor) -> torch.Tensor:
        return shard_sequence(x, dim=1, index=groups.shard_index, sp_size=world, ulysses_degree=lay.dims.ulysses_degree)

    return attention_for(groups, comm=comm), comm, shard, groups


def _leaf(attn):
    return getattr(attn, "inner", attn)


def _step(model, x_local, ckpt, comm, kernels: Counter, leaf) -> dict:
    comm.reset()
    kernels.clear()
    work = getattr(leaf, "work", Counter())
    work.clear()
    for p in model.parameters():
        p.grad = None
    x = x_local.clone().requires_grad_(True)
    out = model(x, ckpt)
    g = torch.Generator().manual_seed(7)
    loss = (out * torch.randn(out.shape, generator=g)).sum()
    loss.backward()
    return dict(loss=loss.detach(), grads=[x.grad] + [p.grad.clone() for p in model.parameters()],
                sent=dict(comm.sent), kernels=dict(kernels), work=dict(work))


def _expected_bytes(mode: str, world: int) -> int:
    from ds_wallfacer.attention.residuals import kept_bytes_per_layer

    if MODES[mode] is None:
        return kept_bytes_per_layer(batch=B, local_tokens=N, q_heads=HQ, kv_heads=HK, head_dim=D, elem_bytes=4)
    _, u, c = MODES[mode]
    return kept_bytes_per_layer(batch=B, local_tokens=N // world, q_heads=HQ, kv_heads=HK, head_dim=D, elem_bytes=4,
                                ulysses_degree=u, ring_size=world // u, ring_count=c)


def _modes(rank: int, world: int, kernels: Counter, cache: dict) -> list[str]:
    failures = []
    x_full = torch.randn(B, N, E, generator=torch.Generator().manual_seed(3))
    from ds_wallfacer.attention.documents import BatchDocuments, SequenceBatch

    packed = SequenceBatch(documents=BatchDocuments(starts=((0, 11, 20), (0, 5)), seq_len=N))
    refs: dict = {}
    for mode, batch in [(m, None) for m in MODES] + [(m, packed) for m in MODES]:
        attn, comm, shard, _ = _attention(rank, world, mode, cache)
        model = _Model(attn, batch=batch)
        x = shard(x_full)
        _step(model, x, None, comm, kernels, _leaf(attn))  # warm-up: the input checks' one-time all-gather
        ref = _step(model, x, None, comm, kernels, _leaf(attn))
        refs[mode, batch is None] = ref
        # documents cut the score entries computed (local attention, which counts none: split its kernel calls)
        if batch is not None and (ref["work"]["forward"] >= refs[mode, True]["work"]["forward"] if ref["work"] else
                                  ref["kernels"]["forward"] <= refs[mode, True]["kernels"]["forward"]):
            failures.append(f"{mode}: packed documents changed neither the work nor the kernel calls ({ref['kernels']})")
        for variant in KEEP + RECOMPUTE if batch is None else ("torch", "deepspeed"):
            ckpt = _checkpoint(variant)
            got = _step(model, x, ckpt, comm, kernels, _leaf(attn))
            name = f"{mode}/{variant}" + ("/packed" if batch is not None else "")
            if not torch.allclose(got["loss"], ref["loss"], **TOL):
                failures.append(f"{name}: loss {got['loss']} != {ref['loss']}")
            bad = [i for i, (a, b) in enumerate(zip(got["grads"], ref["grads"])) if not torch.allclose(a, b, **TOL)]
            if bad:
                failures.append(f"{name}: gradients {bad} differ")
            if variant in KEEP:
                for what in ("sent", "kernels", "work"):
                    if got[what] != ref[what]:
                        failures.append(f"{name}: {what} {got[what]} != without checkpointing {ref[what]}")
                s = ckpt.stats
                ops = OPS_PER_LAYER[mode] * LAYERS
                want = dict(stored=ops, replayed=ops, missed=0, released=ops, kept_bytes=0,
                            peak_bytes=LAYERS * _expected_bytes(mode, world))
                if s.as_dict() != want:
                    failures.append(f"{name}: residual stats {s.as_dict()} != {want}")
            else:  # the layer recompute runs attention again: forward kernels and forward bytes double
                if got["kernels"] != {"forward": 2 * ref["kernels"]["forward"], "backward": ref["kernels"]["backward"]}:
                    failures.append(f"{name}: kernels {got['kernels']} vs {ref['kernels']}")
                fwd = {k: v for (ph, k), v in got["sent"].items() if ph == "forward" and k != "check"}
                want_fwd = {k: 2 * v for (ph, k), v in ref["sent"].items() if ph == "forward" and k != "check"}
                if fwd != want_fwd:
                    failures.append(f"{name}: forward bytes {fwd} != twice {want_fwd}")
    return failures


def _lifetimes(rank: int, world: int, kernels: Counter, cache: dict) -> list[str]:
    """Two micro-steps' forwards before their backwards, an evaluation forward, and a recompute that differs."""
    failures = []
    x_full = torch.randn(B, N, E, generator=torch.Generator().manual_seed(4))
    for mode in ("wallfacer", "hybrid"):
        attn, comm, shard, _ = _attention(rank, world, mode, cache)
        x = shard(x_full)
        model = _Model(attn)
        g = torch.Generator().manual_seed(8)
        w = torch.randn(x.shape, generator=g)
        model(x, None)  # warm-up: the input checks' one-time all-gather
        for variant in KEEP:
            ckpt = _checkpoint(variant)
            runs = {}
            for c in (None, ckpt):
                for p in model.parameters():
                    p.grad = None
                comm.reset()
                kernels.clear()
                a, b = x.clone().requires_grad_(True), (2 * x).clone().requires_grad_(True)
                la, lb = (model(a, c) * w).sum(), (model(b, c) * w).sum()  # gradient accumulation, interleaved
                lb.backward()
                la.backward()
                with torch.no_grad():  # an evaluation forward in training mode: nothing kept
                    model(x, c)
                runs[c is None] = (la.detach(), lb.detach(), a.grad, b.grad, [p.grad for p in model.parameters()],
                                   dict(comm.sent), dict(kernels))
            ref, got = runs[True], runs[False]
            name = f"{mode}/{variant}/accumulation+eval"
            if not all(torch.allclose(p, q, **TOL) for p, q in zip(ref[:4] + tuple(ref[4]), got[:4] + tuple(got[4]))):
                failures.append(f"{name}: losses or gradients differ")
            if ref[5:] != got[5:]:
                failures.append(f"{name}: bytes / kernel calls {got[5:]} != {ref[5:]}")
            ops = 2 * OPS_PER_LAYER[mode] * LAYERS
            want = dict(stored=ops, replayed=ops, missed=0, released=ops, kept_bytes=0,
                        peak_bytes=2 * LAYERS * _expected_bytes(mode, world))
            if ckpt.stats.as_dict() != want:
                failures.append(f"{name}: residual stats {ckpt.stats.as_dict()} != {want}")
        # the recompute sees another window than the first forward: nothing is replayed, attention runs again, and
        # (reentrant: the recompute's graph is back-propagated) the gradients are those of the recomputed function
        for variant in KEEP:
            ckpt = _checkpoint(variant)
            model = _Model(attn, layers=1, window=[None, 6])
            comm.reset()
            kernels.clear()
            xa = x.clone().requires_grad_(True)
            (model(xa, ckpt) * w).sum().backward()
            fwd_kernels = kernels["forward"]
            s = ckpt.stats
            name = f"{mode}/{variant}/mismatch"
            # the hybrid's first all-to-all (q, k, v to head shards) does not depend on the window: replayed
            if s.replayed != (mode == "hybrid") or not s.missed or s.kept_bytes:
                failures.append(f"{name}: residual stats {s.as_dict()}")
            kernels.clear()
            model.blocks[0].window[:] = [6]
            xb = x.clone().requires_grad_(True)
            (model(xb, None) * w).sum().backward()
            if fwd_kernels <= kernels["forward"]:
                failures.append(f"{name}: the recompute ran no attention kernel ({fwd_kernels} forward calls)")
            if variant != "torch" and not torch.allclose(xa.grad, xb.grad, **TOL):
                failures.append(f"{name}: gradients are not the recomputed function's")
    return failures


def _all(rank: int, world: int) -> list[str]:
    kernels = count_kernels()
    cache: dict = {}
    return _modes(rank, world, kernels, cache) + _lifetimes(rank, world, kernels, cache)


def test_attention_runs_once_under_checkpointing() -> None:
    results = run_distributed(_all, 4, timeout_s=420)
    failures = [f"rank {r}: {f}" for r, per_rank in enumerate(results) for f in per_rank]
    assert not failures, "\n".join(failures[:40])


@pytest.mark.parametrize("reentrant", [False, True], ids=["torch", "reentrant"])
def test_replayed_graph_is_freed_without_the_garbage_collector(reentrant: bool, monkeypatch) -> None:
    """A replaying node must not sit in a reference cycle (output -> grad_fn -> ctx -> slot -> output): every q, k, v
    and output of an attention call must be freed by reference counting once its backward has run, or each layer's
    recomputed graph (with what its other nodes saved) would stay alive until Python's garbage collector runs."""
    import gc
    import weakref

    from torch.utils.checkpoint import checkpoint

    from ds_wallfacer.attention import local
    from ds_wallfacer.attention.residuals import KeepAttention

    seen: list = []
    forward = local._LocalFn.forward

    def recording(ctx, q, k, v, *rest):
        out = forward(ctx, q, k, v, *rest)
        seen.append([weakref.ref(t) for t in (q, k, v, out)])
        return out

    monkeypatch.setattr(local._LocalFn, "forward", staticmethod(recording))
    model = _Model(local.LocalAttention())
    ckpt = KeepAttention(functools.partial(checkpoint, use_reentrant=reentrant))
    x = torch.randn(B, N, E, requires_grad=True)
    gc.collect()
    gc.disable()
    try:
        model(x, ckpt).sum().backward()
        alive = [i for i, refs in enumerate(seen) if any(r() is not None for r in refs)]
    finally:
        gc.enable()
    assert len(seen) == 2 * LAYERS and ckpt.stats.replayed == LAYERS, (len(seen), ckpt.stats)
    assert not alive, f"attention calls {alive} of {len(seen)}: q/k/v/out alive after backward"
