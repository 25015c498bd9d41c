"""Communication config generator (the parallel sizes and rank arithmetic, WallFacer rank layouts, process groups)
and the counted comm layer.

``dims`` and ``layout`` are pure (no torch); ``groups`` and ``ops`` need torch.distributed and are imported on
first use (``ds_wallfacer._lazy``).
"""
from .._lazy import lazy_exports

_EXPORTS = {
    "CommLayer": ".ops", "KINDS": ".ops", "OpRecord": ".ops", "Pending": ".ops", "exposed": ".ops",
    "exposed_share": ".ops",
    "WallFacerGroups": ".groups", "build_groups": ".groups",
    "RankLayout": ".layout", "RankPlace": ".layout", "check_ring_count": ".layout", "valid_ring_counts": ".layout",
    "MODES": ".dims", "Mode": ".dims", "PLACEMENTS": ".dims", "ParallelDims": ".dims", "STRATEGIES": ".dims",
    "Strategy": ".dims", "divisors": ".dims", "ring_offset": ".dims", "valid_ulysses_degrees": ".dims",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
