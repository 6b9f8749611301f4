"""``autoshard calibrate --across-nodes NODE.yaml``: measure the links between nodes.

``autoshard calibrate`` measures one machine: its devices, its intra-node link, its host. The
link between machines needs ranks on several of them, so this part runs under torchrun on
every node (``torchrun --nnodes N --nproc-per-node L ... -m autoshard.cli calibrate
--across-nodes node.yaml -o cluster.yaml``). Local rank i of every node joins the group
{i, L + i, 2L + i, …}; the L groups measure at once, as a mesh axis across nodes runs in
training, so each device gets its share of the node's NICs (``ir.topology``'s model of
``inter_node``). In each group: all-reduce, reduce-scatter, all-gather and broadcast over
message sizes, and isend/irecv ping-pong between nodes 2j and 2j + 1 — timed and fitted as
the single-node calibration does (``autoshard.calibrate``, ``cost.calibrate.fit_link``: one
joint α-β pair and one per collective). Rank 0 writes NODE.yaml's cluster (measured on one of
the nodes) with ``nodes`` = N and ``inter_node`` = the fit.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import replace
from pathlib import Path

import yaml

from autoshard.calibrate import fit_or_none, four_digits
from autoshard.calibrate_bench import KIB, MIB, Bench, Settings, message_sizes
from autoshard.cost.calibrate import COLLECTIVES, Sample, fit_link
from autoshard.cost.hardware import load_cluster
from autoshard.errors import AutoshardError
from autoshard.ir.plan import write_text_atomic
from autoshard.ir.topology import Cluster, LinkSpec

CROSS_NODE_SIZES = message_sizes(4 * KIB, 4 * MIB)  # a slow inter-node link makes 64 MiB points minutes long


def launched_across_nodes() -> bool:
    """Whether torchrun started this process with ranks on more than one node."""
    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return "TORCHELASTIC_RUN_ID" in os.environ and world > local


def calibrate_across_nodes(node_file: str, output: str, command: str) -> Cluster | None:
    """Measure the inter-node link on every rank; rank 0 writes and returns the cluster (module doc)."""
    import torch
    import torch.distributed as dist

    if not launched_across_nodes():
        raise AutoshardError(
            "--across-nodes runs under torchrun on every node; fix: torchrun --nnodes N "
            "--nproc-per-node L --rdzv-backend c10d --rdzv-endpoint HEAD:29500 -m autoshard.cli "
            "calibrate --across-nodes node.yaml -o cluster.yaml"
        )
    node = load_cluster(node_file)  # checked before the group forms: a bad file is one line on every rank
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if gpu else torch.device("cpu")
    dist.init_process_group("nccl" if gpu else "gloo", timeout=datetime.timedelta(seconds=600))
    try:
        samples = _measure(device)
        if dist.get_rank() != 0:
            return None
        cluster = _cluster(node, samples)
        write_cluster(output, cluster, samples, command)
        return cluster
    finally:
        dist.destroy_process_group()


def _measure(device) -> list[Sample]:
    import torch.distributed as dist

    local = int(os.environ["LOCAL_WORLD_SIZE"])
    nodes = dist.get_world_size() // local
    groups = [dist.new_group([n * local + i for n in range(nodes)]) for i in range(local)]  # every rank makes all
    settings = replace(Settings.for_backend(dist.get_backend(), quick=True), sizes_bytes=CROSS_NODE_SIZES)
    bench = _CrossNodeBench(device, settings, lambda name: None, groups[dist.get_rank() % local], nodes, local)
    return [Sample(*row) for row in bench.collectives() + bench.p2p()]


class _CrossNodeBench(Bench):
    """``Bench``'s collectives in this rank's cross-node group; ping-pong between node pairs."""

    def __init__(self, device, settings, report, group, nodes: int, local: int):
        super().__init__(device, settings, report)
        self.local, self.node = local, self.rank // local
        self.group, self.broadcast_src = group, self.rank % local  # the root: node 0's member (a global rank)
        self.ranks = nodes  # the group's size: what the fitted formulas count

    def _ping_pong(self, buf) -> None:
        peer_node = self.node ^ 1
        if peer_node >= self.ranks:
            return
        peer = peer_node * self.local + self.rank % self.local
        first, second = (self.dist.isend, self.dist.irecv) if self.node % 2 == 0 else (self.dist.irecv, self.dist.isend)
        first(buf, peer).wait()
        second(buf, peer).wait()


def _cluster(node: Cluster, samples: list[Sample]) -> Cluster:
    import torch.distributed as dist

    fit = fit_link(samples)
    own = tuple(
        (c, four_digits(f.latency_us), four_digits(f.bandwidth_gbps))
        for c in COLLECTIVES
        if (f := fit_or_none([s for s in samples if s.collective == c]))
    )
    origin = (
        f"measured by autoshard calibrate --across-nodes on {socket.gethostname()} "
        f"{datetime.date.today().isoformat()}: {dist.get_world_size() // int(os.environ['LOCAL_WORLD_SIZE'])} "
        f"nodes, {os.environ['LOCAL_WORLD_SIZE']} groups across them at once; α and B fitted to comm.py's "
        f"formulas (fit error max {fit.max_rel_error:.0%}); collectives: each one's own fit"
    )
    inter = LinkSpec(four_digits(fit.bandwidth_gbps), four_digits(fit.latency_us), origin, own)
    nodes = dist.get_world_size() // int(os.environ["LOCAL_WORLD_SIZE"])
    return replace(node, name=f"{node.name}-x{nodes}", nodes=nodes, inter_node=inter)


def write_cluster(path: str, cluster: Cluster, samples: list[Sample], command: str) -> None:
    lines = [
        f"Cluster file written by `{command}`.",
        "inter_node measured across nodes; the rest from the node file. Measured one-way times, microseconds:",
    ]
    for s in samples:
        lines.append(f"  {s.collective:<15} {int(s.size_bytes):>10} B  {s.time_s * 1e6:10.0f}")
    header = "".join(f"# {line}\n" for line in lines) + "\n"
    body = yaml.safe_dump(cluster.to_dict(), sort_keys=False, allow_unicode=True, width=10_000)
    write_text_atomic(Path(path), header + body)
