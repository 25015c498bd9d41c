"""``initialize`` gives every process group the configured ``collective_timeout_s``: the world group (when it
initialises torch.distributed itself), DeepSpeed's data-parallel group (its clone of the world group, which would
otherwise get torch's 30-minute gloo default) and the sequence-parallel groups. 2 gloo ranks, real DeepSpeed."""
from __future__ import annotations

import os

import torch

from tests.dist_utils import free_port, run_distributed


def _timeout(group) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def _timeouts(rank: int, world: int, port: int) -> dict[str, float]:
    import torch.distributed as dist

    from ds_wallfacer.integration import initialize

    from .models import tiny_model

    # start from an uninitialised process, as under the deepspeed launcher
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "wallfacer": {"mode": "ulysses", "collective_timeout_s": 577}}
    engine, sp = initialize(model=tiny_model("llama"), config=cfg)
    out = {"world": _timeout(dist.group.WORLD), "deepspeed data parallel": _timeout(engine.data_parallel_group),
           "sequence parallel": _timeout(sp.groups.sp_group), "ulysses": _timeout(sp.groups.ulysses_group)}
    engine.destroy()
    return out


def test_every_group_gets_the_configured_timeout() -> None:
    for rank, got in enumerate(run_distributed(_timeouts, 2, free_port(), timeout_s=180)):
        assert got == dict.fromkeys(got, 577.0) and len(got) == 4, (rank, got)
