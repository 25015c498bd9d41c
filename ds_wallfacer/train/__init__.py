"""The trainer users run: ``python -m ds_wallfacer.train`` (or ``launch/train.py``) under the ``deepspeed``
launcher. HF model or preset, local data through HF ``datasets``, checkpoints with exact resume, wandb, HF export.
Options: ``python -m ds_wallfacer.train --help``."""
from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the trainer with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    from .quiet import quiet_third_party_deprecations

    quiet_third_party_deprecations()  # before the heavy imports, which raise some
    from .loop import main as _main  # lazy: importing the package stays cheap

    return _main(argv)
