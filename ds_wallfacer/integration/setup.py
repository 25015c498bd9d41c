"""The setup of a run, resolved from the ds_config and the model: the first steps of ``prepare_sequence_parallel``
(Note [What initialize does, in order] in docs/design/audit.md).

``resolve_setup`` is pure and identical on every rank (the model's heads, the planner for "auto" values), so a bad
config fails everywhere at once; ``check_setup_agrees`` is the one collective before any group is built.
"""
from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
from torch import nn

from ..adapters.mixer_layers import mixer_head_counts, mixer_layers
from ..audit.model_audit import RefusedModel, reentrant_checkpointing
from ..comm import CommLayer
from ..comm.dims import MODES, PLACEMENTS
from ..config import RunConfig
from ..hf_config import text_config
from ..planner.auto import ParallelSetup, PlanInputs, resolve_auto
from ..planner.cluster import cluster_preset

__all__ = ["check_setup_agrees", "model_heads", "resolve_setup"]

log = logging.getLogger("ds_wallfacer")


def model_heads(model: nn.Module) -> tuple[int, int]:
    """(query heads, kv heads) from an HF model's (text) config; for a model without attention (a pure state-space
    model), the heads its mixer layers split over the ranks."""
    text = text_config(model)
    if not isinstance(getattr(text, "num_attention_heads", None), int):
        heads = {int(getattr(m, "num_heads", 0)) for _, m in mixer_layers(model)}
        if heads and all(heads):
            h = math.gcd(*heads)
            return h, h
        raise RefusedModel(f"{type(model).__name__}: its (text) config has no num_attention_heads, so its attention "
                           "cannot be split across ranks: not supported yet")
    hq = int(text.num_attention_heads)
    hk = int(getattr(text, "num_key_value_heads", None) or hq)
    return hq, hk


def _plan_inputs(model: nn.Module, run: RunConfig, seq_len: int | None) -> PlanInputs:
    heads, groups = mixer_head_counts(model)
    return PlanInputs(
        model=text_config(model),
        seq_len=seq_len,
        run=run,
        activation_checkpointing=bool(getattr(model, "is_activation_checkpointing", False)),
        reentrant_checkpointing=reentrant_checkpointing(model),
        default_cluster=cluster_preset(),
        whole_heads=heads,
        head_groups=groups,
    )


def resolve_setup(
    model: nn.Module, run: RunConfig, *, ranks_per_node: int | None, seq_len: int | None
) -> ParallelSetup:
    """The validated setup ("auto" by the planner when a length is known); rank 0 logs it and the reasons."""
    hq, hk = model_heads(model)
    setup = resolve_auto(run.wallfacer, world_size=dist.get_world_size(), num_heads=hq, num_kv_heads=hk,
                         ranks_per_node=ranks_per_node, planner_inputs=_plan_inputs(model, run, seq_len))
    if dist.get_rank() == 0:
        log.warning("%s", setup.describe())
    return setup


def check_setup_agrees(setup: ParallelSetup, device: torch.device) -> None:
    """Every rank chose the same sizes, placement and mode. "auto" plans from this host's measured speeds
    (``planner/calibrate.py``, cached per host), so hosts that measured differently could choose differently:
    refused here, with the fix, before any group is built. One all-gather over the world (none on one rank)."""
    if dist.get_world_size() == 1:
        return
    d = setup.dims
    sig = torch.tensor([d.sp_size, d.ulysses_degree, d.ring_count, PLACEMENTS.index(d.placement), MODES.index(d.mode)],
                       dtype=torch.int64, device=device)
    every = CommLayer(device=device).all_gather(sig, dist.group.WORLD, kind="check").tolist()
    differ = [r for r, s in enumerate(every) if s != every[0]]
    if differ:
        raise ValueError(
            f"ds_wallfacer: ranks {differ} chose another parallel layout than rank 0 (sequence_parallel_size, "
            f"ulysses_degree, ring_count, placement, mode by rank: {every}). \"auto\" plans from each host's measured "
            f"speeds; set those keys in the \"wallfacer\" section, or give every host the same calibration "
            f"(DS_WALLFACER_CACHE_DIR on shared storage, or DS_WALLFACER_CALIBRATION=off)"
        )
