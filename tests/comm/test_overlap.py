"""Forced-serial communication (``CommLayer.serial``) changes neither results nor bytes, and the blocked-time
accounting (``CommLayer.blocked_s``) records every kind that was sent (Note [Measuring overlap] in
docs/design/dependencies.md). ``benchmarks/bench_overlap.py`` relies on both: it compares the times of the two modes as the same
computation. Which transfers no compute overlaps, per mode, is asserted from the recorded schedule (Note [Which
transfers are exposed]). No assertion here is about time."""
from __future__ import annotations

import torch

from tests.dist_utils import run_distributed

SEQ_PER_RANK = 16


def _run(rank: int, world: int) -> list[dict]:
    from ds_wallfacer.attention import WallFacerAttention
    from ds_wallfacer.comm import CommLayer, RankLayout, build_groups
    from ds_wallfacer.data import shard_sequence

    gen = torch.Generator().manual_seed(0)
    n = SEQ_PER_RANK * world
    q, do = (torch.randn(2, 8, n, 32, generator=gen) for _ in range(2))
    k, v = (torch.randn(2, 2, n, 32, generator=gen) for _ in range(2))
    sh = lambda x: shard_sequence(x, dim=2, index=rank, sp_size=world, scheme="zigzag")  # noqa: E731
    results = []
    for c in (1, 2):
        groups = build_groups([RankLayout(tuple(range(world)), c)])
        runs = {}
        for serial in (False, True, False):  # overlapped, serial, overlapped again after switching back
            comm = CommLayer(device="cpu")
            comm.serial = serial
            attn = WallFacerAttention(groups, comm=comm, kernel="cpu_flash")
            ql, kl, vl = (sh(x).requires_grad_() for x in (q, k, v))
            out = attn(ql, kl, vl, causal=True)
            out.backward(sh(do))
            runs.setdefault(serial, []).append(dict(
                tensors=[t.detach().clone() for t in (out, ql.grad, kl.grad, vl.grad)],
                sent=dict(comm.sent), calls=dict(comm.calls), blocked=dict(comm.blocked_s),
            ))
        results.append(dict(c=c, overlapped=runs[False], serial=runs[True][0]))
    return results


def test_serial_communication_is_bitwise_identical_and_sends_the_same_bytes() -> None:
    for rank, per_rank in enumerate(run_distributed(_run, 4, timeout_s=240)):
        for res in per_rank:
            label = f"rank {rank} C={res['c']}"
            ref, again = res["overlapped"]
            for run in (res["serial"], again):
                for name, a, b in zip(("out", "dq", "dk", "dv"), ref["tensors"], run["tensors"]):
                    assert torch.equal(a, b), f"{label}: {name} differs between overlapped and serial communication"
                assert run["sent"] == ref["sent"], f"{label}: bytes {run['sent']} != {ref['sent']}"
                assert run["calls"] == ref["calls"], f"{label}: calls {run['calls']} != {ref['calls']}"
            for run in (ref, res["serial"]):
                # every (phase, kind) that moved bytes was timed, and nothing else was
                sent_keys = {key for key, b in run["sent"].items() if b > 0}
                assert set(run["blocked"]) == sent_keys, f"{label}: blocked {run['blocked']} vs sent {run['sent']}"
                assert all(s >= 0 for s in run["blocked"].values())
            # P = 4: ring attention hops k/v along the ring; C = 2 has one ring step (G = 1), all skewed p2p
            kind = "ring" if res["c"] == 1 else "skew"
            assert ("forward", kind) in ref["sent"] and ("backward", kind) in ref["sent"], label


def test_reset_clears_the_blocked_time() -> None:
    from ds_wallfacer.comm import CommLayer

    comm = CommLayer()
    comm.blocked_s[("forward", "ring")] += 1.0
    comm.sent[("forward", "ring")] += 8
    assert comm.blocked_by_kind("forward")["ring"] == 1.0 and comm.blocked_by_kind("backward")["ring"] == 0.0
    comm.reset()
    assert comm.blocked_s == {} and comm.sent == {} and not comm.serial


