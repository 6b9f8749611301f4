"""Cluster topology: devices, links, and the networkx graph that joins them.

Units: every ``*_gbps`` in autoshard is **GB/s (gigabytes per second)**, never gigabits;
``*_us`` is microseconds, ``*_bytes`` bytes, ``*_tflops`` 10¹² FLOP/s. Link bandwidths are
per device per direction (a full-duplex link sends and receives at that rate at once).

The graph (``Cluster.graph``) has

- a device vertex per rank, ``"node{n}/dev{d}"`` (``kind="device"``, ``rank``, ``node``),
  rank = n · devices_per_node + d;
- a switch per node, ``"node{n}/switch"`` (``kind="switch"``): NVSwitch, or shared memory;
- a ``"spine"`` switch when there is more than one node;
- edges device — node switch (``kind="intra_node"``, the device's own NVLink bandwidth) and
  node switch — spine (``kind="inter_node"``, the node's NICs together:
  ``inter_node.bandwidth_gbps · devices_per_node``), each with ``bandwidth_gbps``,
  ``latency_us`` and ``source``.

**Node groups** (``Cluster.groups``, ``NodeGroup``): a heterogeneous cluster is groups of whole nodes, in rank
order, each with its own device, intra-node link and link between its own nodes; ``inter_node`` is then the
link between groups. A collective inside one group is priced on the group's links (the group as a cluster of
its own, ``group_clusters``); one across groups on the slowest of the groups' intra-node links and the
between-groups link. ``device`` and ``intra_node`` are the slowest of the groups' (``slowest_device``).

``Cluster.group_link(ranks)`` prices a collective over ``ranks`` with one alpha-beta link
(α = latency, B = bandwidth; the formulas are in ``autoshard.cost.comm``):

    B = min over the edges e joining the ranks of  share(e)
    α = max over the same edges of latency(e)

    share(e) = bandwidth(e)                      on a device's own intra-node edge
    share(e) = bandwidth(e) / devices_per_node   on a node's NIC uplink

The NIC share is the **mesh-axis model**: a collective runs over one group of a mesh axis,
and the other groups of the same axis run at the same time, so every device of the node
is pushing traffic through the node's NICs at once and each gets its own device's share
(``inter_node.bandwidth_gbps``), however many members of this one group sit on the node.
A group inside one node gets ``intra_node`` itself. A flat ring priced this way over
several nodes is pessimistic (every byte is charged at NIC speed); use
``autoshard.cost.comm.hierarchical_allreduce_s`` for groups that span nodes.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import Field, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from autoshard.errors import AutoshardError
from autoshard.ir.profile import ModelProfile

if TYPE_CHECKING:
    import networkx as nx  # imported where a graph is built: every process that loads a plan imports this module

BACKENDS = ("nccl", "gloo")
MAX_DEVICES = (
    2**18
)  # 262,144: the largest clusters today have ~10^5 devices; plans in ~2 s of CPU on 2 cores (8.6 s at 2^20)

_POSITIVE = ("> 0", lambda v: v > 0)
_NON_NEGATIVE = (">= 0", lambda v: v >= 0)
_FRACTION = ("in (0, 1]", lambda v: 0 < v <= 1)
_SHARE = ("in [0, 1]", lambda v: 0 <= v <= 1)
# Physical bounds (a rule's third part: lowest, highest, unit): every figure of a cluster lies far
# inside them, and outside them the cost model's sums leave the range of CP-SAT's 64-bit integers.
#   bandwidths    1e-3 .. 1e6 GB/s (1 MB/s: a slow WAN; 1 PB/s: 300x HBM3)
#   latencies     0 .. 1e7 µs (10 s); host overheads the same
#   peak          1e-3 .. 1e6 TFLOP/s (1 GFLOP/s: one old CPU core; 1 EFLOP/s on one device)
#   memory        1 .. 2^50 bytes (1 PiB; too little memory is "no plan fits", not an error here)
#   efficiency    1e-3 .. 1
BOUNDS = {
    "bandwidth": (1e-3, 1e6, "GB/s"),
    "latency": (0.0, 1e7, "µs"),
    "tflops": (1e-3, 1e6, "TFLOP/s"),
    "memory": (1, 2**50, "bytes (2^50 = 1 PiB)"),
    "efficiency": (1e-3, 1.0, ""),
    "cores": (0.0, 1e6, "cores"),
}
_BANDWIDTH = (*_POSITIVE, BOUNDS["bandwidth"])
_LATENCY = (*_NON_NEGATIVE, BOUNDS["latency"])
_TFLOPS = (*_POSITIVE, BOUNDS["tflops"])
_MEMORY = (*_POSITIVE, BOUNDS["memory"])
_EFFICIENCY = (*_FRACTION, BOUNDS["efficiency"])
_HOST_US = _LATENCY
_NON_EMPTY = ("a non-empty string", lambda v: bool(v.strip()))
_TYPES = {"str": str, "int": int, "float": float}
_TYPE_WORDS = {str: "a string", int: "an integer", float: "a number"}


def _spec(doc: str, rule: tuple | None = None) -> Any:
    """A dataclass field that carries its own documentation and validity rule."""
    return field(metadata={"doc": doc, "rule": rule})


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or CPU process) as the cost model sees it."""

    name: str = _spec("the device name, e.g. H100-SXM-80GB", _NON_EMPTY)
    peak_tflops: float = _spec("the dense peak TFLOP/s in the training precision, e.g. 989 for H100 bf16", _TFLOPS)
    memory_bytes: int = _spec("the device memory in bytes, e.g. 85899345920 for 80 GiB", _MEMORY)
    memory_bandwidth_gbps: float = _spec("the memory bandwidth in GB/s, e.g. 3350 for H100 HBM3", _BANDWIDTH)
    matmul_efficiency: float = _spec("achieved/peak FLOP/s on large matmuls, e.g. 0.8", _EFFICIENCY)
    source: str = _spec("where the figures come from (datasheet, measurement)")
    # Optional, written only when > 0: a device without float8 matmuls (CPUs, A100) has none.
    float8_tflops: float = field(
        default=0.0,
        metadata={
            "doc": "optional: the dense peak float8 TFLOP/s of its matmuls, e.g. 1979 for H100 SXM (0: none, "
            "as on CPUs and A100)",
            "rule": (*_NON_NEGATIVE, (0.0, BOUNDS["tflops"][1], "TFLOP/s")),
            "optional": True,
            "written_unless": 0.0,
        },
    )

    # Optional, written only when they differ from the defaults: the host each device is attached to, as offload
    # (``cost.offload``) sees it. Defaults: a DGX H100 (``HOST_LINK_GBPS``, ``HOST_MEMORY_BYTES``,
    # ``HOST_MEMORY_BANDWIDTH_GBPS``; their sources beside them).
    host_link_gbps: float = field(
        default=55.0,
        metadata={
            "doc": "optional: the device's link to host memory in GB/s per direction, e.g. 55 for PCIe Gen5 x16 "
            "(64 GB/s raw, about 55 achieved by pinned copies)",
            "rule": _BANDWIDTH,
            "optional": True,
            "written_unless": 55.0,
        },
    )
    host_memory_bytes: int = field(
        default=2 * 2**40,
        metadata={
            "doc": "optional: the host memory of one node in bytes, shared by its devices, e.g. 2199023255552 "
            "(2 TiB, a DGX H100)",
            "rule": _MEMORY,
            "optional": True,
            "written_unless": 2 * 2**40,
        },
    )
    host_memory_bandwidth_gbps: float = field(
        default=400.0,
        metadata={
            "doc": "optional: one node's host memory bandwidth in GB/s, shared by its devices' CPU work, e.g. 400 "
            "(a DGX H100's two Xeon 8480C: 16 channels of DDR5-4800, 614 GB/s peak, about 65% achieved)",
            "rule": _BANDWIDTH,
            "optional": True,
            "written_unless": 400.0,
        },
    )

    def __post_init__(self):
        _check_dataclass(self)

    @property
    def has_float8(self) -> bool:
        """Whether its matmuls run in float8 (torch._scaled_mm: NVIDIA SM 8.9 and later)."""
        return self.float8_tflops > 0


