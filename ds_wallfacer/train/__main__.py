"""``python -m ds_wallfacer.train``: see ``ds_wallfacer.train.cli`` for the options."""
import sys

from . import main

sys.exit(main())
