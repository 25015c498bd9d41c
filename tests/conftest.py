"""Before any test module: one thread per process (the ranks of ``dist_utils.run_distributed`` are forked from
this process, and a forked OpenMP pool deadlocks), and the heavy imports done once, so forked ranks share them."""
import os

os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402

torch.set_num_threads(1)

import deepspeed  # noqa: E402,F401
import transformers  # noqa: E402,F401

import ds_wallfacer.integration  # noqa: E402,F401