COLLECTIVE_NAMES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "p2p", "all_to_all")


@dataclass(frozen=True)
class LinkSpec:
    """A link as the alpha-beta model sees it: per device, per direction.

    ``collectives`` optionally gives a collective its own (latency_us, bandwidth_gbps) on this
    link, as ``autoshard calibrate`` fits them: gloo's reduce-scatter and all-gather move 4-9×
    fewer bytes per second than its broadcast, so one α-β pair cannot price them all. Without an
    entry a collective uses the link's own pair (``for_collective``)."""

    bandwidth_gbps: float = _spec("the per-device, per-direction bandwidth in GB/s, e.g. 450 for NVLink 4", _BANDWIDTH)
    latency_us: float = _spec("the small-message latency in microseconds, e.g. 3", _LATENCY)
    source: str = _spec("where the figures come from (datasheet, measurement)")
    collectives: tuple[tuple[str, float, float], ...] = field(
        default=(),
        metadata={
            "doc": "optional: per collective {latency_us, bandwidth_gbps}, as calibrate fits them",
            "rule": None,
            "composite": True,
        },
    )

    def __post_init__(self):
        _check_dataclass(self)
        object.__setattr__(self, "collectives", _check_collectives(self.collectives, "LinkSpec"))

    def for_collective(self, name: str) -> LinkSpec:
        """This link as collective ``name`` sees it: its own fitted pair where there is one."""
        for collective, latency_us, bandwidth_gbps in self.collectives:
            if collective == name:
                return LinkSpec(bandwidth_gbps, latency_us, self.source)
        return self


