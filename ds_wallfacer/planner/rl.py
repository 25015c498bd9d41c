"""What a GRPO step costs at long context: generation, scoring and training seconds per rank, and memory per rank
with the KV cache (``python -m ds_wallfacer.planner --rl grpo ...``).

A step of TRL's GRPO trainer under sequence parallelism (``hf_trainer/rl.py``) has three phases:

- **Generation**: each rank decodes its share of its group's completions with the model whole (split; or the
  group's whole batch on every rank: redundant, what a group did before the split), with transformers' ``generate``
  (eager kernels, a KV cache of every sequence it decodes) or a vLLM engine on the rank (``vllm_mode="colocate"``;
  CUDA graphs, paged cache). Under ZeRO-3 the weights are gathered whole first (TRL's ``ds3_gather_for_generation``;
  vLLM: pushed into the engine once a step).
- **Scoring**: the log-probabilities of the old policy (where TRL needs them: importance sampling) and of the
  reference (``beta > 0``), each one forward pass over every sequence of the group, sharded over its ranks.
- **Training**: forward and backward of every sequence of the group under sequence parallelism (the planner's step
  estimate, ``cost.estimate``) and one optimizer step.

A decode step is bound by the memory's read rate at long context (the weights and every cached key and value it
attends to); the rates and overheads of each backend (``DECODERS``) are assumptions of the model, named as such in
Note [An RL step] (docs/design/planner.md), which also lists what the memory terms hold.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .cluster import GIB, ClusterSpec
from .cost import forward_s
from .candidate import Workload
from .model import ModelSpec
from .search import Plan, Row, plan

__all__ = ["DECODERS", "Decoder", "RLPhases", "Rollout", "decode_s", "kv_bytes_per_token", "plan_rl", "rl_step"]


@dataclass(frozen=True)
class Decoder:
    """How one generation backend decodes (assumed figures: Note [An RL step])."""

    name: str
    bandwidth_efficiency: float
    """Fraction of the memory's read rate a decode step achieves."""
    ops_per_layer: int
    """Kernel launches per layer per decode step that cost ``op_s`` each (0: replayed as a CUDA graph)."""
    step_overhead_s: float
    """Seconds per decode step outside the layers: sampling, stopping criteria, the Python loop, scheduling."""
    engine_copy: bool
    """Holds its own copy of the weights (a vLLM engine beside the trained model)."""


DECODERS: dict[str, Decoder] = {
    "transformers": Decoder("transformers", bandwidth_efficiency=0.6, ops_per_layer=30, step_overhead_s=2e-3,
                            engine_copy=False),
    "vllm": Decoder("vllm", bandwidth_efficiency=0.8, ops_per_layer=0, step_overhead_s=1e-3, engine_copy=True),
}

_OP_S = 8e-6
"""Seconds of one eager kernel launch on a GPU without a calibration (assumed)."""
_FP32 = 4


@dataclass(frozen=True)
class Rollout:
    """One GRPO step's generation: ``completions`` over all data-parallel replicas (TRL's generation batch)."""

    completions: int
    prompt_len: int
    completion_len: int
    backend: str = "transformers"
    reference: bool = True
    """``beta > 0``: the reference's log-probabilities are scored."""
    old_policy: bool = False
    """The old policy's log-probabilities are scored (importance sampling: TRL does it with vLLM, or when a
    generation round spans several optimizer steps)."""

    def __post_init__(self) -> None:
        for key in ("completions", "prompt_len", "completion_len"):
            if getattr(self, key) < 1:
                raise ValueError(f"rollout {key}={getattr(self, key)} must be >= 1")
        if self.backend not in DECODERS:
            raise ValueError(f"generation backend {self.backend!r}: expected one of {sorted(DECODERS)}")

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.completion_len


@dataclass(frozen=True)
class RLPhases:
    """Predicted figures of one GRPO step on one rank (seconds, bytes)."""

    backend: str
    split: bool
    sequences_per_rank: int
    """Completions this rank decodes."""
    generation_s: float
    weights_s: float
    """Gathering the whole weights for generation (ZeRO-3), or pushing them into the engine."""
    scoring_policy_s: float
    scoring_reference_s: float
    training_s: float
    kv_cache_bytes: float
    generation_bytes: float
    """Memory at the end of generation: model states, the whole weights, the KV cache, the logits."""
    training_bytes: float
    usable_bytes: float

    @property
    def step_s(self) -> float:
        return (self.generation_s + self.weights_s + self.scoring_policy_s + self.scoring_reference_s
                + self.training_s)

    @property
    def fits(self) -> bool:
        return max(self.generation_bytes, self.training_bytes) <= self.usable_bytes

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"step_s": self.step_s, "fits": self.fits}


def kv_bytes_per_token(model: ModelSpec, elem_bytes: int = 2) -> int:
    """Bytes of cached keys and values per token, all layers (Llama-3-8B in bf16: 128 KiB)."""
    return model.layers * model.kv_heads * (model.head_dim + model.value_head_dim) * elem_bytes


