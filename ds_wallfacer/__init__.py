"""ds_wallfacer: long-sequence training of HF transformers models with DeepSpeed.

The paper's components, one sub-package each:

- ``comm``       communication config generator (rank layout, process groups) and the counted comm layer
- ``attention``  WallFacer multi-ring attention, Ulysses, the hybrid, and block-attention kernel backends
- ``data``       sequence sharding (zigzag / contiguous), global position ids, shifted labels
- ``mst``        Mini-Sequence Transformer: chunked MLP and LM-head + loss
- ``planner``    topology planner: cost and memory model, configuration search
"""

__version__ = "0.1.0"

__all__ = ["__version__", "initialize"]


def __getattr__(name: str):
    # ``ds_wallfacer.initialize`` without importing DeepSpeed and transformers for users of the core alone.
    if name == "initialize":
        from .integration import initialize

        return initialize
    raise AttributeError(f"module 'ds_wallfacer' has no attribute {name!r}")
