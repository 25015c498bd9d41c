"""Communication config generator (rank layouts, the world layout, process groups) and the counted comm layer.

``layout`` and ``world`` are pure (no torch); ``groups`` and ``ops`` need torch.distributed and are imported on
first use (``ds_wallfacer._lazy``).
"""
from .._lazy import lazy_exports

_EXPORTS = {
    "CommLayer": ".ops", "KINDS": ".ops", "Pending": ".ops",
    "WallFacerGroups": ".groups", "build_groups": ".groups",
    "RankLayout": ".layout", "RankPlace": ".layout", "valid_ring_counts": ".layout",
    "PLACEMENTS": ".world", "WorldLayout": ".world", "ring_offset": ".world",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
