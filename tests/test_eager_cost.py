"""The eager-mode cost model on GPUs (``cost.eager``, ``Runtime.kernels``).

Each test pins one mechanism to its formula: host dispatch hidden behind the micro-batch's queued kernels, the fp32 loss's memory (b·s·V·4 bytes per copy), elementwise kernels at T_KERNEL + bytes / W,
matmul efficiency by tile and wave quantization, FlashAttention-2's utilization, torch's foreach AdamW
bytes; and that Megatron-LM's runtime and CPU ranks keep the fused roofline.
"""

from dataclasses import replace

import pytest

from autoshard.cost import eager
from autoshard.cost.compute import BACKWARD_TO_FORWARD, op_backward_s, op_forward_s
from autoshard.cost.hardware import PRESETS, load_cluster
from autoshard.cost.parts import optimizer_step_s
from autoshard.cost.step import price_parts
from autoshard.cost.tables import EAGER_GPU_HOST, CostTables, Runtime
from autoshard.cost.units import kernel_fixed_s, loss_logits, unit_costs
from autoshard.ir.decisions import Decisions, Mesh
from autoshard.pipeline import capture_graph

H100 = PRESETS["dgx-h100"]
W = H100.device.memory_bandwidth_gbps * 1e9
MODEL = "benchmarks/llama3.py"


@pytest.fixture(scope="module")
def tiny():
    return capture_graph(f"{MODEL}:llama3_tiny", use_cache=True, proofs=False)[1]


@pytest.fixture(scope="module")
def llama8b():
    return capture_graph(f"{MODEL}:llama3_8b", use_cache=True, proofs=False)[1]


def _parts(graph, cluster, dp=1, b=2, runtime=None):
    tables = CostTables(graph, cluster, runtime)
    config = Decisions(
        mesh=Mesh(dp=dp), zero_stage=3 if dp > 1 else 0, microbatch_size=b, num_microbatches=1, recompute="selective"
    )
    return tables, config, price_parts(tables, config)


def test_autoshard_programs_are_eager_on_gpus_and_fused_elsewhere():
    """Runtime.for_cluster: eager on NCCL; CPU ranks (gloo) keep the fused roofline and their measured host;
    Megatron-LM's runtime is fused."""
    cpu = PRESETS["local-cpu"]
    assert Runtime.for_cluster(H100).kernels == "eager"
    assert Runtime.for_cluster(cpu).kernels == "fused" and Runtime.for_cluster(cpu).host_for(cpu) is cpu.host
    assert Runtime.named("megatron-lm", H100).kernels == "fused"
    assert Runtime.named("megatron-lm", H100).host_for(H100) is H100.host
    assert Runtime.for_cluster(H100).host_for(H100) == EAGER_GPU_HOST


def test_launch_overhead_dominates_a_tiny_model_and_not_a_big_one(tiny, llama8b):
    """Kernel-launch overhead = host time not hidden (Σ_u,pass max(0, host − device)) + the kernels'
    fixed device time (``units.kernel_fixed_s``): most of a 2-layer d=256 model's step, under 2% of
    Llama-3-8B's (each block's device time ≫ its ~40 ops × 10 µs)."""
    _, _, small = _parts(tiny, H100)
    _, _, big = _parts(llama8b, H100)
    assert small.host_s + kernel_fixed_s(tiny, "selective") > 0.5 * small.step_time_s
    assert small.host_s > 0.25 * small.step_time_s
    assert big.host_s < 1e-3 * big.step_time_s
    assert big.host_s + kernel_fixed_s(llama8b, "selective") < 0.02 * big.step_time_s


def _flow_exposed_s(raw) -> float:
    """max(0, max_k Σ_{i≤k} (host_i − device_i)) over the forward passes, then each unit's backward with its
    recompute from the last unit down (``units.exposed_host``)."""
    passes = [h - d for h, d in zip(raw.host_forward_s, raw.forward_s)] + [
        hb + hr - b - r
        for hb, hr, b, r in reversed(
            list(zip(raw.host_backward_s, raw.host_recompute_s, raw.backward_s, raw.recompute_s))
        )
    ]
    lead = exposed = 0.0
    for excess in passes:
        lead += excess
        exposed = max(exposed, lead)
    return exposed


def _exposed_s(units) -> float:
    return sum(units.host_forward_s) + sum(units.host_backward_s) + sum(units.host_recompute_s)


