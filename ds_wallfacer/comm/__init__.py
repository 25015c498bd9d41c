"""Communication config generator (rank layout, process groups) and the counted comm layer."""
from .groups import WallFacerGroups, build_groups
from .layout import RankLayout, RankPlace, valid_ring_counts
from .ops import KINDS, CommLayer

__all__ = ["CommLayer", "KINDS", "RankLayout", "RankPlace", "WallFacerGroups", "build_groups", "valid_ring_counts"]
