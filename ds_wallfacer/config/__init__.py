"""Configuration: the ds_config ``"wallfacer"`` section parsed once into frozen dataclasses, and the resolved,
validated parallel layout. Pure Python: no torch import."""
from .resolve import ParallelLayout, PlanInputs, resolve_auto, valid_ulysses_degrees
from .schema import MODES, PLACEMENTS, SHARDINGS, RunConfig, WallFacerConfig, parse_ds_config

__all__ = [
    "MODES",
    "PLACEMENTS",
    "SHARDINGS",
    "ParallelLayout",
    "PlanInputs",
    "RunConfig",
    "WallFacerConfig",
    "parse_ds_config",
    "resolve_auto",
    "valid_ulysses_degrees",
]
