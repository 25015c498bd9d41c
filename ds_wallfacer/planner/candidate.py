"""One configuration the planner considers: mode, sizes, placement and mini-sequence settings."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..comm.dims import PLACEMENTS, STRATEGIES, ParallelDims, Strategy, splits_heads
from ..mst.config import DEFAULT_LOGITS_BUDGET_MIB

__all__ = ["Candidate", "PLACEMENTS", "STRATEGIES", "Strategy", "Workload"]


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """Sequence parallelism of one SP group of ``sp_size`` ranks (the rest of the world is data parallel)."""

    sp_size: int
    """P: ranks that share one sequence."""
    ring_count: int = 1
    """C: WallFacer team size over the R = P / U ring ranks (C * C divides R); 1 = plain ring."""
    ulysses_degree: int = 1
    """U: Ulysses all-to-all degree (inner, over heads); P = Ulysses alone, 1 = none."""
    placement: str = "team-inner"
    mini_sequence: bool = True
    """MsT on: MLP and LM head in mini-sequences."""
    mlp_chunk_tokens: int = 0
    """Tokens per MLP mini-sequence (0 when MsT is off)."""
    lm_head_chunk_tokens: int = 0
    """Tokens per LM-head mini-sequence (0 when MsT is off)."""
    checkpointing: bool = True
    """Decoder-layer activation checkpointing (only each layer's input kept)."""
    keep_attention: bool = True
    """With checkpointing: attention's results are kept for the backward (not recomputed)."""
    reentrant: bool = True
    """With checkpointing: DeepSpeed's reentrant checkpointing, which holds the recomputed layer output through the
    layer's backward; False: torch's non-reentrant one, which does not (config ``activation_checkpointing``)."""
    dims: ParallelDims = field(init=False, repr=False, compare=False)
    """The sizes over one SP group (W = P), validated by ``ParallelDims``: R, G, the strategy and the rank order
    are read from it, not re-derived here."""

    def __post_init__(self) -> None:
        if self.sp_size < 1:
            raise ValueError(f"sp_size={self.sp_size} must be >= 1")
        object.__setattr__(self, "dims", ParallelDims(
            world_size=self.sp_size, sp_size=self.sp_size, ulysses_degree=self.ulysses_degree,
            ring_count=self.ring_count, placement=self.placement))

    @property
    def strategy(self) -> Strategy:
        """none, ring, wallfacer, ulysses or hybrid (``ParallelDims.strategy``)."""
        return self.dims.strategy

    @property
    def ring_size(self) -> int:
        """R = P / U: ranks of one WallFacer ring layout."""
        return self.dims.ring_size

    @property
    def group_size(self) -> int:
        """G = R / C^2: sub-ring length."""
        return self.dims.group_size

    @property
    def label(self) -> str:
        """Short name for tables: ``wallfacer P=64 C=4 [ring-inner] mst ac``."""
        parts = [self.strategy, f"P={self.sp_size}"]
        if self.ring_count > 1:
            parts.append(f"C={self.ring_count}")
        if 1 < self.ulysses_degree:
            parts.append(f"U={self.ulysses_degree}")
        if self.placement != "team-inner" and self.dims.placement_matters:
            parts.append(f"[{self.placement}]")
        parts.append("mst" if self.mini_sequence else "no-mst")
        if self.checkpointing:
            parts.append("ac" + ("" if self.reentrant else "-torch") + ("" if self.keep_attention else "-recompute"))
        else:
            parts.append("no-ac")
        return " ".join(parts)


@dataclass(frozen=True)
class Workload:
    """What is trained, and the runtime assumptions shared by every candidate."""

    seq_len: int
    """N: tokens of one sequence (all sequence-parallel ranks together)."""
    batch: int = 1
    """Sequences per SP group per micro-step."""
    elem_bytes: int = 2
    """bf16 activations and weights."""
    zero_stage: int = 3
    offload_optimizer: bool = False
    """ZeRO optimizer state (and fp32 master weights) on the CPU."""
    offload_checkpoints: bool = False
    """Checkpointed layer inputs on the CPU (DeepSpeed ``cpu_checkpointing``)."""
    offload_params: bool = False
    """ZeRO-3 parameters on the CPU (``zero_optimization.offload_param``)."""

    kv_replication: bool = True
    """Allow a Ulysses degree above the kv-head count by replicating kv heads (U a multiple of kv heads)."""
    overlap: bool = True
    """Ring hops overlap block attention (double buffering) and ZeRO traffic overlaps backward."""
    lm_head_budget_mib: int = DEFAULT_LOGITS_BUDGET_MIB
    """MsT "auto" LM-head rule: one mini-sequence's fp32 logits within this budget."""
    mem_headroom: float = 0.1
    """Fraction of the device memory kept free for fragmentation."""
    whole_heads: tuple[int, ...] = ()
    """Head counts of layers that scan whole heads on each rank (gated delta-nets, Mamba-2 mixers): P must divide
    each."""
    head_groups: tuple[int, ...] = ()
    """Group counts of Mamba-2 mixers: each must divide P or be divisible by it."""

    def splits_heads(self, p: int) -> bool:
        """Whether P ranks can each scan whole heads of every such layer (``comm.dims.splits_heads``)."""
        return splits_heads(p, self.whole_heads, self.head_groups)

    def __post_init__(self) -> None:
        if self.seq_len < 1 or self.batch < 1:
            raise ValueError(f"seq_len={self.seq_len} and batch={self.batch} must be >= 1")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={self.zero_stage!r}; expected 0, 1, 2 or 3")
        if self.offload_params and self.zero_stage != 3:
            raise ValueError("offload_params needs ZeRO stage 3 (DeepSpeed offloads parameters only there)")
        if not 0 <= self.mem_headroom < 1:
            raise ValueError(f"mem_headroom={self.mem_headroom!r} must be in [0, 1)")