@pytest.mark.parametrize("recompute, selective_op_us", [("none", 0.0), ("selective", 400.0), ("full", 0.0)])
def test_host_hides_behind_the_micro_batchs_queued_kernels(tiny, recompute, selective_op_us):
    """The host runs ahead of the kernels it queues: a micro-batch exposes the largest lead the host's time
    takes over the device's along its passes in order, forward then backward (the flow in ``exposed_host``),
    never more than each pass's own excess summed; and with the forward's lead to spend, a selective recompute's
    policy cost is hidden in part (a 2-layer d=256 model at 400 µs per op)."""
    host = replace(EAGER_GPU_HOST, selective_op_us=selective_op_us)
    args = (tiny, 2, recompute, H100.device, 2)
    raw = unit_costs(*args, host=host, host_overlaps=False, kernels="eager")
    units = unit_costs(*args, host=host, host_overlaps=True, kernels="eager")
    per_pass = sum(max(0.0, h - d) for h, d in zip(raw.host_forward_s, raw.forward_s)) + sum(
        max(0.0, hb + hr - b - r)
        for hb, hr, b, r in zip(raw.host_backward_s, raw.host_recompute_s, raw.backward_s, raw.recompute_s)
    )
    assert _exposed_s(units) == pytest.approx(_flow_exposed_s(raw), rel=1e-9, abs=1e-12)
    assert _exposed_s(units) <= per_pass + 1e-12
    for exposed, h, d in zip(units.host_forward_s, raw.host_forward_s, raw.forward_s):
        assert 0.0 <= exposed <= max(0.0, h - d) + 1e-12
    if recompute == "selective":
        assert 0.0 < _exposed_s(units) < per_pass


def test_all_host_time_shows_where_the_device_has_nothing_to_run(tiny):
    """With a device that takes no time the flow exposes every host second."""
    free = replace(H100.device, peak_tflops=1e12, memory_bandwidth_gbps=1e12)
    args = (tiny, 2, "full", free, 2)
    raw = unit_costs(*args, host=EAGER_GPU_HOST, host_overlaps=False, kernels="eager")
    units = unit_costs(*args, host=EAGER_GPU_HOST, host_overlaps=True, kernels="eager")
    device_s = sum(raw.forward_s) + sum(raw.backward_s) + sum(raw.recompute_s)
    host_s = _exposed_s(raw)
    assert _exposed_s(units) == pytest.approx(host_s - device_s, rel=1e-6)


def test_fp32_logits_memory_is_b_s_v_4_bytes_per_copy(llama8b):
    """Llama-3-8B, b = 2, s = 8192, V = 128256: n = b·s·V logits; the saved fp32 log-softmax is 4·n
    (≈ 8.4 GB) in place of the one bf16 copy the fused model counts (the loss's: the head linear keeps its
    input, not its output, ``cost.saved``), and the loss's backward holds two more fp32 copies (8·n) as the
    suffix's workspace."""
    n = loss_logits(llama8b, 2)
    assert n == 2 * 8192 * 128256
    assert 4 * n == pytest.approx(8.4e9, rel=0.01)
    args = (llama8b, 2, "selective", H100.device, 2)
    fused, eager_units = unit_costs(*args), unit_costs(*args, kernels="eager")
    bf16_logits = 2 * n
    assert eager_units.saved_bytes[-1] == pytest.approx(fused.saved_bytes[-1] - bf16_logits + 4 * n, abs=2)
    assert eager_units.workspace_bytes[-1] == 8 * n
    assert max(eager_units.workspace_bytes) == 8 * n  # larger than any block's recompute workspace


def test_elementwise_ops_run_at_the_achieved_bandwidth(llama8b):
    """One kernel per op: T_KERNEL + bytes / W, W the copy-measured bandwidth (3.0 TB/s on H100)."""
    add = next(
        n for n in llama8b.nodes if n.target.startswith("aten.add.Tensor") and n.module_path.startswith("layers.")
    )
    moved = (add.bytes_read + add.bytes_written) * 0.5  # captured fp32, trained bf16
    t = op_forward_s(add, 0, 1.0, H100.device, 0.5, kernels="eager")
    assert t == pytest.approx(eager.KERNEL_FIXED_US * 1e-6 + moved / W)
    assert op_backward_s(add, 0, 1.0, H100.device, 0.5, t, kernels="eager") == pytest.approx(BACKWARD_TO_FORWARD * t)
    view = next(n for n in llama8b.nodes if n.target.startswith("aten.view"))
    assert op_forward_s(view, 0, 1.0, H100.device, 0.5, kernels="eager") == 0.0  # no kernel


