"""Model-family adapters: what makes transformers' own layers run on sequence shards. The attention interface
(``hf.py``, ``attn_implementation="wallfacer"``), rotary embeddings that read the length (``rope.py``), router aux
losses (``moe.py``), positions inside attention (``positional.py``) and the sequence mixers other than attention,
recognised by what they are built from and given a sharded forward (``mixer_layers.py``, over ``short_convs.py``,
``delta_nets.py``, ``mamba_mixers.py`` and ``mixer_shards.py``). Used by ``integration`` (the entry point) and
``audit`` (the start-up checks); imports neither."""
