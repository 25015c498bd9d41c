"""Configuration: the ds_config ``"wallfacer"`` section parsed once into frozen dataclasses and validated. Pure
Python: no torch import. "auto" values are resolved by ``planner.auto``."""
from .schema import MODES, PLACEMENTS, SHARDINGS, RunConfig, WallFacerConfig, parse_ds_config

__all__ = ["MODES", "PLACEMENTS", "SHARDINGS", "RunConfig", "WallFacerConfig", "parse_ds_config"]
