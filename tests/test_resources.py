"""Bounded resources: hostile or absurd inputs end in one line, in bounded time and memory.

Cluster files (alias bombs, devices, oversized files, duplicate keys, numbers too long to convert,
figures outside physical bounds; inputs in tests/bad_inputs/res_*), plans (numbers beyond their
bounds, symbolic expressions built to exhaust memory or the stack, a zero step time), the global
batch and what-if values, and clusters at the device limit. Every bad case exits 2 with one line
on stderr that names the problem and the fix, no traceback, and writes nothing. Each test carries a
pytest timeout: a case that hung or swapped would fail it.
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoshard.cli import main
from autoshard.cost.expressions import evaluate, evaluate_expression, parse_expression
from autoshard.cost.hardware import MAX_CLUSTER_FILE_BYTES, load_cluster
from autoshard.cost.symbolic import SYMBOLS
from autoshard.errors import AutoshardError
from autoshard.ir.specs import BOUNDS, MAX_DEVICES
from autoshard.ir.topology import Cluster
from autoshard.passes.planning.search import MAX_TOTAL_PS, _time_scale
from autoshard.passes.planning.stage_cuts import PS_PER_S
from autoshard.passes.planning.strategies import MAX_GLOBAL_BATCH, divisors, microbatch_sizes

ROOT = Path(__file__).resolve().parent.parent
B = "tests/bad_inputs/"
MLP = "tests/models/mlp.py:build"
LOCAL = ["--cluster", "local-cpu", "--devices-per-node", "2", "--global-batch", "8"]


def cluster_args(cluster: str, *extra: str) -> list[str]:
    return ["plan", MLP, "--cluster", cluster, "--global-batch", "8", *extra]


def run_cli(capsys, argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_exit_2(code, out, err, message):
    assert code == 2, (code, out, err)
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert "Traceback" not in out + err
    assert len(err) < 600, err  # a value in the message is shown short, whatever its size


# ---------------------------------------------------------------------------- cluster files

CLUSTER_FILES = [
    (B + "res_billion_laughs.yaml", "aliases expand to more than 100,000 values"),
    (B + "res_self_alias.yaml", "aliases expand to more than 100,000 values"),
    (B + "res_duplicate_key.yaml", "duplicate key 'nodes' at line 4"),
    (B + "res_duplicate_nested_key.yaml", "duplicate key 'bandwidth_gbps' at line 3"),
    (B + "res_huge_integer.yaml", "a number with 5000 digits at line 3"),
    (B + "res_long_float.yaml", "a number with 401 digits at line 3"),
    (
        B + "res_latency_1e300.yaml",
        "intra_node.latency_us must be between 0 and 1e+07 µs (physical bounds), got 1e+300",
    ),
    (B + "res_peak_1e-300.yaml", "device.peak_tflops must be between 0.001 and 1e+06 TFLOP/s"),
    (B + "res_bandwidth_above_bound.yaml", "inter_node.bandwidth_gbps must be between 0.001 and 1e+06 GB/s"),
    (B + "res_memory_above_bound.yaml", "device.memory_bytes must be between 1 and 1,125,899,906,842,624 bytes"),
    (B + "res_efficiency_tiny.yaml", "device.matmul_efficiency must be between 0.001 and 1"),
    (B + "res_host_overhead_huge.yaml", "host.op_forward_us must be between 0 and 1e+07"),
    (B + "res_collective_latency_huge.yaml", "collectives.all_reduce.latency_us must be between 0 and 1e+07"),
    (B + "res_nodes_above_limit.yaml", "1,048,576 devices, more than autoshard plans for (262,144)"),
    ("/dev/zero", "is not a regular file"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cluster, message", CLUSTER_FILES, ids=[c.replace(B, "") for c, _ in CLUSTER_FILES])
def test_cluster_file_beyond_bounds_is_one_line(in_repo, capsys, tmp_path, cluster, message):
    code, out, err = run_cli(capsys, cluster_args(cluster, "-o", str(tmp_path / "plan.json")))
    assert_one_line_exit_2(code, out, err, message)
    assert list(tmp_path.iterdir()) == []
    assert "fix:" in err


@pytest.mark.timeout(60)
def test_a_pipe_is_refused_without_waiting_for_a_writer(in_repo, capsys, tmp_path):
    fifo = tmp_path / "cluster.yaml"
    os.mkfifo(fifo)
    code, out, err = run_cli(capsys, cluster_args(str(fifo), "-o", str(tmp_path / "plan.json")))
    assert_one_line_exit_2(code, out, err, "is not a regular file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cluster.yaml"]


@pytest.mark.timeout(60)
def test_an_oversized_cluster_file_is_refused_before_it_is_parsed(in_repo, capsys, tmp_path):
    big = tmp_path / "cluster.yaml"
    big.write_text("preset: dgx-h100\n" + "# padding\n" * (MAX_CLUSTER_FILE_BYTES // 10 + 1))
    code, out, err = run_cli(capsys, cluster_args(str(big), "-o", str(tmp_path / "plan.json")))
    assert_one_line_exit_2(code, out, err, "more than a cluster file holds (1,048,576)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cluster.yaml"]


def test_aliases_within_the_bound_still_load(tmp_path):
    """A shared section written once and referred to twice is a legitimate cluster file."""
    path = tmp_path / "cluster.yaml"
    path.write_text("preset: dgx-h100\nintra_node: &link {bandwidth_gbps: 100, latency_us: 5}\ninter_node: *link\n")
    cluster = load_cluster(str(path))
    assert cluster.intra_node.bandwidth_gbps == cluster.inter_node.bandwidth_gbps == 100


@pytest.mark.parametrize(
    "section, field, low, high",
    [
        ("intra_node", "bandwidth_gbps", *BOUNDS["bandwidth"][:2]),
        ("inter_node", "latency_us", *BOUNDS["latency"][:2]),
        ("device", "peak_tflops", *BOUNDS["tflops"][:2]),
        ("device", "memory_bytes", *BOUNDS["memory"][:2]),
    ],
)
def test_physical_bounds_are_inclusive(tmp_path, section, field, low, high):
    path = tmp_path / "cluster.yaml"
    for value, loads in ((low, True), (high, True), (high * 10, False)):
        path.write_text(f"preset: dgx-h100\n{section}: {{{field}: {value!r}}}\n")
        if loads:
            assert getattr(getattr(load_cluster(str(path)), section), field) == value
        else:
            with pytest.raises(AutoshardError, match=f"{section}.{field} must be between"):
                load_cluster(str(path))


@pytest.mark.timeout(300)
def test_extreme_clusters_within_bounds_plan_or_say_why(in_repo, capsys, tmp_path):
    """The bounds' corners (slowest device and links, fastest, mixed) plan, or end in one line."""
    corners = {
        "slow": (1e-3, 2**50, 1e-3, 1e-3, 1e-3, 1e7),
        "fast": (1e6, 2**50, 1e6, 1.0, 1e6, 0.0),
        "mixed": (1e-3, 1, 1e6, 1e-3, 1e-3, 0.0),
    }
    for name, (peak, memory, hbm, efficiency, link, latency) in corners.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(
            f"preset: dgx-h100\nnodes: 2\ndevice: {{peak_tflops: {peak!r}, memory_bytes: {memory}, "
            f"memory_bandwidth_gbps: {hbm!r}, matmul_efficiency: {efficiency!r}}}\n"
            f"intra_node: {{bandwidth_gbps: {link!r}, latency_us: {latency!r}}}\n"
            f"inter_node: {{bandwidth_gbps: {link!r}, latency_us: {latency!r}}}\n"
        )
        for extra in ([], ["--tp", "2"], ["--pp", "2"]):
            code, out, err = run_cli(
                capsys,
                ["plan", "examples/gpt.py:build", "--cluster", str(path), "--global-batch", "4096", "--json", *extra],
            )
            assert "Traceback" not in out + err
            if code == 0:
                assert math.isfinite(json.loads(out)["predicted"]["step_time_s"])
            else:
                assert_one_line_exit_2(code, out, err, "no plan fits in memory")