def test_small_gemms_are_priced_less_efficient_than_big_ones():
    """η(M, N) = η_large · tile_q · wave_q: a 128×128 output fills 1 of 132 SMs; Llama-3-8B's
    projections at 16384 tokens keep ≥ 0.95 of η_large; a 133-tile output runs two waves."""
    dev = H100.device
    assert eager.matmul_shape_efficiency(128, 128, 1, dev) == pytest.approx(1 / 132)
    assert eager.matmul_shape_efficiency(16384, 4096, 1, dev) > 0.95
    assert eager.matmul_shape_efficiency(16384, 1024, 1, dev) > 0.95
    assert eager.matmul_shape_efficiency(133 * 128, 128, 1, dev) == pytest.approx(133 / 264)
    assert eager.matmul_shape_efficiency(100, 128, 1, dev) == pytest.approx(100 / 128 / 132)
    small = eager.matmul_forward_s("aten.linear.default", (128, 128), 2 * 128 * 128 * 4096, 0, dev)
    big = eager.matmul_forward_s("aten.linear.default", (16384, 4096), 2 * 16384 * 4096 * 4096, 0, dev)
    assert small / (2 * 128 * 128 * 4096) > 50 * big / (2 * 16384 * 4096 * 4096)


def test_matmul_backward_prices_input_and_weight_gradients_by_their_own_shapes():
    """x[M,K]·wᵀ → [M,N]: dgrad's output M×K and wgrad's N×K; a skinny N (kv projection) is no worse
    in forward than its wgrad of N×K tiles."""
    dev, f = H100.device, 2 * 16384 * 1024 * 4096
    bwd = eager.matmul_backward_s("aten.linear.default", (16384, 1024), f, 0, dev)
    expected = sum(
        f / (dev.peak_tflops * 1e12 * dev.matmul_efficiency * eager.matmul_shape_efficiency(a, b, 1, dev))
        for a, b in ((16384, 4096), (1024, 4096))
    )
    assert bwd == pytest.approx(expected)


def test_flash_attention_at_fa2_utilization_causal_halved(llama8b):
    """SDPA: F·½ / (0.35·P) on H100 for a causal mask; backward 2.5× forward."""
    sdpa = next(n for n in llama8b.nodes if n.target.startswith("aten.scaled_dot_product_attention"))
    assert sdpa.attrs["is_causal"]
    t = op_forward_s(sdpa, 0, 1.0, H100.device, 0.5, kernels="eager")
    assert t == pytest.approx(sdpa.flops * 0.5 / (0.35 * H100.device.peak_tflops * 1e12))
    assert op_backward_s(sdpa, 0, 1.0, H100.device, 0.5, t, kernels="eager") == pytest.approx(2.5 * t)


def test_optimizer_moves_torchs_foreach_adamw_bytes(llama8b):
    """Eager: 84 bytes per local fp32 parameter (torch 2.13 ``_multi_tensor_adam``), fused 28."""
    cluster = load_cluster("dgx-h100")
    tables, config, parts = _parts(llama8b, cluster, dp=8)
    assert parts.optimizer_s == pytest.approx(llama8b.param_count / 8 * 84 / W)
    fused = optimizer_step_s(llama8b.param_count, config, cluster)
    assert parts.optimizer_s == pytest.approx(3 * fused)


def test_megatron_runtime_keeps_the_fused_roofline(tiny):
    """Megatron-LM's units are the plain roofline: backward 2·forward, no host, the loss as captured."""
    runtime = Runtime.named("megatron-lm", H100)
    tables = CostTables(tiny, H100, runtime)
    units = tables.units(2, "selective")
    plain = unit_costs(
        tiny,
        2,
        "selective",
        H100.device,
        runtime.precision.activation_bytes,
        attention="materialized",
        host=H100.host,
        host_overlaps=True,
    )
    assert units == plain
    assert units.backward_s == tuple(BACKWARD_TO_FORWARD * f for f in units.forward_s)
    assert sum(units.host_s) == 0.0
