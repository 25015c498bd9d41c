"""Checkpointed layer inputs parked in host memory (``mini_sequence.offload_checkpoints``) change nothing: on 4 gloo
ranks, with MsT and ZeRO-3, in WallFacer C = 2, ring, Ulysses and the hybrid, under torch's and DeepSpeed's layer
checkpointing, the losses and every parameter after two SGD steps equal the run without offload bitwise; every parked
input came back once for its recompute, and no host buffer is left in use after a step."""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed

from ..integration.models import full_batch
from ..integration.parity import zero_section

CASES = [
    ({"mode": "wallfacer", "ring_count": 2}, "torch"),
    ({"mode": "wallfacer", "ring_count": 1}, "deepspeed"),
    ({"mode": "ulysses"}, "torch"),
    ({"mode": "hybrid", "ulysses_degree": 2}, "deepspeed"),
]


def _run(mode: dict, checkpointing: str, offload: bool) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param

    from ds_wallfacer.integration import initialize
    from ds_wallfacer.mst.offload import OffloadInputs
    from tests.models import tiny_model

    model = tiny_model("llama")
    ms = {"activation_checkpointing": checkpointing, "offload_checkpoints": offload}
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0, "zero_optimization": zero_section(3),
              "zero_allow_untested_optimizer": True, "wallfacer": {**mode, "mini_sequence": ms}}
    engine, sp = initialize(model=model, config=config, optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    funcs = {id(f): f for m in engine.module.modules() if (f := m.__dict__.get("_gradient_checkpointing_func"))}
    offloads = [getattr(f, "inner", None) for f in funcs.values()]
    offloads = [o for o in offloads if isinstance(o, OffloadInputs)]
    losses, stats = [], []
    for step in range(2):
        loss = engine(**sp.shard(full_batch(32, batch_size=1, seed=step)))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        stats.append([dict(vars(o.stats)) for o in offloads])
    params = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return dict(losses=losses, params=params, stats=stats, wrapped=len(offloads))


def _cases(rank: int, world: int) -> list[str]:
    failures = []
    for mode, checkpointing in CASES:
        name = f"{mode} {checkpointing}"
        ref, got = _run(mode, checkpointing, False), _run(mode, checkpointing, True)
        if ref["wrapped"] or got["wrapped"] != 1:
            failures.append(f"{name}: offload wrappers {ref['wrapped']} / {got['wrapped']}")
            continue
        if got["losses"] != ref["losses"]:
            failures.append(f"{name}: losses {got['losses']} != {ref['losses']}")
        bad = [n for n in ref["params"] if not torch.equal(got["params"][n], ref["params"][n])]
        if bad:
            failures.append(f"{name}: parameters {bad[:3]} differ")
        last = got["stats"][-1][0]
        if last["host_bytes"] or last["parked"] != last["fetched"] or not last["parked"]:
            failures.append(f"{name}: offload stats {got['stats']}")
    return failures


def test_offloaded_checkpoints_equal_the_run_without() -> None:
    failures = run_distributed(_cases, 4)
    assert not any(failures), "\n".join(f"rank {r}: {f}" for r, fs in enumerate(failures) for f in fs)


def test_offload_needs_checkpointing() -> None:
    from ds_wallfacer.mst.config import MiniSequenceConfig

    with pytest.raises(ValueError, match="offload_checkpoints = true needs layer checkpointing"):
        MiniSequenceConfig.from_dict({"activation_checkpointing": "none", "offload_checkpoints": True})
