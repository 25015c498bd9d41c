"""One configuration the planner considers: mode, sizes, placement and mini-sequence settings."""
from __future__ import annotations

from dataclasses import dataclass

from ..comm.dims import PLACEMENTS, check_placement, check_ulysses_degree, splits_heads
from ..comm.layout import check_ring_count
from ..mst.config import DEFAULT_LOGITS_BUDGET_MIB

__all__ = ["Candidate", "PLACEMENTS", "STRATEGIES", "Workload", "strategy_of"]

STRATEGIES = ("none", "ring", "wallfacer", "ulysses", "hybrid")
"""What a candidate runs across ranks (finer than the config's ``mode``: "ring" is mode "wallfacer" with C = 1,
"none" is P = 1)."""


def strategy_of(sp_size: int, ring_count: int, ulysses_degree: int) -> str:
    """none (P = 1), ring (U = 1, C = 1), wallfacer (U = 1, C > 1), ulysses (U = P), hybrid (1 < U < P)."""
    if sp_size == 1:
        return "none"
    if ulysses_degree == sp_size and sp_size > 1:
        return "ulysses"
    if ulysses_degree > 1:
        return "hybrid"
    return "wallfacer" if ring_count > 1 else "ring"


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
    keep_attention: bool = True
    """With checkpointing: attention's results are kept for the backward (not recomputed)."""
    reentrant: bool = True
    """With checkpointing: DeepSpeed's reentrant checkpointing, which holds the recomputed layer output through the
    layer's backward; False: torch's non-reentrant one, which does not (config ``activation_checkpointing``)."""
    """Decoder-layer activation checkpointing (only each layer's input kept)."""

    def __post_init__(self) -> None:
        p, c, u = self.sp_size, self.ring_count, self.ulysses_degree
        if p < 1:
            raise ValueError(f"sp_size={p} must be >= 1")
        check_ulysses_degree(p, u)
        check_ring_count(p // u, c)
        check_placement(self.placement)

    @property
    def strategy(self) -> str:
        """``STRATEGIES``: none, ring, wallfacer, ulysses or hybrid."""
        return strategy_of(self.sp_size, self.ring_count, self.ulysses_degree)

    @property
    def ring_size(self) -> int:
        """R = P / U: ranks of one WallFacer ring layout."""
        return self.sp_size // self.ulysses_degree

    @property
    def group_size(self) -> int:
        """G = R / C^2: sub-ring length."""
        return self.ring_size // (self.ring_count**2)

    @property
    def label(self) -> str:
        """Short name for tables: ``wallfacer P=64 C=4 [ring-inner] mst ac``."""
        parts = [self.strategy, f"P={self.sp_size}"]
        if self.ring_count > 1:
            parts.append(f"C={self.ring_count}")
        if 1 < self.ulysses_degree:
            parts.append(f"U={self.ulysses_degree}")
        if self.placement != "team-inner" and self.ring_count > 1 and self.group_size > 1:
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
