"""Before any test module: one thread per process (the ranks of ``dist_utils.run_distributed`` are forked from
this process, and a forked OpenMP pool deadlocks), MKL's alignment-independent kernels (Note [Bitwise on CPU needs
MKL_CBWR] in docs/design/training.md: the resume tests compare a resumed process's losses bit for bit), and the heavy
imports done once, so forked ranks share them."""
import os

os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")  # before torch loads MKL; launched jobs inherit it

import torch  # noqa: E402

torch.set_num_threads(1)

import deepspeed  # noqa: E402,F401
import transformers  # noqa: E402,F401

import ds_wallfacer.integration  # noqa: E402,F401
