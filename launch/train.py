"""Train an HF causal LM (default: a tiny Llama on the bundled text) with sequence parallelism via DeepSpeed.

    deepspeed --num_gpus 4 launch/train.py --deepspeed_config ds_configs/main.json --seq_len 512

A thin wrapper around ``python -m ds_wallfacer.train`` (options: ``--help``). Runs on CPU ranks (gloo) where
there is no GPU. The last line printed is a JSON summary.
"""
from __future__ import annotations

import sys

from ds_wallfacer.train import main

if __name__ == "__main__":
    sys.exit(main())
