"""Entry point of the trainer: parse the options, then ``Trainer`` (``trainer.py``) builds, resumes, trains and
finishes; a start-up refusal becomes one line and exit status 2."""
from __future__ import annotations

import os
import sys
from typing import Any

from ..integration.ds_runtime import close_distributed
from .cli import StartupError, parse_args
from .nonfinite import NONFINITE_EXIT_CODE, NonFiniteStop
from .trainer import Trainer

__all__ = ["main", "run"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m ds_wallfacer.train`` and ``launch/train.py``: 0 on success, 2 on a refusal; the
    process groups are destroyed before it returns (except after Ctrl-C)."""
    try:
        code = run(parse_args(argv))
    except StartupError as e:
        # the same refusal on every rank (each found it itself): one line per node, not one per rank
        if os.environ.get("LOCAL_RANK", "0") in ("0", "-1"):
            print(f"ds_wallfacer.train: error: {e}", file=sys.stderr, flush=True)
        code = 2
    except KeyboardInterrupt:  # Ctrl-C before the watchdog handles it: one line per rank, not a traceback
        print(f"ds_wallfacer.train: rank {os.environ.get('RANK', '?')}: interrupted", file=sys.stderr, flush=True)
        return 130
    # Note [A clean exit] (docs/trainer.md): after a refusal too, which every rank reached by itself, so no peer
    # is left inside a collective; after training it was done by Trainer.close and this does nothing
    close_distributed()
    return code


def run(args: Any) -> int:
    """Train (or only export, ``--export_only``) as ``args`` say; 0 when done, ``PREEMPTED_EXIT_CODE`` after a
    preemption's save, ``NONFINITE_EXIT_CODE`` after non-finite steps. Refusals raise ``StartupError``."""
    trainer = Trainer(args)
    trainer.build()
    trainer.resume()
    if args.export_only:
        return trainer.export_only()
    trainer.start()
    try:
        trainer.train()
    except NonFiniteStop as e:  # every rank found it at the same step: one line from rank 0
        trainer.settle_save(wait=True)  # a save still being written is marked complete first
        trainer.close()
        if trainer.rank == 0:
            print(f"ds_wallfacer.train: error: {e}", file=sys.stderr, flush=True)
        return NONFINITE_EXIT_CODE
    if trainer.stopped:
        return trainer.stop()
    trainer.finish()
    return 0
