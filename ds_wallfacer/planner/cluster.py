"""Cluster descriptions for the topology planner: nodes, links, memory and compute per rank.

Link model (what the cost model needs to tell intra- from inter-node traffic apart):

- inside a node every rank reaches every other at ``intra_bw`` at once (NVLink / NVSwitch, or shared memory);
- a node leaves through ``nics_per_node`` NICs of ``nic_bw`` each, so when k ranks of one node send off-node
  at the same time each gets ``nic_bw * min(1, nics_per_node / k)`` (one 400 Gb/s NIC per H100 gives every
  rank its own; one 100 Gb/s Ethernet port per A100 node is shared eight ways).

Bandwidths are bytes/s in one direction, latencies seconds, memory bytes, compute FLOP/s (dense bf16).
Pure Python: nothing here imports torch.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

__all__ = ["ClusterSpec", "CLUSTERS", "cluster_preset", "get_cluster", "from_env"]

GIB = 1024**3


@dataclass(frozen=True)
class ClusterSpec:
    """One homogeneous cluster: ``nodes`` x ``ranks_per_node`` ranks (one accelerator or CPU process each)."""

    name: str
    nodes: int
    ranks_per_node: int
    intra_bw: float
    """Bytes/s one rank sends to another rank of its node (one direction)."""
    intra_latency: float
    """Seconds per intra-node message."""
    nic_bw: float
    """Bytes/s of one NIC (one direction)."""
    nics_per_node: int
    """NICs per node; off-node senders of a node share them."""
    inter_latency: float
    """Seconds per inter-node message."""
    mem_bytes: float
    """Device memory per rank."""
    flops: float
    """Peak dense bf16 matmul FLOP/s per rank."""
    mfu: float = 0.45
    """Fraction of ``flops`` that matmuls and block-attention kernels achieve."""
    mem_reserved: float = 2 * GIB
    """Memory per rank that the framework holds before the model (CUDA context, NCCL buffers)."""
    host_mem_bytes: float = 0.0
    """Host memory per node for offloaded state (0: not checked)."""
    backend: str = "nccl"
    mem_bw: float = 0.0
    """Bytes/s the device reads from its own memory (HBM), the rate of a decode step (``planner/rl.py``); 0: not
    known (the calibration's measured rate, where there is one)."""
    calibration: Any = field(default=None, compare=False, repr=False)
    """This device's measured compute (``planner.calibrate.Calibration``); None: ``flops`` x ``mfu``."""

    def __post_init__(self) -> None:
        for key in ("nodes", "ranks_per_node", "nics_per_node"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"cluster {self.name!r}: {key}={value!r} must be a positive integer")
        for key in ("intra_bw", "nic_bw", "mem_bytes", "flops"):
            if not getattr(self, key) > 0:
                raise ValueError(f"cluster {self.name!r}: {key}={getattr(self, key)!r} must be > 0")
        for key in ("intra_latency", "inter_latency", "mem_reserved"):
            if getattr(self, key) < 0:
                raise ValueError(f"cluster {self.name!r}: {key}={getattr(self, key)!r} must be >= 0")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"cluster {self.name!r}: mfu={self.mfu!r} must be in (0, 1]")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def offnode_bw(self, senders: int) -> float:
        """Bytes/s each of ``senders`` concurrent off-node senders of one node gets."""
        return self.nic_bw * min(1.0, self.nics_per_node / max(1, senders))

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def with_world_size(self, world_size: int) -> "ClusterSpec":
        """The same hardware with ``world_size`` ranks: whole nodes when it spans several, else one partly
        used node (a single-node preset keeps one node and takes any rank count, like the CPU machine)."""
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        if world_size == self.world_size:
            return self
        if self.nodes == 1 or world_size <= self.ranks_per_node:
            return replace(self, nodes=1, ranks_per_node=world_size)
        if world_size % self.ranks_per_node:
            lo = world_size - world_size % self.ranks_per_node
            raise ValueError(
                f"world size {world_size} is not a whole number of {self.ranks_per_node}-rank nodes of cluster "
                f"{self.name!r}: use {lo} or {lo + self.ranks_per_node} ranks, or set ranks_per_node"
            )
        return replace(self, nodes=world_size // self.ranks_per_node)


_H100 = dict(intra_bw=450e9, intra_latency=3e-6, mem_bytes=80 * GIB, flops=989e12, host_mem_bytes=2048 * GIB,
             mem_bw=3.35e12)
# DGX H100 / H200 nodes: 2 TiB of host memory per 8 GPUs. HBM read rate (mem_bw), the vendors' figures: H100 SXM
# 3.35 TB/s, H200 4.8 TB/s, A100 40GB 1.555 TB/s

CLUSTERS: dict[str, ClusterSpec] = {
    c.name: c
    for c in (
        # 8 nodes x 8 H100-80GB SXM, NVLink 4 (900 GB/s bidirectional), one 400 Gb/s InfiniBand NIC per GPU
        ClusterSpec("h100x64", nodes=8, ranks_per_node=8, nic_bw=50e9, nics_per_node=8, inter_latency=8e-6, **_H100),
        # one such node
        ClusterSpec("h100x8", nodes=1, ranks_per_node=8, nic_bw=50e9, nics_per_node=8, inter_latency=8e-6, **_H100),
        # 4 nodes x 8 A100-40GB SXM, NVLink 3 (600 GB/s bidirectional), one 100 Gb/s Ethernet port per node
        ClusterSpec(
            "a100x32-eth", nodes=4, ranks_per_node=8, intra_bw=300e9, intra_latency=3e-6, nic_bw=12.5e9,
            nics_per_node=1, inter_latency=30e-6, mem_bytes=40 * GIB, flops=312e12, mem_bw=1.555e12,
        ),
        # one H200 (141 GB HBM3e), the only job on its DGX H200 node (2 TiB host memory)
        ClusterSpec(
            "h200x1", nodes=1, ranks_per_node=1, intra_bw=450e9, intra_latency=3e-6, nic_bw=50e9, nics_per_node=1,
            inter_latency=8e-6, mem_bytes=141e9, flops=989e12, host_mem_bytes=2048 * GIB, mem_bw=4.8e12,
        ),
        # one H100 80 GB, the only job on its DGX H100 node
        ClusterSpec("h100x1", nodes=1, ranks_per_node=1, nic_bw=50e9, nics_per_node=1, inter_latency=8e-6, **_H100),
        # this development machine: 2 cores, gloo over shared memory, ~22 GiB RAM shared by the ranks
        ClusterSpec(
            "cpu", nodes=1, ranks_per_node=2, intra_bw=2e9, intra_latency=50e-6, nic_bw=1e9, nics_per_node=1,
            inter_latency=100e-6, mem_bytes=10 * GIB, flops=50e9, mfu=0.5, mem_reserved=0.5 * GIB, backend="gloo",
        ),
    )
}


def get_cluster(name: str | ClusterSpec) -> ClusterSpec:
    """A preset by name (a ``ClusterSpec`` passes through)."""
    if isinstance(name, ClusterSpec):
        return name
    try:
        return CLUSTERS[name]
    except KeyError:
        raise ValueError(f"unknown cluster preset {name!r}; presets are {sorted(CLUSTERS)}") from None


def _env_int(env: Mapping[str, str], *keys: str) -> int | None:
    for key in keys:
        value = env.get(key)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"environment variable {key}={value!r} is not an integer") from None
    return None


