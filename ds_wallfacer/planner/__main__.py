"""``python -m ds_wallfacer.planner``: the same command line as ``python -m ds_wallfacer.plan``."""
import sys

from .cli import main

sys.exit(main())