def test_stage_cut_times_are_scaled_under_int64():
    assert _time_scale([1.0, 2.0], [0.5, 0.0]) == 1.0  # ordinary steps: unchanged plans
    huge = [3e7] * 40  # 40 units of a year each
    scale = PS_PER_S * _time_scale(huge, [0.0] * 40)
    assert sum(round(t * scale) for t in huge) <= MAX_TOTAL_PS < 2**63


# ---------------------------------------------------------------------------- cluster size


@pytest.mark.timeout(120)
def test_group_link_never_walks_the_graph_of_a_cluster_at_the_limit():
    cluster = load_cluster("dgx-h100", nodes=MAX_DEVICES // 8)
    assert cluster.world_size == MAX_DEVICES
    link = cluster.group_link(list(range(0, MAX_DEVICES, 8)))
    assert link.bandwidth_gbps == cluster.inter_node.bandwidth_gbps
    assert cluster.group_link(list(range(8))).bandwidth_gbps == cluster.intra_node.bandwidth_gbps
    assert "graph" not in vars(cluster)  # the networkx graph is built only when asked for


@settings(max_examples=150, derandomize=True, deadline=None, database=None)
@given(
    nodes=st.integers(1, 5),
    per_node=st.integers(1, 6),
    picks=st.lists(st.integers(0, 10**6), min_size=1, max_size=6),
    bandwidths=st.tuples(st.sampled_from([0.5, 50.0, 450.0]), st.sampled_from([0.5, 50.0, 450.0])),
    latencies=st.tuples(st.sampled_from([0.0, 3.0, 8.0]), st.sampled_from([0.0, 3.0, 8.0])),
)
def test_group_link_is_the_graphs_bottleneck(nodes, per_node, picks, bandwidths, latencies):
    d = load_cluster("dgx-h100").to_dict()
    d.update(nodes=nodes, devices_per_node=per_node)
    d["intra_node"] = {**d["intra_node"], "bandwidth_gbps": bandwidths[0], "latency_us": latencies[0]}
    d["inter_node"] = {**d["inter_node"], "bandwidth_gbps": bandwidths[1], "latency_us": latencies[1]}
    cluster = Cluster.from_dict(d)
    ranks = [p % cluster.world_size for p in picks]
    assert cluster.group_link(ranks) == cluster.group_link_by_graph(ranks)


@pytest.mark.timeout(300)
def test_a_cluster_at_the_device_limit_plans(in_repo, capsys, tmp_path):
    out = tmp_path / "plan.json"
    code, _, err = run_cli(
        capsys,
        [
            "plan",
            MLP,
            "--cluster",
            "dgx-h100",
            "--nodes",
            str(MAX_DEVICES // 8),
            "--global-batch",
            str(MAX_DEVICES),
            "-o",
            str(out),
        ],
    )
    assert code == 0, err
    mesh = json.loads(out.read_text())["decisions"]["mesh"]
    assert mesh["dp"] * mesh["tp"] * mesh["pp"] == MAX_DEVICES
    code, _, err = run_cli(
        capsys,
        [
            "plan",
            MLP,
            "--cluster",
            "dgx-h100",
            "--nodes",
            str(MAX_DEVICES // 8 + 1),
            "--global-batch",
            "8",
            "-o",
            str(tmp_path / "other.json"),
        ],
    )
    assert_one_line_exit_2(code, "", err, f"more than autoshard plans for ({MAX_DEVICES:,})")
    assert not (tmp_path / "other.json").exists()


# ---------------------------------------------------------------------------- global batch

GLOBAL_BATCHES = [
    (str(10**30), "--global-batch (a number of 31 digits) is more than autoshard plans for (1,073,741,824 = 2^30"),
    (str(MAX_GLOBAL_BATCH + 1), "--global-batch 1,073,741,825 is more than autoshard plans for"),
    ("1e30", "invalid int value: '1e30'"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value, message", GLOBAL_BATCHES, ids=["10^30", "2^30+1", "1e30"])
def test_global_batch_beyond_the_bound_is_one_line(in_repo, capsys, tmp_path, value, message):
    argv = ["plan", MLP, "--cluster", "local-cpu", "--global-batch", value, "-o", str(tmp_path / "plan.json")]
    code, out, err = run_cli(capsys, argv)
    assert_one_line_exit_2(code, out, err, message)
    assert list(tmp_path.iterdir()) == []


@settings(max_examples=200, derandomize=True, deadline=None, database=None)
@given(st.integers(1, 20_000))
def test_divisors_are_every_divisor_in_order(n):
    assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]


@pytest.mark.timeout(30)
def test_divisors_at_the_bound_take_square_root_steps():
    assert divisors(MAX_GLOBAL_BATCH) == [2**k for k in range(31)]
    assert divisors(1_073_741_789) == [1, 1_073_741_789]  # the largest prime below 2^30
    assert microbatch_sizes(MAX_GLOBAL_BATCH, None)[:3] == [2**30, 2**29, 2**28]
    assert microbatch_sizes(2 * 3 * 5 * 7, 35) == [35]


# ---------------------------------------------------------------------------- plans


@pytest.fixture(scope="module")
def good_plan(tmp_path_factory):
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        import autoshard

        plan = autoshard.plan(MLP, cluster="local-cpu", devices_per_node=2, global_batch=8)
    finally:
        os.chdir(cwd)
    return json.loads(plan.to_json())


def _set(path, value):
    def edit(d):
        for key in path[:-1]:
            d = d[key]
        d[path[-1]] = value

    return edit


PLAN_NUMBERS = [  # (edit of the plan's JSON text or dict, message)
    (
        _set(["predicted", "memory", "peak_bytes"], 10**400),
        "'predicted.memory.peak_bytes' must be an integer >= 0, got <a number of 401 digits>",
    ),
    (("global_batch", "7" * 5000), "'global_batch' must be an integer >= 1, got <a number of 5000 digits>"),
    (("step_time_s", "1" * 400 + ".5"), "'predicted.step_time_s' must be a finite number, got inf"),
    (_set(["model", "params"], 2**61), "'model.params' must be an integer of at most 2^60"),
    (_set(["decisions", "num_microbatches"], 2**41), "'decisions.num_microbatches' must be an integer of at most 2^40"),
    (_set(["predicted", "tokens_per_s"], 1e300), "'predicted.tokens_per_s' must be a number of at most 1e30"),
    (
        _set(["review", "search", "candidates"], 10**40),
        "'review.search.candidates' must be a finite number, got <a number of 41",
    ),
    (_set(["cluster", "intra_node", "latency_us"], 1e300), "intra_node.latency_us must be between 0 and 1e+07"),
    (_set(["cluster", "device", "peak_tflops"], 1e-300), "device.peak_tflops must be between 0.001 and 1e+06"),
]


def _write(good_plan, edit, path: Path) -> Path:
    data = copy.deepcopy(good_plan)
    if callable(edit):
        edit(data)
        path.write_text(json.dumps(data))
    else:
        key, digits = edit
        text = json.dumps(data)
        head, sep, tail = text.partition(f'"{key}": ')
        value, rest = tail.split(",", 1)
        path.write_text(head + sep + digits + "," + rest)
    return path


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "edit, message", PLAN_NUMBERS, ids=[m.split("'")[1] if "'" in m else m[:30] for _, m in PLAN_NUMBERS]
)
def test_plan_numbers_beyond_bounds_are_one_line(in_repo, capsys, tmp_path, good_plan, edit, message):
    plan = _write(good_plan, edit, tmp_path / "tampered.json")
    for argv in (
        ["inspect", str(plan)],
        ["inspect", str(plan), "--what-if", "global_batch=16"],
        ["compile", str(plan), "-o", str(tmp_path / "train.py")],
    ):
        code, out, err = run_cli(capsys, argv)
        assert_one_line_exit_2(code, out, err, message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tampered.json"]


EXPRESSIONS = [  # (the step time's expression, message): inspect --what-if
    ("(" * 8 + "B" + "**16)" * 8, "is not a finite number"),  # 16^8 = 2^32: the memory bomb, in floats
    ("(" * 6 + "9" + "**16)" * 6, "a power of a number"),  # exact 9^(16^6) would never finish
    ("-" * 100_000 + "1", "an expression of 100,001 characters (at most 20,000)"),
    ("+".join(["B"] * 3000), "nested"),
    ("(" * 250 + "B" + ")" * 250, "not an expression: too many nested parentheses"),
    ("-(" * 150 + "B" + ")" * 150, "an expression nested more than 100 levels deep"),
    ("0", "the step time is 0 s"),
    ("B/(dp - dp)", "divides by zero"),
    ("B*(dp - dp)**(-1)", "divides by zero"),
    ("1" * 5000, "a number of 5000 digits in an expression (at most 30)"),
    ("1" * 400 + ".0", "a number of 400 digits"),
    ("1e300*B", "the number 1e+300 in an expression (at most 1e+30"),
    ("B**dp", "is not a number of at most 16"),
    ("B**17", "is not a number of at most 16"),
    ("Max()", "Max() of nothing"),
    ("Piecewise((B, dp))", "must be Eq(...) or True"),
    ("Eq(B, 1) + 1", "a condition where a number belongs"),
    ("__import__('os').system('true')", "unexpected"),
    ("B.real", "unexpected"),
    ("x + 1", "unexpected name 'x'"),
    ("(-B)**0.5", "a fractional power of a negative number"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("expression, message", EXPRESSIONS, ids=[m[:40] for _, m in EXPRESSIONS])
def test_hostile_expression_is_one_line(in_repo, capsys, tmp_path, good_plan, expression, message):
    plan = _write(good_plan, _set(["review", "symbolic", "step_time_s"], expression), tmp_path / "plan.json")
    code, out, err = run_cli(capsys, ["inspect", str(plan), "--what-if", "global_batch=16"])
    assert_one_line_exit_2(code, out, err, message)
    assert "symbolic cost is damaged" in err and "autoshard plan" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "symbols, message",
    [
        ({"B": 10**25}, "symbol B must be an integer in 1 .. 1,099,511,627,776"),
        ({"dp": 0}, "symbol dp must be an integer"),
        ({"B": 2.5}, "symbol B must be an integer"),
        ({"q": 1}, "unknown symbol 'q'"),
    ],
)
def test_damaged_symbols_are_one_line(in_repo, capsys, tmp_path, good_plan, symbols, message):
    data = copy.deepcopy(good_plan)
    data["review"]["symbolic"]["symbols"].update(symbols)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(data))
    code, out, err = run_cli(capsys, ["inspect", str(plan), "--what-if", "dp=1"])
    assert_one_line_exit_2(code, out, err, message)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "what_if, message",
    [
        ("global_batch=" + "9" * 5000, "global_batch must be at most 1,099,511,627,776 (2^40)"),
        ("dp=1099511627777", "dp must be at most 1,099,511,627,776"),
        ("seq_len=-4", "seq_len must be a positive integer"),
    ],
)
def test_what_if_values_beyond_the_bound_are_one_line(in_repo, capsys, tmp_path, good_plan, what_if, message):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(good_plan))
    code, out, err = run_cli(capsys, ["inspect", str(plan), "--what-if", what_if])
    assert_one_line_exit_2(code, out, err, message)


def test_float_evaluation_agrees_with_sympy(good_plan):
    """The bounded evaluator gives sympy's figures (to rounding) on every expression of a real plan."""
    symbolic = good_plan["review"]["symbolic"]
    texts = [
        symbolic["step_time_s"],
        symbolic["memory_peak_bytes"],
        symbolic["model_flops_per_sample"],
        *symbolic["parts"].values(),
        *symbolic["memory"].values(),
    ]
    for point in ({}, {"B": 64, "s": 32}, {"dp": 1, "tp": 2, "pp": 2, "b": 2}):
        values = {**symbolic["symbols"], **point}
        subs = {SYMBOLS[k]: v for k, v in values.items()}
        for text in texts:
            exact = float(parse_expression(text).xreplace(subs))
            assert evaluate_expression(text, values) == pytest.approx(exact, rel=1e-12, abs=1e-300)
    assert evaluate(symbolic, {})["step_time_s"] == pytest.approx(good_plan["predicted"]["step_time_s"], rel=1e-5)


@pytest.mark.timeout(120)
def test_infeasible_hint_never_suggests_a_cluster_beyond_the_limit(in_repo, capsys, tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("preset: dgx-h100\ndevice: {memory_bytes: 1}\n")
    code, out, err = run_cli(
        capsys, ["plan", MLP, "--cluster", str(path), "--global-batch", "8", "-o", str(tmp_path / "plan.json")]
    )
    assert_one_line_exit_2(code, out, err, f"more than the {MAX_DEVICES:,} autoshard plans for")
    assert "--nodes" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cluster.yaml"]


@pytest.mark.timeout(60)
def test_a_profile_key_too_long_to_convert_is_one_line(in_repo, capsys, tmp_path):
    import yaml

    data = yaml.safe_load((ROOT / "tests/clusters/cpu4_shared_cores.yaml").read_text())
    times = data["profiles"][0]["times"]
    times["9" * 5000] = times[1]  # a quoted string key: int() of it would raise
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    code, out, err = run_cli(capsys, cluster_args(str(path), "-o", str(tmp_path / "plan.json")))
    assert_one_line_exit_2(code, out, err, "profiles hold a value that is not a measured figure")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cluster.yaml"]


# ---------------------------------------------------------------------------- plan files


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", ["inspect", "compile", "verify"])
def test_a_plan_that_is_a_device_is_refused_unread(capsys, command):
    code, out, err = run_cli(capsys, [command, "/dev/zero"])
    assert_one_line_exit_2(code, out, err, "is not a regular file")


@pytest.mark.timeout(60)
def test_an_oversized_plan_is_refused_unread(capsys, tmp_path):
    big = tmp_path / "plan.json"
    with open(big, "wb") as f:
        f.truncate(65 * 2**20)  # sparse: no disk, and reading it would take the time and memory refused here
    code, out, err = run_cli(capsys, ["inspect", str(big)])
    assert_one_line_exit_2(code, out, err, "more than a plan can be")