def from_env(base: str | ClusterSpec = "h100x64", environ: Mapping[str, str] | None = None) -> ClusterSpec:
    """The launch shape from the environment, the hardware figures from ``base``.

    World size: ``WORLD_SIZE`` (torchrun, DeepSpeed launcher) or ``OMPI_COMM_WORLD_SIZE``. Ranks per node:
    ``LOCAL_WORLD_SIZE`` (torchrun), ``LOCAL_SIZE`` (DeepSpeed launcher) or ``OMPI_COMM_WORLD_LOCAL_SIZE``;
    else ``WORLD_SIZE / CROSS_SIZE`` (DeepSpeed's node count). Missing variables keep ``base``'s values.
    """
    env = os.environ if environ is None else environ
    spec = get_cluster(base)
    world = _env_int(env, "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE")
    local = _env_int(env, "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")
    nodes = _env_int(env, "CROSS_SIZE", "GROUP_WORLD_SIZE")
    if local is None and world is not None and nodes:
        local = world // nodes
    if world is None:
        return spec if local is None else replace(spec, ranks_per_node=local)
    local = min(local or spec.ranks_per_node, world)
    if world % local:
        raise ValueError(f"WORLD_SIZE={world} is not a multiple of the ranks per node ({local}) in the environment")
    return replace(spec, name=f"{spec.name}@env", nodes=world // local, ranks_per_node=local)


def cluster_preset() -> str:
    """The planner preset whose hardware figures ``"cluster": "auto"`` uses, by this rank's accelerator (the
    same answer on every rank of a homogeneous cluster)."""
    import torch  # lazily: the rest of this module is pure

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().upper()
    if "H200" in name:
        return "h200x1"
    if "A100" in name:
        return "a100x32-eth"
    return "h100x64"