@dataclass(frozen=True)
class HostOverheads:
    """What the host spends around the device's work, measured by ``autoshard calibrate`` (its
    ``host_probes``); all zero when not measured (the presets). On CPU ranks (gloo) the host *is*
    the device, so these add to the roofline; on GPUs they overlap it (``cost.units``)."""

    op_forward_us: float = _spec("host time per op of the forward (one OpGraph node), e.g. 12", _HOST_US)
    op_backward_us: float = _spec("host time per op in the backward, e.g. 30", _HOST_US)
    selective_op_us: float = _spec(
        "extra per block op under selective recompute (its policy runs at every op "
        "of the forward and of the recompute), e.g. 40",
        _HOST_US,
    )
    checkpoint_block_us: float = _spec("extra per block and micro-batch under full recompute, e.g. 100", _HOST_US)
    fsdp_unit_zero2_us: float = _spec(
        "FSDP2 (ZeRO-2) host time per unit and micro-batch beyond its collectives, e.g. 2000", _HOST_US
    )
    fsdp_unit_zero3_us: float = _spec("the same for ZeRO-3 (resharded after forward), e.g. 3000", _HOST_US)
    fsdp_zero2_us_per_mib: float = _spec(
        "FSDP2 (ZeRO-2) host time per MiB of a unit's parameters and micro-batch "
        "beyond its collectives (copies in and out), e.g. 500",
        _HOST_US,
    )
    fsdp_zero3_us_per_mib: float = _spec("the same for ZeRO-3, e.g. 800", _HOST_US)
    ddp_tensor_us: float = _spec(
        "DDP's hooks per parameter tensor and micro-batch beyond the all-reduce, e.g. 50", _HOST_US
    )
    zero1_tensor_us: float = _spec(
        "ZeroRedundancyOptimizer's step per parameter tensor beyond AdamW and the "
        "weights' all-gather bytes: its broadcast's latency as issued (async) and its "
        "loop, e.g. 300",
        _HOST_US,
    )
    optimizer_tensor_us: float = _spec("AdamW step time per parameter tensor beyond its bytes, e.g. 60", _HOST_US)
    sharded_optimizer_tensor_us: float = _spec("the same for FSDP2's sharded (DTensor) parameters, e.g. 300", _HOST_US)
    pipeline_microbatch_us: float = _spec(
        "pipeline schedule time per stage and micro-batch beyond its ops and transfers, e.g. 1500", _HOST_US
    )
    pipeline_step_us: float = _spec(
        "pipeline schedule time per step beyond its micro-batches and bubble (loss "
        "and tied-weight bookkeeping), e.g. 5000",
        _HOST_US,
    )
    tp_module_us: float = _spec(
        "DTensor's host time per tensor-parallel module and micro-batch (forward and "
        "backward) beyond its collectives, e.g. 400",
        _HOST_US,
    )
    source: str = _spec("where the figures come from (autoshard calibrate)")
    # Written by calibrate since it was added; a file without it shares nothing (the default).
    shared_cores: float = field(
        default=0.0,
        metadata={
            "doc": "how many of the node's ranks run at full speed at once when they share its CPU cores: "
            "the cores / threads per rank, e.g. 2 (0: every rank has its own device, as GPUs)",
            "rule": (*_NON_NEGATIVE, BOUNDS["cores"]),
            "optional": True,
        },
    )

    # Written by calibrate since it was added; a file without it prices no split backward's own cost (the default).
    weight_group_us: float = field(
        default=0.0,
        metadata={
            "doc": "a zero-bubble schedule's split backward: its weight pass's host time per parameter group and "
            "micro-batch (one autograd call each) beyond one backward call's, e.g. 100",
            "rule": _HOST_US,
            "optional": True,
        },
    )

    # Written by calibrate since it was added; a file without it prices no such module's own cost (the default).
    sequence_module_us: float = field(
        default=0.0,
        metadata={
            "doc": "DTensor's host time per tensor-parallel module that shards no weight (a norm on a sequence or "
            "head shard, a sequence gather or scatter) and micro-batch, forward and backward, beyond its "
            "collectives, e.g. 1000",
            "rule": _HOST_US,
            "optional": True,
        },
    )

    # Written by calibrate since it was added; a file without it prices a tensor-parallel collective as the link's
    # alone (the default).
    collective_wait_us: float = field(
        default=0.0,
        metadata={
            "doc": "what a tensor-parallel collective issued between compute costs beyond its own time measured back "
            "to back (the ranks meet, the backend's worker wakes), per collective, e.g. 1500 on CPU ranks",
            "rule": _HOST_US,
            "optional": True,
        },
    )

    # Written by calibrate since it was added; a file without it prices no recomputed forward's DTensor time (the
    # default).
    tp_forward_share: float = field(
        default=0.0,
        metadata={
            "doc": "the share of DTensor's host time per tensor-parallel module (tp_module_us, sequence_module_us) "
            "spent in its forward, paid again by a forward that recompute reruns, e.g. 0.35",
            "rule": _SHARE,
            "optional": True,
        },
    )

    # Written by calibrate since it was added; a file without it prices no FSDP2 host time on a micro-batch that
    # synchronises no gradient (the default).
    fsdp_accumulate_unit_us: float = field(
        default=0.0,
        metadata={
            "doc": "FSDP2's host time per unit on a micro-batch that synchronises no gradient (its weights kept "
            "gathered, its gradients summed whole: ZeRO-0 and 1 beside tp or pp before a step's last micro-batch, "
            "and a pipeline stage's), e.g. 500",
            "rule": _HOST_US,
            "optional": True,
        },
    )

    def __post_init__(self):
        _check_dataclass(self)

    @classmethod
    def none(cls) -> HostOverheads:
        return cls(**{f.name: 0.0 for f in fields(cls) if f.name != "source"}, source="not measured")

    @property
    def measured(self) -> bool:
        return any(getattr(self, f.name) for f in fields(self) if f.name != "source")


