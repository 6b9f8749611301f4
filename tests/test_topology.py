"""Cluster topology, presets and cluster files."""

import json

import pytest
import yaml

from autoshard.cost.hardware import PRESETS, host_memory_bytes, load_cluster
from autoshard.errors import AutoshardError
from autoshard.ir.topology import Cluster, DeviceSpec, LinkSpec

H100_FILE = {
    "name": "my-cluster",
    "nodes": 2,
    "devices_per_node": 8,
    "backend": "nccl",
    "device": {
        "name": "H100-SXM-80GB",
        "peak_tflops": 989,
        "memory_bytes": 85899345920,
        "memory_bandwidth_gbps": 3350,
        "matmul_efficiency": 0.8,
    },
    "intra_node": {"bandwidth_gbps": 450, "latency_us": 3},
    "inter_node": {"bandwidth_gbps": 50, "latency_us": 8},
}


def write(tmp_path, doc, name="cluster.yaml"):
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return str(path)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_load_and_cite_sources(name):
    cluster = load_cluster(name)
    assert cluster.name == name and cluster.nodes == 1
    for spec in (cluster.device, cluster.intra_node, cluster.inter_node):
        assert spec.source
    assert cluster.graph.number_of_nodes() == cluster.devices_per_node + 1  # devices + node switch


def test_h100_preset_figures():
    c = load_cluster("dgx-h100", nodes=4)
    assert (c.world_size, c.backend, c.device.peak_tflops) == (32, "nccl", 989.0)
    assert (c.intra_node.bandwidth_gbps, c.inter_node.bandwidth_gbps) == (450.0, 50.0)
    # measured NCCL busbw (docs/reference-numbers.md)
    assert load_cluster("dgx-a100-80gb").intra_node.bandwidth_gbps == 235.0


def test_local_cpu_memory_is_a_share_of_the_host():
    assert load_cluster("local-cpu").device.memory_bytes == host_memory_bytes() // 2
    c = load_cluster("local-cpu", devices_per_node=4)
    assert (c.devices_per_node, c.backend, c.device.memory_bytes) == (4, "gloo", host_memory_bytes() // 4)
    # every node of the preset runs on this one machine: its memory is shared by all of their ranks
    assert load_cluster("local-cpu", nodes=2, devices_per_node=2).device.memory_bytes == host_memory_bytes() // 4


def test_local_cpu_groups_share_the_host_between_all_their_ranks(tmp_path):
    doc = (
        "name: x\nbackend: gloo\ndevices_per_node: 2\ninter_node: {bandwidth_gbps: 25, latency_us: 6}\n"
        "groups:\n- {name: a, nodes: 1, preset: local-cpu}\n- {name: b, nodes: 2, preset: local-cpu}\n"
        "- {name: c, nodes: 1, preset: dgx-h100, device: {memory_bytes: 1000}}\n"
    )
    c = load_cluster(write(tmp_path, doc))
    memory = [g.device.memory_bytes for g in c.groups]
    assert memory == [host_memory_bytes() // 6, host_memory_bytes() // 6, 1000]  # 6 ranks of local-cpu in all


def test_graph_shape():
    c = load_cluster("dgx-h100", nodes=2)
    g = c.graph
    assert g.nodes["node1/dev3"] == {"kind": "device", "rank": 11, "node": 1}
    assert g.nodes["spine"]["kind"] == "switch"
    assert g.edges["node0/dev0", "node0/switch"]["bandwidth_gbps"] == 450.0
    assert g.edges["node0/switch", "spine"]["bandwidth_gbps"] == 8 * 50.0  # the node's NICs together
    assert c.node_of(11) == 1 and c.device_vertex(11) == "node1/dev3"


def test_group_link_nvlink_inside_a_node_nic_share_across_nodes():
    c = load_cluster("dgx-h100", nodes=2)
    assert c.group_link(range(8)) == c.intra_node
    assert c.group_link([8, 15]) == c.intra_node
    across = c.group_link([0, 8])  # one rank per node: still only its device's NIC share
    assert across.bandwidth_gbps == 50.0 and across.latency_us == c.inter_node.latency_us
    assert c.group_link(range(16)).bandwidth_gbps == 50.0
    assert c.group_link([5]) == c.intra_node


def test_group_link_latency_is_the_path_maximum():
    slow_switch = LinkSpec(100.0, 20.0, "test")
    c = Cluster("t", 2, 2, load_cluster("dgx-h100").device, slow_switch, LinkSpec(50.0, 5.0, "test"), "nccl")
    assert c.group_link([0, 2]) == LinkSpec(50.0, 20.0, "test")


def test_bad_ranks():
    c = load_cluster("dgx-h100")
    with pytest.raises(AutoshardError, match="rank 8"):
        c.group_link([0, 8])
    with pytest.raises(AutoshardError, match="at least one rank"):
        c.group_link([])


def test_to_dict_from_dict_round_trip():
    for name in PRESETS:
        c = load_cluster(name, nodes=3)
        d = c.to_dict()
        assert list(d) == ["name", "nodes", "devices_per_node", "backend", "device", "intra_node", "inter_node"]
        back = Cluster.from_dict(json.loads(json.dumps(d)))
        assert back == c and back.to_dict() == d
        assert back.graph.number_of_nodes() == c.graph.number_of_nodes()


def test_from_dict_validates():
    d = load_cluster("dgx-h100").to_dict()
    d["intra_node"] = {**d["intra_node"], "bandwidth_gbps": 0}
    with pytest.raises(AutoshardError, match=r"intra_node\.bandwidth_gbps must be > 0"):
        Cluster.from_dict(d)
    del d["intra_node"]["source"]
    with pytest.raises(AutoshardError, match="missing field 'intra_node.source'"):
        Cluster.from_dict(d)


def test_dataclasses_validate_directly():
    with pytest.raises(AutoshardError, match="latency_us must be >= 0"):
        LinkSpec(10.0, -1.0, "x")
    with pytest.raises(AutoshardError, match="matmul_efficiency must be in"):
        DeviceSpec("d", 1.0, 1, 1.0, 1.5, "x")
    with pytest.raises(AutoshardError, match="backend must be one of nccl, gloo"):
        Cluster("c", 1, 1, DeviceSpec("d", 1.0, 1, 1.0, 0.5, "x"), LinkSpec(1, 0, "x"), LinkSpec(1, 0, "x"), "mpi")


def test_yaml_file_round_trip(tmp_path):
    path = write(tmp_path, H100_FILE)
    c = load_cluster(path)
    assert c.world_size == 16 and c.intra_node.source == f"cluster file {path}"
    again = load_cluster(write(tmp_path, c.to_dict(), "again.yaml"))
    assert again == c


def test_example_cluster_file_loads():
    c = load_cluster("examples/cluster.yaml", nodes=4)
    assert c.nodes == 4 and c.device.name == "H100-SXM-80GB"


def test_yaml_preset_with_overrides(tmp_path):
    path = write(tmp_path, "preset: dgx-h100\nnodes: 2\ninter_node: {bandwidth_gbps: 25}\n")
    c = load_cluster(path, devices_per_node=4)
    assert (c.name, c.nodes, c.devices_per_node) == ("dgx-h100", 2, 4)
    assert c.inter_node.bandwidth_gbps == 25.0 and c.inter_node.latency_us == 6.0
    assert "over preset dgx-h100" in c.inter_node.source
    assert c.intra_node == PRESETS["dgx-h100"].intra_node


def test_yaml_local_cpu_preset_recomputes_memory(tmp_path):
    assert (
        load_cluster(write(tmp_path, "preset: local-cpu\ndevices_per_node: 4\n")).device.memory_bytes
        == host_memory_bytes() // 4
    )
    pinned = write(tmp_path, "preset: local-cpu\ndevice: {memory_bytes: 1000}\n", "pinned.yaml")
    assert load_cluster(pinned, devices_per_node=4).device.memory_bytes == 1000


_DELETE = object()


def _with(**changes):
    """H100_FILE with ``section__field=value`` changes (``_DELETE`` removes the field)."""
    doc = json.loads(json.dumps(H100_FILE))
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        target = doc
        for p in parents:
            target = target[p]
        if value is _DELETE:
            del target[leaf]
        else:
            target[leaf] = value
    return doc


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"device__peak_tflops": _DELETE}, "device.peak_tflops"),
        ({"nodes": _DELETE}, "nodes"),
        ({"device__peak_tflops": "fast"}, "device.peak_tflops"),
        ({"nodes": 1.5}, "nodes"),
        ({"nodes": True}, "nodes"),
        ({"devices_per_node": 0}, "devices_per_node"),
        ({"intra_node__bandwidth_gbps": -5}, "intra_node.bandwidth_gbps"),
        ({"inter_node__bandwidth_gbps": 0}, "inter_node.bandwidth_gbps"),
        ({"device__memory_bytes": "80e9"}, "device.memory_bytes"),
        ({"intra_node__color": "green"}, "intra_node.color"),
        ({"gpus": 8}, "gpus"),
        ({"backend": "mpi"}, "backend"),
        ({"device": [1, 2]}, "device"),
    ],
)
def test_invalid_yaml_fields(tmp_path, changes, field):
    path = write(tmp_path, _with(**changes))
    with pytest.raises(AutoshardError) as info:
        load_cluster(path)
    message = str(info.value)
    assert "\n" not in message and path in message and field in message and "fix:" in message


