"""``python -m ds_wallfacer.planner``: the topology planner's command line (``cli.py``)."""
import sys

from .cli import main

sys.exit(main())
