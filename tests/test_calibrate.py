"""`autoshard calibrate`: the alpha-beta fit, the cluster file it writes, and the command itself."""

import os
import subprocess
import sys

import pytest

from autoshard.calibrate import Measurements, _calibration, build_cluster, write_cluster_file
from autoshard.cli import main
from autoshard.cost import comm
from autoshard.cost.calibrate import COLLECTIVES, Sample, coefficients, fit_link, predict_s
from autoshard.cost.hardware import host_memory_bytes, load_cluster
from autoshard.errors import AutoshardError
from autoshard.ir.topology import LinkSpec

SIZES = [4096 * 4**i for i in range(8)]  # 4 KiB ... 64 MiB
LINK = LinkSpec(bandwidth_gbps=2.5, latency_us=37.0, source="test")


def synthetic(link, ranks=(2, 4), collectives=COLLECTIVES):
    return [Sample(c, p, s, predict_s(c, p, s, link)) for c in collectives for p in ranks for s in SIZES]


@pytest.mark.parametrize("ranks", [2, 3, 4, 8])
def test_coefficients_are_comm_formulas(ranks):
    for alpha_us, gbps, size in [(3.0, 450.0, 2**20), (50.0, 1.5, 12345.0)]:
        link = LinkSpec(gbps, alpha_us, "test")
        for c in COLLECTIVES:
            k_alpha, k_beta = coefficients(c, ranks)
            expected = predict_s(c, ranks, size, link)
            assert k_alpha * alpha_us * 1e-6 + k_beta * size / (gbps * 1e9) == pytest.approx(expected)
    assert coefficients("all_reduce", 8) == (6.0, pytest.approx(1.75))  # tree: 2·log2(8); 2(p−1)/p
    assert predict_s("p2p", ranks, 1e6, LINK) == comm.p2p_s(1e6, LINK)


@pytest.mark.parametrize("collectives", [COLLECTIVES, ("all_reduce",), ("p2p",), ("all_gather", "broadcast")])
def test_fit_recovers_alpha_and_bandwidth_within_1_percent(collectives):
    fit = fit_link(synthetic(LINK, collectives=collectives))
    assert fit.latency_us == pytest.approx(LINK.latency_us, rel=0.01)
    assert fit.bandwidth_gbps == pytest.approx(LINK.bandwidth_gbps, rel=0.01)
    assert fit.max_rel_error < 1e-6


def test_fit_with_noise_and_no_latency():
    noisy = [
        Sample(s.collective, s.ranks, s.size_bytes, s.time_s * (1.02 if i % 2 else 0.98))
        for i, s in enumerate(synthetic(LinkSpec(10.0, 0.0, "test")))
    ]
    fit = fit_link(noisy)
    assert fit.latency_us >= 0 and fit.bandwidth_gbps == pytest.approx(10.0, rel=0.03)
    assert 0.015 < fit.max_rel_error < 0.06


def test_times_that_do_not_grow_cannot_be_fitted():
    flat = [Sample("all_reduce", 2, s, 1e-3 * (2 - i / 10)) for i, s in enumerate(SIZES)]
    with pytest.raises(AutoshardError, match="do not grow"):
        fit_link(flat)


def fake_measurements(ranks=2):
    return Measurements(
        backend="gloo",
        ranks=ranks,
        threads=1,
        device_name="cpu-process",
        memory_bytes=host_memory_bytes() // ranks,
        dtype="float32",
        comm=synthetic(LINK, ranks=(ranks,)) if ranks > 1 else [],
        matmul_s={512: 2 * 512**3 / 50e9, 1024: 2 * 1024**3 / 60e9},
        elementwise_bytes=3 * 2**26,
        elementwise_s=3 * 2**26 / 12e9,
    )


def scaled(m, factor):
    """``m`` with every time × ``factor``: the same calibration in a slower (> 1) or faster period."""
    from dataclasses import replace

    return replace(
        m,
        comm=[replace(s, time_s=s.time_s * factor) for s in m.comm],
        matmul_s={n: t * factor for n, t in m.matmul_s.items()},
        elementwise_s=m.elementwise_s * factor,
        host={"fwd": 2e-3 * factor, "tensors": 26, "pipeline": {"2": 5e-3 * factor}},
        models=[{"times": {"4": {"none": [1e-2 * factor, 3e-2 * factor]}}, "optimizer_s": 2e-3 * factor}],
    )