@pytest.mark.parametrize(
    "text, words",
    [
        ("name: [unclosed\n", "YAML syntax error at line"),
        ("- a\n- b\n", "must be a mapping"),
        ("", "must be a mapping"),
        ("preset: dgx-z\n", "preset must be one of"),
        ("preset: dgx-h100\ndevice: 3\n", "device must be a mapping"),
        ("preset: dgx-h100\ndevice: {flops: 3}\n", "unknown field 'device.flops'"),
    ],
)
def test_invalid_yaml_documents(tmp_path, text, words):
    path = write(tmp_path, text)
    with pytest.raises(AutoshardError, match=words) as info:
        load_cluster(path)
    assert path in str(info.value) and "\n" not in str(info.value)


def test_unknown_preset_and_missing_file(tmp_path):
    with pytest.raises(AutoshardError, match="dgx-a100-80gb, dgx-h100, local-cpu.*YAML"):
        load_cluster("dgx-b200")
    with pytest.raises(AutoshardError, match="does not exist"):
        load_cluster(str(tmp_path / "nope.yaml"))
    with pytest.raises(AutoshardError, match="--nodes 0 must be a positive integer"):
        load_cluster("dgx-h100", nodes=0)


def test_shared_cores_is_optional_checked_and_round_trips():
    shared = load_cluster("tests/clusters/cpu4_shared_cores.yaml")
    assert shared.host.shared_cores == 2.0
    d = shared.to_dict()
    assert d["host"]["shared_cores"] == 2.0 and Cluster.from_dict(json.loads(json.dumps(d))) == shared
    del d["host"]["shared_cores"]  # a cluster file from before the field: every rank has its own core
    assert Cluster.from_dict(d).host.shared_cores == 0.0
    d["host"]["shared_cores"] = -1
    with pytest.raises(AutoshardError, match=r"host\.shared_cores must be >= 0"):
        Cluster.from_dict(d)
