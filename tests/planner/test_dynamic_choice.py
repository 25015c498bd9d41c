"""Dynamic sequence parallelism's choice as the loader receives it: ``row_model`` built from a ds_config, and
``RowSizeChooser`` (the run's ``SizeChooser``) answering what ``choose_sizes`` answers. Pure, without processes."""
from __future__ import annotations

from ds_wallfacer.comm.dims import ParallelDims, dynamic_sizes
from ds_wallfacer.config import parse_ds_config
from ds_wallfacer.planner import get_model
from ds_wallfacer.planner.dynamic import RowSizeChooser, SizeChooser, choose_sizes, row_model


def test_the_runs_chooser_is_choose_sizes_over_its_row_model() -> None:
    spec = get_model("llama3-8b")
    run = parse_ds_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                           "wallfacer": {"sequence_parallel_size": 64, "cluster": "h100x64",
                                         "dynamic_sequence_parallel": {"max_tokens_per_rank": 1024}}})
    dims = ParallelDims(64, 64, num_heads=spec.heads, num_kv_heads=spec.kv_heads)
    rows = row_model(spec, run, sizes=dynamic_sizes(dims), dims=dims, layer_checkpointing=False)
    assert rows.sizes == tuple(dynamic_sizes(dims)) and rows.max_tokens_per_rank == 1024
    assert rows.workload.zero_stage == 3
    choose: SizeChooser = RowSizeChooser(rows, world_size=64, sp_size=64)
    lengths = [512] * 30 + [4096, 16384]
    works = [n * (n + 1) // 2 for n in lengths]
    got = choose(lengths, works)
    assert got == choose_sizes(lengths, works, model=rows, world_size=64, sp_size=64)
    assert got[0] == 1 and got[-2] >= 4 and got[-1] >= 16  # each row on a group whose ranks hold <= 1024 tokens
