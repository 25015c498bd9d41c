"""``python -m ds_wallfacer.plan``: the topology planner's command line (``ds_wallfacer/planner/cli.py``)."""
import sys

from .planner.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