_COUNTS = {
    "nodes": ("the number of nodes, e.g. 1", _POSITIVE),
    "devices_per_node": ("the number of devices in each node, e.g. 8", _POSITIVE),
}
_SECTIONS = {"device": DeviceSpec, "intra_node": LinkSpec, "inter_node": LinkSpec}
_OPTIONAL_SECTIONS = {"host": HostOverheads}  # absent: HostOverheads.none()
_CLUSTER_DOCS = {
    "name": "a cluster name",
    "nodes": _COUNTS["nodes"][0],
    "devices_per_node": _COUNTS["devices_per_node"][0],
    "backend": "nccl for GPUs, gloo for CPUs",
    "device": "a mapping of name, peak_tflops, memory_bytes, memory_bandwidth_gbps, matmul_efficiency (float8_tflops, "
    "host_link_gbps, host_memory_bytes, host_memory_bandwidth_gbps optional)",
    "intra_node": "a mapping of bandwidth_gbps, latency_us for the link inside a node",
    "inter_node": "a mapping of bandwidth_gbps, latency_us for each device's share of the NICs",
    "host": "optional: host overheads per op, unit and tensor, as autoshard calibrate writes them",
    "profiles": "optional: measured models, as autoshard calibrate --model writes them",
    "groups": "optional: node groups of different devices or links, each {name, nodes, device, intra_node, "
    "inter_node}, in rank order (nodes, device and intra_node then come from the groups)",
}
CLUSTER_KEYS = tuple(_CLUSTER_DOCS)
_GROUP_DOCS = {
    "name": "a group name, e.g. h100",
    "nodes": "the number of nodes in the group, e.g. 2",
    "device": _CLUSTER_DOCS["device"],
    "intra_node": _CLUSTER_DOCS["intra_node"],
    "inter_node": "optional: the link between this group's own nodes (default: the cluster's inter_node)",
}
_DERIVED_FROM_GROUPS = ("nodes", "device", "intra_node")


@dataclass(frozen=True)
class NodeGroup:
    """Nodes of one kind inside a heterogeneous cluster: their device, the link inside each node and the
    link between the group's own nodes. Groups hold consecutive ranks, in the order the cluster lists them."""

    name: str
    nodes: int
    device: DeviceSpec
    intra_node: LinkSpec
    inter_node: LinkSpec

    def __post_init__(self):
        where = f"node group {self.name!r}"
        _check_value(self.name, str, _NON_EMPTY, where, "name", _GROUP_DOCS["name"])
        _check_value(self.nodes, int, _POSITIVE, where, "nodes", _GROUP_DOCS["nodes"])
        for key, kind in _SECTIONS.items():
            if not isinstance(getattr(self, key), kind):
                raise AutoshardError(
                    f"{where}: {key} must be a {kind.__name__}; fix: build it with {kind.__name__}(...)"
                )
            _check_bounds(getattr(self, key), where, key)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "nodes": self.nodes, **{key: _spec_dict(getattr(self, key)) for key in _SECTIONS}}

    @classmethod
    def from_dict(cls, d: Any, where: str, default_source: str | None, inter_node: LinkSpec) -> NodeGroup:
        _check_mapping(d, where, "a group", "a mapping with keys " + ", ".join(_GROUP_DOCS))
        _check_keys(d, _GROUP_DOCS, where, "groups.", optional=("inter_node",))
        name = _check_value(d["name"], str, _NON_EMPTY, where, "groups.name", _GROUP_DOCS["name"])
        at = f"{where}: group {name}"
        sections = {
            key: _spec_from_mapping(kind, d[key], at, key, default_source)
            for key, kind in _SECTIONS.items()
            if key in d
        }
        nodes = _check_value(d["nodes"], int, _POSITIVE, at, "nodes", _GROUP_DOCS["nodes"])
        return cls(name, nodes, sections["device"], sections["intra_node"], sections.get("inter_node", inter_node))


def slowest_device(groups: Sequence[NodeGroup]) -> DeviceSpec:
    """The device an SPMD step over every group runs at: each figure the lowest of the groups' (a collective
    waits for the slowest rank; a plan must fit the smallest memory). Pipeline stages are priced on their own
    group's device (``Cluster.rank_group``)."""
    devices = [g.device for g in groups]
    return DeviceSpec(
        name=" | ".join(dict.fromkeys(d.name for d in devices)),
        peak_tflops=min(d.peak_tflops for d in devices),
        memory_bytes=min(d.memory_bytes for d in devices),
        memory_bandwidth_gbps=min(d.memory_bandwidth_gbps for d in devices),
        matmul_efficiency=min(d.matmul_efficiency for d in devices),
        source="the lowest of each figure over the node groups",
        float8_tflops=min(d.float8_tflops for d in devices),
    )


def slowest_link(links: Sequence[LinkSpec]) -> LinkSpec:
    """The lowest bandwidth and highest latency of ``links`` (a collective over groups waits for the slowest)."""
    if len(set(links)) == 1:
        return links[0]
    return LinkSpec(
        min(k.bandwidth_gbps for k in links),
        max(k.latency_us for k in links),
        "the slowest of the node groups' links",
    )