def test_repeats_take_every_time_s_median_before_the_fits():
    """``--repeats 3``: one calibration in a period 1.6 times slower moves nothing; every time (collectives, matmuls,
    the elementwise op, host probes, model times, nested) is the median of the three, counts stay, and the link is
    fitted to the medians."""
    from dataclasses import replace

    from autoshard.calibrate import median_of_repeats

    base = fake_measurements()
    runs = [scaled(base, 1.0), scaled(base, 1.6), scaled(base, 1.02)]
    m = median_of_repeats(runs)
    expected = scaled(base, 1.02)
    assert m.repeats == 3 and len(m.comm) == len(base.comm)
    assert [s.time_s for s in m.comm] == pytest.approx([s.time_s for s in expected.comm])
    assert m.matmul_s == pytest.approx(expected.matmul_s) and m.elementwise_s == pytest.approx(expected.elementwise_s)
    assert m.host["tensors"] == 26 and m.host["fwd"] == pytest.approx(2.04e-3)
    assert m.host["pipeline"]["2"] == pytest.approx(5.1e-3)
    assert m.models[0]["times"]["4"]["none"] == pytest.approx([1.02e-2, 3.06e-2])
    cluster = _calibration(replace(m, host={}, models=[]), quick=True, wall_s=1.0).cluster  # the link and device
    assert cluster.intra_node.latency_us == pytest.approx(37.0 * 1.02, rel=1e-3)
    assert cluster.device.peak_tflops == pytest.approx(0.055 / 1.02, rel=1e-3)
    assert " --repeats 3 " in cluster.intra_node.source
    assert median_of_repeats([base]) is base


def test_a_model_probe_one_repeat_lacks_is_the_median_of_the_others():
    """A model probe that failed in one calibration of ``--repeats 3`` (``_pipeline_times`` gives None) is the median of
    the calibrations that have it, whichever repeat failed; one none of them has stays None."""
    from dataclasses import replace

    from autoshard.calibrate import median_of_repeats

    runs = [scaled(fake_measurements(), f) for f in (1.0, 1.6, 1.02)]
    for failed in range(3):
        tried = [
            replace(r, models=[{**r.models[0], "pipeline": None if i == failed else {"2": 5e-3 * (1 + i)}, "tp": None}])
            for i, r in enumerate(runs)
        ]
        model = median_of_repeats(tried).models[0]
        present = [5e-3 * (1 + i) for i in range(3) if i != failed]
        assert model["pipeline"]["2"] == pytest.approx(sum(present) / 2) and model["tp"] is None
        assert model["times"]["4"]["none"] == pytest.approx([1.02e-2, 3.06e-2])
    left_out = [replace(r, models=[{**r.models[0], "tp": {"sp": 0.1 * i}}]) for i, r in enumerate(runs)]
    del left_out[0].models[0]["tp"]  # a key the first calibration left out is still the median of the others
    assert median_of_repeats(left_out).models[0]["tp"] == {"sp": pytest.approx(0.15)}


def test_cluster_file_round_trips_through_load_cluster(tmp_path):
    cal = _calibration(fake_measurements(), quick=True, wall_s=1.0)
    path = write_cluster_file(tmp_path / "c.yaml", cal, "autoshard calibrate --quick -o c.yaml")
    cluster = load_cluster(str(path))
    assert cluster == cal.cluster
    assert (cluster.nodes, cluster.devices_per_node, cluster.backend) == (1, 2, "gloo")
    assert cluster.intra_node.latency_us == pytest.approx(37.0, rel=1e-3)
    assert cluster.intra_node.bandwidth_gbps == pytest.approx(2.5, rel=1e-3)
    assert cluster.device.peak_tflops == pytest.approx(0.055, rel=1e-3)  # median of 50 and 60 GFLOP/s
    assert cluster.device.matmul_efficiency == 1.0 and cluster.device.memory_bandwidth_gbps == pytest.approx(12.0)
    assert cluster.device.memory_bytes == host_memory_bytes() // 2
    assert cluster.intra_node.source.startswith("measured by autoshard calibrate --quick on ")
    assert "load 0.0 on 1 CPUs at the start" in cluster.device.source
    assert cluster.host.shared_cores == 1.0  # 2 ranks of 1 thread on 1 CPU: they share it (cost.pipeline_step)
    assert "fit error max 0%" in cluster.intra_node.source and "not measured" in cluster.inter_node.source
    assert max(abs(e) for e in cal.roofline_errors().values()) < 0.1
    assert not list(tmp_path.glob(".*tmp"))


