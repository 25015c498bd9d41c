"""Every tensor handed to a collective is on the group's device (Note [Device of collective tensors] in
docs/design/dependencies.md). An NCCL group rejects CPU tensors and gloo accepts anything, so these tests make the comm layer
itself refuse a tensor on another device than its own, on gloo CPU ranks, for every operation."""
from __future__ import annotations

import pytest
import torch

from ds_wallfacer.comm.ops import backend_device_types
from tests.dist_utils import run_distributed


@pytest.mark.parametrize(
    "backend,types",
    [("nccl", {"cuda"}), ("gloo", None), ("mpi", None), ("cpu:gloo,cuda:nccl", {"cpu", "cuda"}), ("NCCL", {"cuda"})],
)
def test_backend_device_types(backend: str, types: set[str] | None) -> None:
    got = backend_device_types(backend)
    assert (None if got is None else set(got)) == types


def _refusals(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    from ds_wallfacer.comm import CommLayer
    from ds_wallfacer.integration.parallel import check_same_batch

    group = dist.new_group(list(range(world)))
    comm = CommLayer(device="cpu")
    meta = torch.empty(4, device="meta")
    other = (rank + 1) % world
    ops = {
        "all_gather": lambda: comm.all_gather(meta, group),
        "reduce_scatter": lambda: comm.reduce_scatter(torch.empty(world, 3, device="meta"), group),
        "all_to_all": lambda: comm.all_to_all(torch.empty(world, 3, device="meta"), group),
        "exchange": lambda: comm.exchange([(meta, other)], [(torch.empty(4), other)], kind="ring", group=group),
    }
    messages = []
    for name, op in ops.items():
        with pytest.raises(ValueError) as err:
            op()
        messages.append(str(err.value))
        assert f"CommLayer.{name}:" in str(err.value) and "on meta" in str(err.value), str(err.value)
    assert comm.sent == {} and comm.calls == {}, "a refused tensor must not reach the backend"
    # nothing was sent: the group is still usable, and host data placed by the layer passes the check
    before = comm.checked
    check_same_batch({"input_ids": torch.arange(8).view(1, 8)}, group=group, comm=comm)
    assert comm.checked == before + 1
    assert comm.all_gather(torch.full((2,), float(rank)), group)[:, 0].tolist() == [float(r) for r in range(world)]
    return messages


def test_comm_layer_refuses_a_tensor_on_another_device() -> None:
    messages = run_distributed(_refusals, 2, timeout_s=120)[0]
    assert "build it with device=" in messages[0] and "gloo group" in messages[0] and "must be on cpu" in messages[0]


def test_an_exchange_is_waited_on_once() -> None:
    from ds_wallfacer.comm import Pending

    pending = Pending(works=[], recvs=[torch.zeros(1)], keep=[])
    assert len(pending.wait()) == 1
    with pytest.raises(RuntimeError, match="called twice"):
        pending.wait()