@dataclass(frozen=True)
class Cluster:
    """Nodes of identical devices; build from presets or YAML with ``autoshard.cost.hardware``."""

    name: str
    nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra_node: LinkSpec  # device <-> node switch (NVLink / shared memory)
    inter_node: LinkSpec  # per-device share of the node's NICs
    backend: str  # "nccl" or "gloo"
    host: HostOverheads = field(default_factory=HostOverheads.none)
    profiles: tuple[ModelProfile, ...] = ()  # models measured on these devices
    groups: tuple[NodeGroup, ...] = ()  # heterogeneous: node groups in rank order (``of_groups``); () homogeneous

    def __post_init__(self):
        where = f"cluster {self.name!r}"
        if self.groups:
            _check_groups(self, where)
        _check_value(self.name, str, _NON_EMPTY, where, "name", "a cluster name")
        for key, (doc, rule) in _COUNTS.items():
            _check_value(getattr(self, key), int, rule, where, key, doc)
        if self.world_size > MAX_DEVICES:  # its graph would not fit in memory; no cluster is this big
            raise AutoshardError(
                f"{where}: {self.nodes} nodes x {self.devices_per_node} devices = {self.world_size:,} "
                f"devices, more than autoshard plans for ({MAX_DEVICES:,}); fix: check nodes "
                f"and devices_per_node (--nodes, --devices-per-node)"
            )
        _check_backend(self.backend, where)
        for key, kind in {**_SECTIONS, **_OPTIONAL_SECTIONS}.items():
            if not isinstance(getattr(self, key), kind):
                raise AutoshardError(
                    f"{where}: {key} must be a {kind.__name__}, got {getattr(self, key)!r}; "
                    f"fix: build it with {kind.__name__}(...)"
                )
            _check_bounds(getattr(self, key), where, key)

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @classmethod
    def of_groups(
        cls,
        name: str,
        devices_per_node: int,
        backend: str,
        inter_node: LinkSpec,
        groups: Sequence[NodeGroup],
        host: HostOverheads | None = None,
        profiles: tuple[ModelProfile, ...] = (),
    ) -> Cluster:
        """A heterogeneous cluster: ``groups`` in rank order, ``inter_node`` the link between groups. Its
        ``device`` and ``intra_node`` are the slowest of the groups' (``slowest_device``, ``slowest_link``):
        what a step that spans the groups runs at."""
        groups = tuple(groups)
        if not groups:
            raise AutoshardError(f"cluster {name!r}: groups is empty; fix: give at least one node group")
        return cls(
            name=name,
            nodes=sum(g.nodes for g in groups),
            devices_per_node=devices_per_node,
            device=slowest_device(groups),
            intra_node=slowest_link([g.intra_node for g in groups]),
            inter_node=inter_node,
            backend=backend,
            host=host or HostOverheads.none(),
            profiles=profiles,
            groups=groups,
        )

    @property
    def mean_peak_tflops(self) -> float:
        """The devices' peak TFLOP/s, averaged over the ranks: MFU's denominator per rank (node groups: each group's
        device weighted by its ranks; a homogeneous cluster: its device's)."""
        if not self.groups:
            return self.device.peak_tflops
        return sum(g.nodes * g.device.peak_tflops for g in self.groups) / self.nodes

    @functools.cached_property
    def _group_first_nodes(self) -> tuple[int, ...]:
        firsts, n = [], 0
        for g in self.groups:
            firsts.append(n)
            n += g.nodes
        return tuple(firsts)

    def rank_group(self, rank: int) -> int:
        """The index of the node group that holds ``rank`` (0 on a homogeneous cluster)."""
        if not self.groups:
            return 0
        return bisect.bisect_right(self._group_first_nodes, self.node_of(rank)) - 1

    def group_ranks(self, index: int) -> range:
        """The ranks of group ``index``: consecutive, its nodes' devices."""
        first = self._group_first_nodes[index] * self.devices_per_node
        return range(first, first + self.groups[index].nodes * self.devices_per_node)

    @functools.cached_property
    def group_clusters(self) -> tuple[Cluster, ...]:
        """Each group as a homogeneous cluster of its own (its device and links, this cluster's host figures)."""
        return tuple(
            Cluster(
                f"{self.name}/{g.name}",
                g.nodes,
                self.devices_per_node,
                g.device,
                g.intra_node,
                g.inter_node,
                self.backend,
                self.host,
                self.profiles,
            )
            for g in self.groups
        )

    def tp_degrees(self, pinned: int | None = None) -> list[int]:
        """The tensor-parallel degrees above 1 this cluster offers: t divides the devices per node and the
        world (inside a node, over whole nodes), or only ``pinned`` when it does; the heads decide the rest
        (``passes.planning.strategies.legal_tp_degrees``). Ascending."""
        n = self.devices_per_node
        return [t for t in range(2, n + 1) if n % t == 0 and self.world_size % t == 0 and pinned in (None, t)]

    @functools.cached_property
    def graph(self) -> nx.Graph:
        """The topology as a networkx graph (module doc), built on first use: 10⁶ devices take seconds
        and planning never needs it (``group_link`` knows the tree's shape)."""
        return self._build_graph()

    def node_of(self, rank: int) -> int:
        """The node that holds ``rank``."""
        if type(rank) is not int or not 0 <= rank < self.nodes * self.devices_per_node:
            self._check_rank(rank)
        return rank // self.devices_per_node

    def device_vertex(self, rank: int) -> str:
        """The graph vertex of ``rank``, e.g. ``"node1/dev3"``."""
        return f"node{self.node_of(rank)}/dev{rank % self.devices_per_node}"

    def group_link(self, ranks: Sequence[int]) -> LinkSpec:
        """The bottleneck link of a collective over ``ranks`` (model in the module doc).

        On this two-level tree the edges joining the ranks are known without walking the graph
        (``_tree_edges`` does walk it, and gives the same link): every other rank's own intra-node
        edge and the first rank's, plus each involved node's uplink when the ranks span nodes. So
        this is O(len(ranks)) and never O(world size) per call."""
        if not ranks:
            raise AutoshardError(
                f"cluster {self.name!r}: group_link needs at least one rank; fix: pass the group's ranks"
            )
        if not (all(type(r) is int for r in ranks) and 0 <= min(ranks) and max(ranks) < self.world_size):
            for r in ranks:
                self._check_rank(r)
        low, high = min(ranks), max(ranks)
        if self.groups and self.rank_group(low) == self.rank_group(high):  # inside one group: its own links
            g = self.rank_group(low)
            first = self.group_ranks(g).start
            return self.group_clusters[g].group_link([r - first for r in ranks])
        if low == high:
            return self.intra_node
        inside = low // self.devices_per_node == high // self.devices_per_node
        intra = _edge_attrs(self.intra_node, "intra_node", 1)
        edges = [intra] if inside else [intra, _edge_attrs(self.inter_node, "inter_node", self.devices_per_node)]
        bottleneck = min(edges, key=self._share_gbps)  # ties: the intra-node edge, first in the graph's edge order
        latency_us = max(e["latency_us"] for e in edges)
        return LinkSpec(
            self._share_gbps(bottleneck),
            latency_us,
            bottleneck["source"],
            self.intra_node.collectives if inside else (),
        )

    def group_link_by_graph(self, ranks: Sequence[int]) -> LinkSpec:
        """``group_link`` by shortest paths on ``graph`` (the reference it is tested against)."""
        vertices = [self.device_vertex(r) for r in ranks]
        if not vertices:
            raise AutoshardError(
                f"cluster {self.name!r}: group_link needs at least one rank; fix: pass the group's ranks"
            )
        edges = _tree_edges(self.graph, vertices)
        if not edges:
            return self.intra_node
        bottleneck = min(edges, key=self._share_gbps)
        latency_us = max(e["latency_us"] for e in edges)
        inside = all(e["kind"] == "intra_node" for e in edges)  # measured per collective: one node's link
        return LinkSpec(
            self._share_gbps(bottleneck),
            latency_us,
            bottleneck["source"],
            self.intra_node.collectives if inside else (),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, in a fixed key order (plan.json's ``cluster``)."""
        return {
            "name": self.name,
            "nodes": self.nodes,
            "devices_per_node": self.devices_per_node,
            "backend": self.backend,
            "device": _spec_dict(self.device),
            "intra_node": _spec_dict(self.intra_node),
            "inter_node": _spec_dict(self.inter_node),
            **({"host": _spec_dict(self.host)} if self.host.measured else {}),
            **({"profiles": [p.to_dict() for p in self.profiles]} if self.profiles else {}),
            **({"groups": [g.to_dict() for g in self.groups]} if self.groups else {}),
        }

    def profile_for(self, signature: str) -> ModelProfile | None:
        """The measured profile of the graph with this signature (``cost.profile.graph_signature``), or None."""
        return next((p for p in self.profiles if p.signature == signature), None)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "cluster dict", default_source: str | None = None) -> Cluster:
        """Inverse of ``to_dict``; every mistake is an ``AutoshardError`` naming ``where`` and the field.

        ``default_source`` fills absent ``source`` fields (a YAML file's name); without it they
        are required.
        """
        _check_mapping(d, where, "the cluster", "a mapping with keys " + ", ".join(CLUSTER_KEYS))
        if "groups" in d:
            return _cluster_of_groups(d, where, default_source)
        _check_keys(d, _CLUSTER_DOCS, where, "", optional=(*_OPTIONAL_SECTIONS, "profiles", "groups"))
        sections = {
            key: _spec_from_mapping(kind, d[key], where, key, default_source) for key, kind in _SECTIONS.items()
        }
        sections |= {
            key: _spec_from_mapping(kind, d[key], where, key, default_source)
            for key, kind in _OPTIONAL_SECTIONS.items()
            if key in d
        }
        name = _check_value(d["name"], str, _NON_EMPTY, where, "name", "a cluster name")
        counts = {key: _check_value(d[key], int, rule, where, key, doc) for key, (doc, rule) in _COUNTS.items()}
        return cls(
            name=name,
            backend=_check_backend(d["backend"], where),
            **counts,
            **sections,
            profiles=_profiles(d.get("profiles", []), where),
        )

    def _share_gbps(self, edge: Mapping[str, Any]) -> float:
        users = self.devices_per_node if edge["kind"] == "inter_node" else 1
        return edge["bandwidth_gbps"] / users

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise AutoshardError(
                f"rank {rank!r} is not in cluster {self.name!r} (ranks 0..{self.world_size - 1}); "
                "fix: use ranks below nodes × devices_per_node, or a bigger cluster"
            )

    def _build_graph(self) -> nx.Graph:
        import networkx as nx

        g = nx.Graph(name=self.name)
        intra = _edge_attrs(self.intra_node, "intra_node", 1)
        inter = _edge_attrs(self.inter_node, "inter_node", self.devices_per_node)  # the node's NICs together
        if self.nodes > 1:
            g.add_node("spine", kind="switch")
        for n in range(self.nodes):
            switch = f"node{n}/switch"
            g.add_node(switch, kind="switch", node=n)
            if self.nodes > 1:
                g.add_edge(switch, "spine", **inter)
            for d in range(self.devices_per_node):
                g.add_node(f"node{n}/dev{d}", kind="device", rank=n * self.devices_per_node + d, node=n)
                g.add_edge(f"node{n}/dev{d}", switch, **intra)
        return g


def _cluster_of_groups(d: Mapping[str, Any], where: str, default_source: str | None) -> Cluster:
    """``Cluster.from_dict`` of a mapping with groups: nodes, device and intra_node come from the groups; where
    they are given too (plan.json writes them), they must be what the groups give."""
    _check_keys(d, _CLUSTER_DOCS, where, "", optional=(*_OPTIONAL_SECTIONS, "profiles", *_DERIVED_FROM_GROUPS))
    raw = d["groups"]
    if not isinstance(raw, list) or not raw:
        raise AutoshardError(
            f"{where}: groups must be a non-empty list, got {_short(raw)}; fix: list each node group as "
            "{name, nodes, device, intra_node}"
        )
    inter = _spec_from_mapping(LinkSpec, d["inter_node"], where, "inter_node", default_source)
    groups = [NodeGroup.from_dict(g, where, default_source, inter) for g in raw]
    host = _spec_from_mapping(HostOverheads, d["host"], where, "host", default_source) if "host" in d else None
    cluster = Cluster.of_groups(
        _check_value(d["name"], str, _NON_EMPTY, where, "name", "a cluster name"),
        _check_value(d["devices_per_node"], int, _COUNTS["devices_per_node"][1], where, "devices_per_node", ""),
        _check_backend(d["backend"], where),
        inter,
        groups,
        host,
        _profiles(d.get("profiles", []), where),
    )
    written = cluster.to_dict()
    for key in _DERIVED_FROM_GROUPS:
        if key in d and d[key] != written[key]:
            raise AutoshardError(
                f"{where}: {key} is given beside groups and differs from what the groups give; fix: remove {key}: "
                "a cluster with groups takes it from them"
            )
    return cluster


def _check_groups(cluster: Cluster, where: str) -> None:
    """A heterogeneous cluster's groups: named once each, their nodes the cluster's."""
    if not all(isinstance(g, NodeGroup) for g in cluster.groups):
        raise AutoshardError(f"{where}: groups must be NodeGroup records; fix: build them with NodeGroup(...)")
    names = [g.name for g in cluster.groups]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise AutoshardError(f"{where}: group {twice[0]!r} is named twice; fix: give each node group its own name")
    if sum(g.nodes for g in cluster.groups) != cluster.nodes:
        raise AutoshardError(
            f"{where}: the groups hold {sum(g.nodes for g in cluster.groups)} nodes, not the cluster's {cluster.nodes}; "
            "fix: leave nodes to the groups (Cluster.of_groups)"
        )


def _profiles(raw: Any, where: str) -> tuple[ModelProfile, ...]:
    if not isinstance(raw, list):
        raise AutoshardError(
            f"{where}: profiles must be a list, got {_short(raw)}; fix: run `autoshard calibrate "
            f"--model MODEL` again, or delete the profiles section"
        )
    try:
        return tuple(ModelProfile.from_dict(p, where) for p in raw)
    except AutoshardError:
        raise
    except (ValueError, TypeError, OverflowError) as exc:  # e.g. a micro-batch size of 4,300+ digits
        raise AutoshardError(
            f"{where}: profiles hold a value that is not a measured figure ({type(exc).__name__}); "
            "fix: run `autoshard calibrate --model MODEL` again, or delete the profiles section"
        ) from None


def _edge_attrs(link: LinkSpec, kind: str, devices: int) -> dict[str, Any]:
    return {
        "kind": kind,
        "bandwidth_gbps": link.bandwidth_gbps * devices,
        "latency_us": link.latency_us,
        "source": link.source,
    }


def _tree_edges(graph: nx.Graph, vertices: list[str]) -> list[dict[str, Any]]:
    """Attributes of the edges on the shortest paths from the first vertex to the others."""
    import networkx as nx

    paths = nx.single_source_shortest_path(graph, vertices[0])
    pairs = {tuple(sorted(p)) for v in vertices[1:] for p in zip(paths[v], paths[v][1:])}
    return [graph.edges[a, b] for a, b in sorted(pairs)]


def _spec_dict(spec: DeviceSpec | LinkSpec) -> dict[str, Any]:
    d = {
        f.name: getattr(spec, f.name)
        for f in fields(spec)
        if not f.metadata.get("composite")
        and ("written_unless" not in f.metadata or getattr(spec, f.name) != f.metadata["written_unless"])
    }
    if getattr(spec, "collectives", ()):
        d["collectives"] = {name: {"latency_us": lat, "bandwidth_gbps": bw} for name, lat, bw in spec.collectives}
    return d


def _check_collectives(value: Any, where: str, bounded: bool = False) -> tuple[tuple[str, float, float], ...]:
    """``collectives`` as sorted (name, latency_us, bandwidth_gbps); a mapping (from a file) or tuples."""
    fix = "fix: give each of " + ", ".join(COLLECTIVE_NAMES) + " as {latency_us: >= 0, bandwidth_gbps: > 0}, or drop it"
    if isinstance(value, Mapping):
        items = []
        for name, pair in value.items():
            if not isinstance(pair, Mapping) or set(pair) != {"latency_us", "bandwidth_gbps"}:
                raise AutoshardError(f"{where}: collectives.{name} must be {{latency_us, bandwidth_gbps}}; {fix}")
            items.append((name, pair["latency_us"], pair["bandwidth_gbps"]))
        value = items
    out = []
    for item in value:
        name, latency_us, bandwidth_gbps = item
        if name not in COLLECTIVE_NAMES:
            raise AutoshardError(f"{where}: unknown collective {name!r}; {fix}")
        lat = _check_value(
            latency_us, float, _LATENCY, where, f"collectives.{name}.latency_us", "microseconds", bounded=bounded
        )
        bw = _check_value(
            bandwidth_gbps, float, _BANDWIDTH, where, f"collectives.{name}.bandwidth_gbps", "GB/s", bounded=bounded
        )
        out.append((name, lat, bw))
    return tuple(sorted(out))


def _spec_from_mapping(kind: type, values: Any, where: str, section: str, default_source: str | None):
    plain = [f for f in fields(kind) if not f.metadata.get("composite")]
    composite = tuple(f.name for f in fields(kind) if f.metadata.get("composite"))
    example = "{" + ", ".join(f"{f.name}: ..." for f in plain if f.name != "source") + "}"
    _check_mapping(values, where, section, f"a mapping like {example}")
    names = {f.name: f.metadata["doc"] for f in fields(kind)}
    if default_source is not None and "source" not in values:
        values = {**values, "source": default_source}
    optional = composite + tuple(f.name for f in plain if f.metadata.get("optional"))  # optional: the default
    _check_keys(values, names, where, section + ".", optional=optional)
    checked = {
        f.name: _check_field(values[f.name], f, where, f"{section}.{f.name}")
        for f in plain
        if f.name in values or f.name not in optional
    }
    extra = {
        name: _check_collectives(values[name], f"{where}: {section}", bounded=True)
        for name in composite
        if name in values
    }
    return kind(**checked, **extra)


def _check_mapping(value: Any, where: str, what: str, fix: str) -> None:
    if not isinstance(value, Mapping):
        raise AutoshardError(
            f"{where}: {what} must be a mapping, got {_short(value)} ({type(value).__name__}); fix: write {fix}"
        )


def _check_keys(
    values: Mapping[str, Any], known: Mapping[str, str], where: str, prefix: str, optional: tuple[str, ...] = ()
) -> None:
    """No unknown keys, no missing ones but ``optional``; ``known`` maps each key to what it holds."""
    unknown = sorted(str(k) for k in values if k not in known)
    if unknown:
        raise AutoshardError(
            f"{where}: unknown field '{prefix}{unknown[0]}'; fix: remove it, or use one of {', '.join(known)}"
        )
    missing = [k for k in known if k not in values and k not in optional]
    if missing:
        raise AutoshardError(f"{where}: missing field '{prefix}{missing[0]}'; fix: add it: {known[missing[0]]}")


def _check_backend(backend: Any, where: str) -> str:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise AutoshardError(
            f"{where}: backend must be one of {', '.join(BACKENDS)}, got {_short(backend)}; "
            "fix: use nccl for GPUs, gloo for CPUs"
        )
    return backend


def _check_dataclass(spec: DeviceSpec | LinkSpec) -> None:
    """Validate every plain field from its metadata; store ints given for floats as floats. The
    physical bounds are a cluster's (``_check_bounds``): links the cost model derives (a NIC shared
    by 8, a scaled link) may lie outside them."""
    for f in fields(spec):
        if f.metadata.get("composite"):
            continue
        value = _check_field(getattr(spec, f.name), f, type(spec).__name__, f.name, bounded=False)
        object.__setattr__(spec, f.name, value)


def _check_bounds(spec: DeviceSpec | LinkSpec | HostOverheads, where: str, section: str) -> None:
    """Every figure of a cluster's section within its physical bounds (``BOUNDS``)."""
    for f in fields(spec):
        if not f.metadata.get("composite"):
            _check_field(getattr(spec, f.name), f, where, f"{section}.{f.name}")
    for name, latency_us, bandwidth_gbps in getattr(spec, "collectives", ()):
        _check_value(latency_us, float, _LATENCY, where, f"{section}.collectives.{name}.latency_us", "microseconds")
        _check_value(bandwidth_gbps, float, _BANDWIDTH, where, f"{section}.collectives.{name}.bandwidth_gbps", "GB/s")


def _check_field(value: Any, f: Field, where: str, dotted: str, bounded: bool = True) -> Any:
    return _check_value(value, _TYPES[f.type], f.metadata["rule"], where, dotted, f.metadata["doc"], bounded)


def _check_value(
    value: Any, kind: type, rule: tuple | None, where: str, dotted: str, doc: str, bounded: bool = True
) -> Any:
    """``value`` as ``kind`` (ints widen to floats, whole floats narrow to ints), or an error."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, kind) or (kind is float and not math.isfinite(value)):
        raise AutoshardError(
            f"{where}: {dotted} must be {_TYPE_WORDS[kind]}, got {_short(value)} "
            f"({type(value).__name__}); fix: give {doc}"
        )
    if rule is not None and not rule[1](value):
        raise AutoshardError(f"{where}: {dotted} must be {rule[0]}, got {_short(value)}; fix: give {doc}")
    if bounded and rule is not None and len(rule) > 2 and not rule[2][0] <= value <= rule[2][1]:
        low, high, unit = rule[2]
        high_text = f"{high:,}" if isinstance(high, int) else f"{high:g}"
        raise AutoshardError(
            f"{where}: {dotted} must be between {low:g} and {high_text}{' ' + unit if unit else ''} "
            f"(physical bounds), got {_short(value)}; fix: give {doc}"
        )
    return value


def _short(value: Any) -> str:
    if isinstance(value, int) and value.bit_length() > 200:  # repr of 4300+ digits raises; none is useful
        return f"an integer of {int(value.bit_length() * 0.30103) + 1} digits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