def _exposure(rank: int, world: int) -> dict:
    """Per case: the exposed transfers of one causal forward + backward (``comm.exposed``), how many were hidden, and
    this rank's team position. Cases: ring and WallFacer C = 2 over all 8 ranks (G = 2), C = 2 over two groups of
    4 (G = 1: no ring step, only team exchanges), serial ring, and the hybrid (U = 2 around C = 2, G = 1)."""
    from ds_wallfacer.attention import WallFacerAttention
    from ds_wallfacer.comm import CommLayer, RankLayout, build_groups, exposed
    from ds_wallfacer.data import shard_sequence

    gen = torch.Generator().manual_seed(0)
    out = {}
    for name, c, p, serial in (("ring", 1, world, False), ("C2G2", 2, world, False), ("C2G1", 2, 4, False),
                               ("serial ring", 1, world, True)):
        layouts = [RankLayout(tuple(range(i, i + p)), c) for i in range(0, world, p)]
        groups = build_groups(layouts)
        n = SEQ_PER_RANK * p
        q, do = (torch.randn(1, 4, n, 16, generator=gen) for _ in range(2))
        k, v = (torch.randn(1, 2, n, 16, generator=gen) for _ in range(2))
        sh = lambda x: shard_sequence(x, dim=2, index=rank % p, sp_size=p, scheme="zigzag")  # noqa: E731
        comm = CommLayer(device="cpu", serial=serial)
        attn = WallFacerAttention(groups, comm=comm, kernel="cpu_flash")
        ql, kl, vl = (sh(x).requires_grad_() for x in (q, k, v))
        with comm.recording() as timeline:
            attn(ql, kl, vl, causal=True).backward(sh(do))
        out[name] = (exposed(timeline), sum(r.hidden for r in timeline), groups.place.local)
    # the hybrid: Ulysses U = 2 around WallFacer C = 2 over R = 4 ring ranks (G = 1)
    from ds_wallfacer.comm.dims import ParallelDims
    from ds_wallfacer.data import shard_sequence
    from ds_wallfacer.integration.parallel import attention_for, build_sequence_parallel
    from ds_wallfacer.planner.auto import ParallelSetup

    dims = ParallelDims(world_size=world, sp_size=world, mode="hybrid", ulysses_degree=2, ring_count=2, num_heads=4,
                        num_kv_heads=2)
    groups = build_sequence_parallel(ParallelSetup(dims))
    comm = CommLayer(device="cpu")
    attn = attention_for(groups, comm=comm)
    n = SEQ_PER_RANK * world
    q, do = (torch.randn(1, 4, n, 16, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, 2, n, 16, generator=gen) for _ in range(2))
    sh = lambda x: shard_sequence(x, dim=2, index=groups.shard_index, sp_size=world, ulysses_degree=2,  # noqa: E731
                                  scheme="zigzag")
    ql, kl, vl = (sh(x).requires_grad_() for x in (q, k, v))
    attn(ql, kl, vl, causal=True)  # the input check's one-time all-gather, outside the recording
    with comm.recording() as timeline:
        attn(ql, kl, vl, causal=True).backward(sh(do))
    out["hybrid"] = (exposed(timeline), sum(r.hidden for r in timeline), groups.wallfacer.place.local)
    return out


def test_only_the_transfers_the_schedule_cannot_hide_are_exposed() -> None:
    """P = 8 (and two groups of 4). Ring (C = 1): every k/v hop and dk/dv hop is waited on after a block's compute;
    only the dk/dv sent home after the last step has nothing left to hide behind. WallFacer C = 2, with ring steps
    (G = 2) or without (G = 1): the team's shards arrive one round each and a call waits only for its own two, the
    finished rows of the other members are sent while this rank's own are computed (Note [Pipelined team
    exchanges]). Exposed are what the design cannot hide: the home send, and on a rank whose first k/v block is
    another team's (local != 0) the first k/v piece of the forward and of the backward, as nothing can be computed
    before it. The hybrid's Ulysses all-to-alls are blocking (one each way in each phase); its WallFacer exposes what
    WallFacer alone does. Serial communication exposes everything (the recording can tell the two apart)."""
    fwd, bwd = "forward", "backward"
    for rank, res in enumerate(run_distributed(_exposure, 8, timeout_s=300)):
        assert res["ring"][0] == [(bwd, "skew")], f"rank {rank} ring: exposed {res['ring'][0]}"
        for name in ("C2G2", "C2G1"):
            kinds, hidden, local = res[name]
            first = [] if local == 0 else [(fwd, "skew")]
            want = first + ([] if local == 0 else [(bwd, "skew")]) + [(bwd, "skew")]
            assert kinds == want, f"rank {rank} {name} (local {local}): exposed {kinds}, expected {want}"
            assert hidden > 0, f"rank {rank} {name}: nothing recorded as hidden"
        # the hybrid's all-to-alls are blocking; inside them its WallFacer hides what WallFacer alone does
        kinds, hidden, local = res["hybrid"]
        first = [] if local == 0 else [(fwd, "skew")]
        a2a_f, a2a_b = (fwd, "all_to_all"), (bwd, "all_to_all")
        want = [a2a_f, *first, a2a_f, a2a_b, *([] if local == 0 else [(bwd, "skew")]), (bwd, "skew"), a2a_b]
        assert kinds == want, f"rank {rank} hybrid (local {local}): exposed {kinds}, expected {want}"
        assert hidden > 0, f"rank {rank} hybrid: nothing recorded as hidden"
        serial_exposed, serial_hidden, _ = res["serial ring"]
        assert serial_hidden == 0 and len(serial_exposed) == len(res["ring"][0]) + res["ring"][1], rank