def decode_s(model: ModelSpec, cluster: ClusterSpec, decoder: Decoder, *, sequences: int, prompt_len: int,
             completion_len: int, elem_bytes: int = 2) -> float:
    """Seconds to generate ``completion_len`` tokens for each of ``sequences`` prompts of ``prompt_len`` tokens on
    one rank: the prefill (arithmetic) and every decode step (Note [An RL step]), summed in slices of steps."""
    cal = cluster.calibration
    rate = (cal.mem_bw if cal is not None and cal.mem_bw else cluster.mem_bw) * decoder.bandwidth_efficiency
    if rate <= 0:
        raise ValueError(f"cluster {cluster.name!r} has no memory read rate (mem_bw): give it, or calibrate")
    flops = cluster.flops * cluster.mfu
    op_s = cal.op_s if cal is not None else _OP_S
    matmul = 2.0 * (model.params - model.vocab * model.hidden * (0 if model.tied_embeddings else 1))
    attn_per_ctx = 2.0 * model.layers * model.heads * (model.head_dim + model.value_head_dim)  # per query, key
    weights, kv = elem_bytes * model.params, kv_bytes_per_token(model, elem_bytes)
    overhead = model.layers * decoder.ops_per_layer * op_s + decoder.step_overhead_s
    prefill = sequences * prompt_len * (matmul + attn_per_ctx * prompt_len / 2) / flops
    total, step, piece = prefill, 0, max(1, completion_len // 256)
    while step < completion_len:
        n = min(piece, completion_len - step)
        ctx = prompt_len + step + (n + 1) / 2  # step t attends to prompt + t + 1 keys: the slice's mean
        read = weights + sequences * ctx * kv
        work = sequences * (matmul + attn_per_ctx * ctx)
        total += n * (max(read / rate, work / flops) + overhead)
        step += n
    return total


def rl_step(model: ModelSpec, cluster: ClusterSpec, rollout: Rollout, row: Row, workload: Workload, *, split: bool
            ) -> RLPhases:
    """One GRPO step of ``rollout`` when training runs as ``row``, a ``plan`` row for ``workload`` (one sequence of
    ``rollout.seq_len`` tokens per micro-batch); ``split``: each rank decodes its share of its group's completions
    (else the group's all)."""
    decoder, cand, mem = DECODERS[rollout.backend], row.candidate, row.memory
    if workload.seq_len != rollout.seq_len or workload.batch != 1:
        raise ValueError(f"rl_step: the training row is planned for {workload.batch} x {workload.seq_len} tokens, "
                         f"the rollout's sequences are 1 x {rollout.seq_len}")
    elem_bytes = workload.elem_bytes
    group = -(-rollout.completions // (cluster.world_size // cand.sp_size))  # completions one group trains on
    sequences = -(-group // cand.sp_size) if split else group
    gen = decode_s(model, cluster, decoder, sequences=sequences, prompt_len=rollout.prompt_len,
                   completion_len=rollout.completion_len, elem_bytes=elem_bytes)
    zero3 = workload.zero_stage == 3  # the weights are partitioned: gathered whole to generate
    whole = elem_bytes * model.params
    world = cluster.world_size
    weights_s = (whole * (world - 1) / world / cluster.intra_bw) if (zero3 or decoder.engine_copy) else 0.0
    fwd = forward_s(model, cluster, cand, workload)
    train = group * (row.cost.step_s - row.cost.optimizer_s) + row.cost.optimizer_s
    kv_cache = sequences * rollout.seq_len * kv_bytes_per_token(model, elem_bytes)
    extra_weights = whole if (zero3 or decoder.engine_copy) else 0.0
    states = mem.weights + mem.grads + mem.optimizer
    generation = states + extra_weights + kv_cache + sequences * model.vocab * _FP32
    return RLPhases(
        backend=decoder.name, split=split, sequences_per_rank=sequences, generation_s=gen, weights_s=weights_s,
        scoring_policy_s=group * fwd if rollout.old_policy else 0.0,
        scoring_reference_s=group * fwd if rollout.reference else 0.0, training_s=train,
        kv_cache_bytes=kv_cache, generation_bytes=generation, training_bytes=mem.total, usable_bytes=mem.usable,
    )


def plan_rl(cluster: ClusterSpec, model: ModelSpec, rollout: Rollout, *, fixed: dict[str, Any], workload: Workload
            ) -> tuple[Plan, list[RLPhases]]:
    """The training plan at the rollout's sequence length (``plan``'s choice) and the step's phases under it,
    split and (with transformers) redundant: raises ``PlanError`` where no training configuration fits."""
    pl = plan(cluster, model, rollout.seq_len, fixed=fixed, workload=workload)
    row = next(r for r in pl.rows if r.candidate == pl.choice.candidate)
    splits = (True, False) if rollout.backend == "transformers" else (True,)
    return pl, [rl_step(model, cluster, rollout, row, workload, split=s) for s in splits]


def describe(phases: RLPhases) -> str:
    """One line for logs: where the time goes and whether it fits."""
    return (f"{phases.backend} {'split' if phases.split else 'redundant'}: {phases.step_s:.1f} s "
            f"(generation {phases.generation_s:.1f}), KV cache {phases.kv_cache_bytes / GIB:.1f} GiB/rank, "
            f"{'fits' if phases.fits else 'out of memory'}")
