"""Two "nodes" of 2 ranks on this one machine over loopback: two ``deepspeed`` launcher invocations with a
two-host hostfile, ``--no_ssh --node_rank 0/1 --master_addr 127.0.0.1``, training the hybrid (Ulysses degree
"auto") with the watchdog on. The launch shape reaches the layout (2 nodes x 2 ranks), the Ulysses groups stay
inside a node, and training finishes with a finite loss on both nodes."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ds_wallfacer.comm.dims import ParallelDims
from tests.dist_utils import free_port
from tests.train.jobs import DEEPSPEED, Job

pytestmark = pytest.mark.skipif(DEEPSPEED is None, reason="the deepspeed launcher is not installed")


def test_two_nodes_over_loopback(tmp_path: Path) -> None:
    (tmp_path / "hostfile").write_text("node0 slots=2\nnode1 slots=2\n")
    cfg = json.loads((Path(__file__).resolve().parents[2] / "ds_configs" / "hybrid.json").read_text())
    cfg["wallfacer"].update(ulysses_degree="auto", ring_count="auto")
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    port = str(free_port())
    jobs = []
    try:
        for node in (0, 1):
            launcher = ("--hostfile", str(tmp_path / "hostfile"), "--no_ssh", "--num_nodes", "2", "--node_rank",
                        str(node), "--master_addr", "127.0.0.1", "--master_port", port)
            jobs.append(Job.trainer(tmp_path, num_gpus=2, config=str(tmp_path / "cfg.json"), launcher=launcher,
                                    args=("--steps", "3"), name=f"node{node}"))
        for job in jobs:
            job.wait(timeout=300)
        out0, out1 = (job.output() for job in jobs)
    finally:
        for job in jobs:
            job.kill()
    assert [job.returncode for job in jobs] == [0, 0], out0[-3000:] + out1[-3000:]
    # the launchers placed global ranks 0, 1 on node0 and 2, 3 on node1
    for node, out in enumerate((out0, out1)):
        assert re.search(r"global_rank_mapping=.*'node0': \[0, 1\], 'node1': \[2, 3\]", out), out[-3000:]
        assert f"nnodes=2, num_local_procs=2, node_rank={node}" in out, out[-3000:]
    node_of = {0: 0, 1: 0, 2: 1, 3: 1}
    # rank 0 logs the resolved plan: the planner saw 2 nodes x 2 ranks and kept the all-to-all inside a node
    m = re.search(r"ds_wallfacer: mode=(\w+) world=4 .* ulysses_degree=(\d+) ring_size=(\d+) ring_count=(\d+) "
                  r"placement=(\S+)", out0)
    assert m, out0[-3000:]
    mode, u, r, c, placement = m.group(1), *map(int, m.groups()[1:4]), m.group(5)
    assert (mode, u, r, c) == ("hybrid", 2, 2, 1), m.group(0)
    assert "(2 x 2 ranks)" in out0 and "a2a:intra (2 ranks/node)" in out0, out0[-3000:]
    dims = ParallelDims(world_size=4, sp_size=4, mode=mode, ulysses_degree=u, ring_count=c, num_heads=8, num_kv_heads=4,
                        placement=placement)
    groups = [dims.ulysses_ranks(0, ring) for ring in range(r)]
    assert groups == [(0, 1), (2, 3)] and all(len({node_of[x] for x in g}) == 1 for g in groups), groups
    summary = json.loads([line for line in out0.splitlines() if line.startswith("{")][-1])
    assert summary["steps"] == 3 and summary["finite"] and summary["world_size"] == 4, summary
    assert "ds_wallfacer watchdog" not in out0 + out1, "the watchdog fired in a healthy run"
