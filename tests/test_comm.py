"""Alpha-beta collective costs against the docs/reference-numbers.md worked examples, and their properties."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autoshard.cost import comm
from autoshard.ir.topology import LinkSpec

MiB = 2**20
NVLINK_BOTH_WAYS = LinkSpec(900.0, 0.0, "docs/reference-numbers.md worked example")
NIC = LinkSpec(50.0, 0.0, "docs/reference-numbers.md worked example")


def test_ring_traffic_64mib_over_8():
    assert comm.ring_allreduce_bytes_per_rank(64 * MiB, 8) == 112 * MiB


@pytest.mark.parametrize(
    "size_bytes, link, expected_s",
    [
        (64 * MiB, NVLINK_BOTH_WAYS, 0.13e-3),
        (64 * MiB, NIC, 2.35e-3),
        (25 * MiB, NVLINK_BOTH_WAYS, 0.051e-3),
        (25 * MiB, NIC, 0.92e-3),
        (2e9, NVLINK_BOTH_WAYS, 3.9e-3),
        (2e9, NIC, 70e-3),
    ],
)
def test_worked_examples(size_bytes, link, expected_s):
    for f in (comm.ring_allreduce_s, comm.tree_allreduce_s, comm.allreduce_s):
        assert f(size_bytes, 8, link) == pytest.approx(expected_s, rel=0.03)
    half = comm.reduce_scatter_s(size_bytes, 8, link)
    assert half == comm.all_gather_s(size_bytes, 8, link) == pytest.approx(expected_s / 2, rel=0.03)


def test_one_rank_is_free():
    link = LinkSpec(1.0, 10.0, "t")
    for f in (
        comm.ring_allreduce_s,
        comm.tree_allreduce_s,
        comm.allreduce_s,
        comm.reduce_scatter_s,
        comm.all_gather_s,
        comm.broadcast_s,
    ):
        assert f(1e9, 1, link) == 0.0
    assert comm.hierarchical_allreduce_s(1e9, 1, 1, link, link) == 0.0


def test_latency_terms_and_the_small_message_choice():
    link = LinkSpec(450.0, 3.0, "t")
    assert comm.ring_allreduce_s(0, 8, link) == pytest.approx(14 * 3e-6)
    assert comm.tree_allreduce_s(0, 8, link) == pytest.approx(6 * 3e-6)
    assert comm.allreduce_s(32 * 1024, 8, link) == pytest.approx(18e-6, rel=0.05)  # nccl-tests 8×H200, 32 KiB
    assert comm.broadcast_s(0, 4, link) == pytest.approx(9e-6)
    assert comm.p2p_s(450e9, link) == pytest.approx(1 + 3e-6)


def test_ib_latency_fit_matches_the_1mib_measurement():
    ib = LinkSpec(25.0, 6.0, "t")  # the dgx-a100-80gb inter-node figures
    assert comm.allreduce_s(8, 32, ib) == pytest.approx(56.5e-6, rel=0.1)
    assert comm.allreduce_s(MiB, 32, ib) == pytest.approx(143e-6, rel=0.1)


@given(size=st.floats(1.0, 1e12), ranks=st.integers(1, 10_000))
def test_ring_traffic_grows_with_p_towards_2s(size, ranks):
    now = comm.ring_allreduce_bytes_per_rank(size, ranks)
    after = comm.ring_allreduce_bytes_per_rank(size, ranks + 1)
    assert now <= after < 2 * size
    assert 2 * size - after == pytest.approx(2 * size / (ranks + 1))


links = st.builds(LinkSpec, st.floats(0.1, 1e4), st.floats(0.0, 100.0), st.just("t"))


@given(size=st.floats(0.0, 1e11), g=st.integers(1, 64), n=st.integers(1, 64), a=links, b=links)
def test_hierarchical_never_loses_to_a_flat_ring_when_inter_is_slower(size, g, n, a, b):
    intra = LinkSpec(max(a.bandwidth_gbps, b.bandwidth_gbps), min(a.latency_us, b.latency_us), "intra")
    inter = LinkSpec(min(a.bandwidth_gbps, b.bandwidth_gbps), max(a.latency_us, b.latency_us), "inter")
    hierarchical = comm.hierarchical_allreduce_s(size, g, n, intra, inter)
    assert hierarchical <= comm.ring_allreduce_s(size, g * n, inter) * (1 + 1e-9) + 1e-15


def test_a_link_calibrated_per_collective_prices_each_with_its_own_pair():
    import yaml

    from autoshard.cost.hardware import load_cluster
    from autoshard.ir.topology import Cluster

    link = LinkSpec(3.0, 100.0, "t", (("all_gather", 400.0, 0.5), ("reduce_scatter", 550.0, 0.33)))
    plain = LinkSpec(3.0, 100.0, "t")
    size = 2**22
    assert comm.all_gather_s(size, 2, link) == pytest.approx(400e-6 + size / 2 / 0.5e9)
    assert comm.reduce_scatter_s(size, 2, link) == pytest.approx(550e-6 + size / 2 / 0.33e9)
    assert comm.allreduce_s(size, 2, link) == comm.allreduce_s(size, 2, plain)  # no entry: the link's own pair
    base = load_cluster("local-cpu", devices_per_node=4, nodes=2)
    cluster = Cluster(base.name, 2, 4, base.device, link, base.inter_node, "gloo")
    assert cluster.group_link([0, 1, 2]).collectives == link.collectives  # inside a node: the calibrated pairs
    assert cluster.group_link([0, 4]).collectives == ()  # across nodes: the NIC link, not calibrated per collective
    assert Cluster.from_dict(yaml.safe_load(yaml.safe_dump(cluster.to_dict()))) == cluster


def test_bad_collective_entries_are_one_line():
    from autoshard.errors import AutoshardError
    from autoshard.ir.topology import Cluster

    d = __import__("autoshard.cost.hardware", fromlist=["x"]).load_cluster("local-cpu").to_dict()
    for bad, message in [
        ({"all_to_none": {"latency_us": 1, "bandwidth_gbps": 1}}, "unknown collective"),
        ({"p2p": {"latency_us": -1, "bandwidth_gbps": 1}}, "latency_us must be >= 0"),
        ({"p2p": {"latency_us": 1}}, "must be {latency_us, bandwidth_gbps}"),
    ]:
        d["intra_node"] = {**d["intra_node"], "collectives": bad}
        with pytest.raises(AutoshardError, match=message) as info:
            Cluster.from_dict(d)
        assert "\n" not in str(info.value)