def test_one_rank_keeps_the_preset_link():
    cluster = build_cluster(fake_measurements(ranks=1), None, quick=False)
    assert cluster.intra_node.source.startswith("not measured (one rank)") and cluster.devices_per_node == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-o", "no/such/dir/cluster.yaml"], "output directory 'no/such/dir' does not exist"),
        (["-o", "cluster.json"], "must end in .yaml or .yml"),
        (["-o", "c.yaml", "--devices-per-node", "0"], "--devices-per-node 0 must be a positive integer"),
        (["-o", "c.yaml", "--repeats", "0"], "--repeats '0' must be a whole number from 1 to 9"),
        (["-o", "c.yaml", "--repeats", "three"], "--repeats 'three' must be a whole number from 1 to 9"),
        ([], "the following arguments are required: -o/--output"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    code = main(["calibrate", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and message in err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err + out
    assert not list(tmp_path.iterdir())


@pytest.mark.e2e
def test_calibrate_quick_writes_a_cluster_that_plans(in_repo, tmp_path, capsys):
    path = tmp_path / "cluster.yaml"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "autoshard.cli",
            "calibrate",
            "--quick",
            "-o",
            str(path),
            "--model",
            "examples/gpt.py:build",
            "--microbatch-sizes",
            "1,2",
        ],
        capture_output=True,
        text=True,
        # about 120 CPU-s alone (80 s of wall on 2 idle cores); beside the 4-rank launch's ranks on the other worker
        # it ran past 300 s: the bound is for a hang, not for speed
        timeout=1200,
        cwd=in_repo,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "intra_node α, B" in proc.stdout and f"wrote {path}" in proc.stdout
    cluster = load_cluster(str(path))
    assert (cluster.nodes, cluster.devices_per_node, cluster.backend) == (1, 2, "gloo")
    assert cluster.intra_node.source.startswith("measured by autoshard calibrate --quick on ")
    assert cluster.device.peak_tflops > 0 and cluster.device.memory_bandwidth_gbps > 0
    assert cluster.host.measured and cluster.host.op_forward_us > 0 and cluster.host.fsdp_unit_zero3_us > 0
    assert cluster.host.shared_cores == max(1, (os.cpu_count() or 1) // int(os.environ.get("OMP_NUM_THREADS", "1")))
    (profile,) = cluster.profiles
    assert profile.model == "examples/gpt.py:build" and sorted(profile.times) == [1, 2]
    assert all(0 < fwd < fwd_bwd for modes in profile.times.values() for fwd, fwd_bwd in modes.values())
    # the step loop: the work around a step's parts and the wait for the slowest rank that its loss's all-reduce makes
    # it pay (its sync, a part of it); no upper bound: on a machine as loaded as the test suite's the wait is what the
    # load makes it (52 ms against 11 ms of parts, once)
    assert profile.optimizer_s > 0 and profile.step_loop_s >= 0
    assert 0 <= profile.step_sync_s <= profile.step_loop_s
    assert "step_loop_s" in path.read_text() or profile.step_loop_s == 0
    assert profile.pipeline_microbatch_s is not None and profile.pipeline_microbatch_s >= 0  # its own pipeline
    assert profile.pipeline_step_s is not None and profile.pipeline_step_s >= 0
    assert profile.wide_pipeline_stages is None  # 2 ranks: the pairs' pipeline is the widest there is
    assert 0 <= cluster.host.tp_forward_share <= 1
    # its own tensor-parallel layouts at tp 2: DTensor's time per module, and the share a recomputed forward reruns
    assert profile.tp_module_s is not None and profile.tp_module_s >= 0 and profile.sequence_module_s >= 0
    assert profile.tp_forward_share is None or 0 <= profile.tp_forward_share <= 1
    assert "fsdp_accumulate_unit_us" in path.read_text()  # FSDP2's hooks on a micro-batch that syncs nothing
    code = main(["plan", "examples/gpt.py:build", "--cluster", str(path), "--global-batch", "8", "--json"])
    out, _ = capsys.readouterr()
    assert code == 0 and f'"name": "{cluster.name}"' in out


def test_gpu_kernels_are_timed_in_batches_per_launch(monkeypatch):
    """On a GPU a kernel's figure is its time per launch in back-to-back batches (a step queues its kernels),
    not launch + synchronise per call: the op runs in batches of ⌈KERNEL_BATCH_S / t_warm⌉, and the figure
    divides the batch's time by its size. A fake clock: a launch takes 0.5 ms, a synchronise 2 ms (real sleeps
    of that size read several times longer on a loaded machine)."""
    import types

    from autoshard import calibrate_bench

    launch_s, sync_s = 5e-4, 2e-3  # each launch's own time; what a synchronise costs after a call
    clock = {"now": 0.0}

    def advance(seconds: float) -> None:
        clock["now"] += seconds

    monkeypatch.setattr(calibrate_bench.time, "perf_counter", lambda: clock["now"])
    monkeypatch.setattr(
        calibrate_bench, "KERNEL_BATCH_S", 0.02
    )  # batches of ⌈0.02 / 2.5 ms⌉ launches (8, or 9 by rounding)
    launches = []
    bench = calibrate_bench.Bench.__new__(calibrate_bench.Bench)
    bench.gpu, bench.torch = True, types.SimpleNamespace()
    bench.s = calibrate_bench.Settings.for_backend("nccl", quick=True)
    bench.dist = types.SimpleNamespace(barrier=lambda: None)
    bench._max_over_ranks = lambda values: values
    bench._sync = lambda: advance(sync_s)
    t = bench._time_kernel(lambda: (launches.append(1), advance(launch_s)))
    assert len(launches) > 2 * (2 + bench.s.min_calls)  # batches, not one launch per call
    assert launch_s < t <= launch_s + sync_s / 8  # per launch of a batch of 8 or 9; a lone launch would read 2.5 ms


def test_a_probe_is_timed_as_the_ranks_take_it_together_a_collective_per_call(monkeypatch):
    """4 ranks on 2 cores, where the scheduler runs two ranks' n calls of a block (1 ms each) while the other two
    wait, then theirs: seen from a waiting rank, a block is one call of n + 1 ms and n − 1 calls of 1 ms. Every
    call but one reads 1 ms, so the median over calls (a collective's ``_time_op``) is 1 ms; a host probe's or a
    model's part (``_time_probe``, ``_time_model_round``) is the block's time per call, 2 ms: the 4 ranks' 4n
    calls on 2 cores, as a step that syncs them once takes them. Each block starts at a barrier."""
    import math
    import types

    from autoshard import calibrate_bench

    clock = {"now": 0.0, "waits": False, "barriers": 0}
    bench = calibrate_bench.Bench.__new__(calibrate_bench.Bench)
    bench.gpu, bench.ranks = False, 4
    bench.s = calibrate_bench.Settings.for_backend("gloo", quick=True)
    n = math.ceil(bench.s.max_calls / calibrate_bench.PROBE_BLOCKS)  # 1 ms calls: as many as the settings allow

    def barrier():
        clock["waits"], clock["barriers"] = True, clock["barriers"] + 1

    def call():  # 1 ms of a core; the first after a barrier also waits for the other pair's n calls
        clock["now"] += (1e-3 * n if clock["waits"] else 0.0) + 1e-3
        clock["waits"] = False

    monkeypatch.setattr(calibrate_bench.time, "perf_counter", lambda: clock["now"])
    bench.dist = types.SimpleNamespace(barrier=barrier)
    bench._sync = lambda: None
    bench._max_over_ranks = lambda values: values  # this rank, a waiting one, is the slowest
    assert bench._time_op(call) == pytest.approx(1e-3)
    clock["barriers"] = 0
    assert bench._time_probe(call) == pytest.approx(2e-3)
    assert clock["barriers"] == calibrate_bench.PROBE_BLOCKS
    assert bench._time_model_round(call) == pytest.approx(2e-3)


def test_gpu_peak_is_the_largest_matmul_cpu_peak_the_median():
    """GPUs: the 8192³ matmul's throughput (the eager model's η_large; smaller shapes it scales down itself);
    CPU ranks: the median over the sizes (the fused roofline's one η)."""
    from dataclasses import replace

    tflops = {2048: 660e12, 4096: 790e12, 8192: 795e12}
    gpu = replace(
        fake_measurements(ranks=1),
        backend="nccl",
        dtype="bfloat16",
        device_name="NVIDIA H200",
        matmul_s={n: 2 * n**3 / f for n, f in tflops.items()},
    )
    assert build_cluster(gpu, None, quick=True).device.peak_tflops == pytest.approx(795, rel=1e-3)
    cpu = replace(gpu, backend="gloo", dtype="float32")
    assert build_cluster(cpu, None, quick=True).device.peak_tflops == pytest.approx(790, rel=1e-3)
