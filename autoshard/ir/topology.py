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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autoshard.errors import AutoshardError
from autoshard.ir.profile import ModelProfile
from autoshard.ir.specs import (
    MAX_DEVICES,
    NON_EMPTY,
    POSITIVE,
    DeviceSpec,
    HostOverheads,
    LinkSpec,
    check_backend,
    check_bounds,
    check_keys,
    check_mapping,
    check_value,
    short_value,
    spec_dict,
    spec_from_mapping,
)

if TYPE_CHECKING:
    import networkx as nx  # imported where a graph is built: every process that loads a plan imports this module

_COUNTS = {
    "nodes": ("the number of nodes, e.g. 1", POSITIVE),
    "devices_per_node": ("the number of devices in each node, e.g. 8", POSITIVE),
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
        check_value(self.name, str, NON_EMPTY, where, "name", _GROUP_DOCS["name"])
        check_value(self.nodes, int, POSITIVE, where, "nodes", _GROUP_DOCS["nodes"])
        for key, kind in _SECTIONS.items():
            if not isinstance(getattr(self, key), kind):
                raise AutoshardError(
                    f"{where}: {key} must be a {kind.__name__}; fix: build it with {kind.__name__}(...)"
                )
            check_bounds(getattr(self, key), where, key)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "nodes": self.nodes, **{key: spec_dict(getattr(self, key)) for key in _SECTIONS}}

    @classmethod
    def from_dict(cls, d: Any, where: str, default_source: str | None, inter_node: LinkSpec) -> NodeGroup:
        check_mapping(d, where, "a group", "a mapping with keys " + ", ".join(_GROUP_DOCS))
        check_keys(d, _GROUP_DOCS, where, "groups.", optional=("inter_node",))
        name = check_value(d["name"], str, NON_EMPTY, where, "groups.name", _GROUP_DOCS["name"])
        at = f"{where}: group {name}"
        sections = {
            key: spec_from_mapping(kind, d[key], at, key, default_source) for key, kind in _SECTIONS.items() if key in d
        }
        nodes = check_value(d["nodes"], int, POSITIVE, at, "nodes", _GROUP_DOCS["nodes"])
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
        host_link_gbps=min(d.host_link_gbps for d in devices),
        host_memory_bytes=min(d.host_memory_bytes for d in devices),
        host_memory_bandwidth_gbps=min(d.host_memory_bandwidth_gbps for d in devices),
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
        check_value(self.name, str, NON_EMPTY, where, "name", "a cluster name")
        for key, (doc, rule) in _COUNTS.items():
            check_value(getattr(self, key), int, rule, where, key, doc)
        if self.world_size > MAX_DEVICES:  # its graph would not fit in memory; no cluster is this big
            raise AutoshardError(
                f"{where}: {self.nodes} nodes x {self.devices_per_node} devices = {self.world_size:,} "
                f"devices, more than autoshard plans for ({MAX_DEVICES:,}); fix: check nodes "
                f"and devices_per_node (--nodes, --devices-per-node)"
            )
        check_backend(self.backend, where)
        for key, kind in {**_SECTIONS, **_OPTIONAL_SECTIONS}.items():
            if not isinstance(getattr(self, key), kind):
                raise AutoshardError(
                    f"{where}: {key} must be a {kind.__name__}, got {getattr(self, key)!r}; "
                    f"fix: build it with {kind.__name__}(...)"
                )
            check_bounds(getattr(self, key), where, key)

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
            "device": spec_dict(self.device),
            "intra_node": spec_dict(self.intra_node),
            "inter_node": spec_dict(self.inter_node),
            **({"host": spec_dict(self.host)} if self.host.measured else {}),
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
        check_mapping(d, where, "the cluster", "a mapping with keys " + ", ".join(CLUSTER_KEYS))
        if "groups" in d:
            return _cluster_of_groups(d, where, default_source)
        check_keys(d, _CLUSTER_DOCS, where, "", optional=(*_OPTIONAL_SECTIONS, "profiles", "groups"))
        sections = {key: spec_from_mapping(kind, d[key], where, key, default_source) for key, kind in _SECTIONS.items()}
        sections |= {
            key: spec_from_mapping(kind, d[key], where, key, default_source)
            for key, kind in _OPTIONAL_SECTIONS.items()
            if key in d
        }
        name = check_value(d["name"], str, NON_EMPTY, where, "name", "a cluster name")
        counts = {key: check_value(d[key], int, rule, where, key, doc) for key, (doc, rule) in _COUNTS.items()}
        return cls(
            name=name,
            backend=check_backend(d["backend"], where),
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
    check_keys(d, _CLUSTER_DOCS, where, "", optional=(*_OPTIONAL_SECTIONS, "profiles", *_DERIVED_FROM_GROUPS))
    raw = d["groups"]
    if not isinstance(raw, list) or not raw:
        raise AutoshardError(
            f"{where}: groups must be a non-empty list, got {short_value(raw)}; fix: list each node group as "
            "{name, nodes, device, intra_node}"
        )
    inter = spec_from_mapping(LinkSpec, d["inter_node"], where, "inter_node", default_source)
    groups = [NodeGroup.from_dict(g, where, default_source, inter) for g in raw]
    host = spec_from_mapping(HostOverheads, d["host"], where, "host", default_source) if "host" in d else None
    cluster = Cluster.of_groups(
        check_value(d["name"], str, NON_EMPTY, where, "name", "a cluster name"),
        check_value(d["devices_per_node"], int, _COUNTS["devices_per_node"][1], where, "devices_per_node", ""),
        check_backend(d["backend"], where),
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
            f"{where}: profiles must be a list, got {short_value(raw)}; fix: run `autoshard calibrate "
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
