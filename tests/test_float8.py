"""--float8: torchao's float8 training as a decision: searched and priced on H100s, refused where there are no float8
matmuls, lowered before every wrapper, printed in the program and in inspect, verified through its twin."""

import dataclasses

import pytest
import torch
from torch import nn

import autoshard
from autoshard.cli import main
from autoshard.cost.float8 import (
    EAGER_EXTRA_OPS,
    cast_bytes_per_element,
    float8_linears,
    float8_tp_comm_factor,
    forward_casts_s,
    transpose_bytes_per_element,
)
from autoshard.cost.hardware import PRESETS, load_cluster
from autoshard.cost.tables import EAGER_GPU_HOST, CostTables
from autoshard.cost.units import node_forward_s, unit_costs
from autoshard.errors import AutoshardError
from autoshard.ir.decisions import FLOAT8_RECIPES
from autoshard.ir.plan import load_plan
from autoshard.ir.topology import Cluster
from autoshard.passes.lowering.codegen import emit_program
from autoshard.passes.lowering.lower import lower
from autoshard.pipeline import capture_graph
from autoshard.runtime.float8 import apply_float8, convert_stage_linears
from autoshard.show import float8_text
from autoshard.verify import float8_twin

LLAMA_8B = "benchmarks/llama3.py:llama3_8b_2l"  # Llama-3 8B's shape (d 4096, FFN 14336, vocab 128256), 2 layers
GPT = "examples/gpt.py:build"
H100 = PRESETS["dgx-h100"].device
PINS_8B = dict(global_batch=16, dp=8, tp=1, pp=1, zero=3, microbatch_size=1, recompute="selective")


@pytest.fixture(scope="module")
def plans_8b():
    """The 8B shape on one DGX H100 with float8 left to the search, and its bf16 twin (float8 pinned off)."""
    chosen = autoshard.plan(LLAMA_8B, cluster="dgx-h100", **PINS_8B)
    twin = autoshard.plan(LLAMA_8B, cluster="dgx-h100", float8="off", **PINS_8B)
    return chosen, twin


def test_the_search_chooses_float8_on_h100_for_the_8b_shape_and_lists_its_linears(plans_8b):
    chosen, twin = plans_8b
    assert chosen.decisions.float8 == "tensorwise" and twin.decisions.float8 == "off"
    # every linear of the two blocks (q, k, v, o, w1, w2, w3), not the output projection (torchtitan's filter)
    assert len(chosen.float8_linears) == 2 * 7 and "output" not in chosen.float8_linears
    assert chosen.float8_linears[:4] == tuple(f"layers.0.attention.w{x}" for x in "qkvo")
    assert twin.float8_linears == ()
    assert "tensorwise scaling (torchao Float8Linear) on 14 linears: layers.*.attention.wq" in float8_text(chosen)


def test_float8_step_is_faster_than_its_bf16_twin_by_a_datasheet_consistent_ratio(plans_8b):
    """The matmuls at 1979 instead of 989 TFLOP/s (H100 SXM datasheet): the step gains, by less than the peaks'
    ratio (attention, elementwise work, the casts and communication are not float8), and the same memory."""
    chosen, twin = plans_8b
    speedup = twin.predicted.step_time_s / chosen.predicted.step_time_s
    assert 1.05 < speedup < H100.float8_tflops / H100.peak_tflops
    assert chosen.predicted.memory_peak_bytes_per_rank == twin.predicted.memory_peak_bytes_per_rank


def test_a_converted_linear_runs_at_the_float8_peak_plus_its_casts():
    """Per node: the float8 matmul is the bf16 one at P / P₈ (compute-bound), plus the casts' bytes (cost.float8)."""
    _, graph = capture_graph(LLAMA_8B, use_cache=True, proofs=False)
    tables = CostTables(graph, load_cluster("dgx-h100"))
    linears = float8_linears(graph)
    bf16 = tables.units(1, "none", None, False, None)
    f8 = tables.units(1, "none", None, False, ("tensorwise", linears, 1.0))
    rowwise = tables.units(1, "none", None, False, ("rowwise", linears, 1.0))
    block = 1  # unit 1: block 0
    assert f8.forward_s[block] < bf16.forward_s[block] and f8.backward_s[block] < bf16.backward_s[block]
    assert rowwise.forward_s[block] > f8.forward_s[block]  # twice the casts, the same matmuls
    assert f8.forward_s[0] == bf16.forward_s[0] and f8.forward_s[-1] == bf16.forward_s[-1]  # embedding, head
    # one FFN matmul (M = 8192 tokens, N = 14336, K = 4096): compute-bound, so exactly P / P₈ of its bf16 time
    node = next(n for n in graph.nodes if n.module_path == "layers.0.feed_forward.w1")
    at = [n.name for n in graph.nodes].index(node.name)
    args = (graph, 1, tables.cluster.device, tables.precision.activation_bytes, 4, "flash", tables.runtime.kernels)
    t_bf16 = node_forward_s(*args)[at]
    t_f8 = node_forward_s(*args, None, False, ("tensorwise", linears, 1.0))[at]
    scale = 1 / graph.batch_size
    casts = forward_casts_s(node, (14336, 4096), scale, ("tensorwise", linears, 1.0), 2, H100)
    assert t_f8 - casts == pytest.approx(t_bf16 * H100.peak_tflops / H100.float8_tflops, rel=1e-9)
    # x (8192 x 4096) and W (14336 x 4096) cast, 7 bytes an element at 0.62 of 3.0 TB/s, 3 kernels each
    assert casts == pytest.approx(2 * 3 * 1.3e-6 + (8192 + 14336) * 4096 * 7 / (0.62 * 3000e9), rel=1e-9)
    # FSDP2's float8 all-gather over 8 ranks: W cast by shards, each rank an eighth of it (and transposed whole)
    sharded = forward_casts_s(node, (14336, 4096), scale, ("tensorwise", linears, 1 / 8), 2, H100)
    assert sharded == pytest.approx(casts - 14336 * 4096 * 5 * (7 / 8) / (0.62 * 3000e9), rel=1e-9)
    assert cast_bytes_per_element(FLOAT8_RECIPES["tensorwise"], 2) == 5  # amax 2 + cast 2 + 1
    assert transpose_bytes_per_element(FLOAT8_RECIPES["tensorwise"]) == 2  # read 1 + write 1
    assert transpose_bytes_per_element(FLOAT8_RECIPES["tensorwise"], compiled=True) == 1  # written by the cast
    assert cast_bytes_per_element(FLOAT8_RECIPES["rowwise"], 2) == 10  # two casts of 5, no transposed copy


def _entered_ops(run) -> int:
    """The aten ops ``run`` enters from Python or autograd: torch.profiler's aten events with no aten parent."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return sum(
        e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
        for e in prof.events()
    )


@pytest.mark.parametrize("recipe", sorted(EAGER_EXTRA_OPS))
def test_the_eager_host_ops_are_those_the_installed_torchao_adds(recipe):
    """EAGER_EXTRA_OPS, counted again: one Linear(64, 64) converted by the installed torchao (emulated matmuls on a
    CPU) against the plain one, forward and backward apart. A torchao that issues other ops fails here."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def counts(linear: nn.Module) -> tuple[int, int]:
        x = torch.randn(8, 64, requires_grad=True)
        linear(x).sum().backward()  # warm: the first call's lazy set-up is not a step's
        out = []
        forward = _entered_ops(lambda: out.append(linear(x)))
        return forward, _entered_ops(lambda: out[0].sum().backward())

    plain = counts(nn.Linear(64, 64, bias=False))
    converted = nn.Sequential(nn.Linear(64, 64, bias=False))
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    float8 = counts(convert_to_float8_training(converted, config=config))
    assert (float8[0] - plain[0], float8[1] - plain[1]) == EAGER_EXTRA_OPS[recipe]


def test_eager_float8_prices_its_own_host_ops_and_compiled_blocks_fuse_them():
    """Each converted linear adds n_f·h_f to its unit's host forward and n_b·h_f to its backward (cost.float8,
    "Host, eager"); a full recompute reruns n_f; in compiled blocks the casts are fused (no host of their own)."""
    _, graph = capture_graph(LLAMA_8B, use_cache=True, proofs=False)
    tables = CostTables(graph, load_cluster("dgx-h100"))
    linears = float8_linears(graph)
    h_f = EAGER_GPU_HOST.op_forward_us * 1e-6  # the host the units are priced with below
    n_f, n_b = EAGER_EXTRA_OPS["tensorwise"]
    per_block = 7  # q, k, v, o, w1, w2, w3
    raw = {}
    for recompute in ("none", "full"):
        for f8 in (None, ("tensorwise", linears, 1.0)):
            raw[recompute, f8 is not None] = unit_costs(
                graph, 1, recompute, tables.cluster.device, 2, host=EAGER_GPU_HOST, kernels="eager", float8=f8
            )
    bf16, f8 = raw["none", False], raw["none", True]
    assert f8.host_forward_s[1] - bf16.host_forward_s[1] == pytest.approx(per_block * n_f * h_f, rel=1e-9)
    assert f8.host_backward_s[1] - bf16.host_backward_s[1] == pytest.approx(per_block * n_b * h_f, rel=1e-9)
    assert f8.host_forward_s[0] == bf16.host_forward_s[0] and f8.host_forward_s[-1] == bf16.host_forward_s[-1]
    full_bf16, full_f8 = raw["full", False], raw["full", True]
    assert full_f8.host_recompute_s[1] - full_bf16.host_recompute_s[1] == pytest.approx(per_block * n_f * h_f)
    compiled = [
        unit_costs(
            graph, 1, "none", tables.cluster.device, 2, host=EAGER_GPU_HOST, kernels="eager", compiled=True, float8=x
        )
        for x in (None, ("tensorwise", linears, 1.0))
    ]
    assert compiled[0].host_forward_s == compiled[1].host_forward_s
    assert compiled[0].host_backward_s == compiled[1].host_backward_s


def test_pinned_float8_without_float8_matmuls_is_refused_in_one_line(capsys):
    for cluster, device in (("local-cpu", "cpu-process"), ("dgx-a100-80gb", "A100-SXM-80GB")):
        code = main(["plan", GPT, "--cluster", cluster, "--global-batch", "8", "--float8", "tensorwise"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1, err
        assert f"--float8 tensorwise: {cluster}'s device {device} has no float8 matmuls" in err
        assert "pin --float8 off" in err


def test_float8_pins_outside_what_is_emitted_are_refused():
    with pytest.raises(AutoshardError, match="--float8 rowwise with --ep 2 is not emitted yet"):
        autoshard.plan(GPT, cluster="dgx-h100", global_batch=8, ep=2, float8="rowwise")
    with pytest.raises(AutoshardError, match="--float8 bf8 must be one of off, tensorwise, rowwise"):
        autoshard.plan(GPT, cluster="dgx-h100", global_batch=8, float8="bf8")


def test_cpu_clusters_search_no_float8_and_write_no_float8_key(tmp_path):
    plan = autoshard.plan(GPT, cluster="local-cpu", global_batch=8, dp=2, tp=1, pp=1, zero=0, microbatch_size=4)
    assert plan.decisions.float8 == "off" and not plan.float8_linears
    text = plan.to_json()
    assert "float8" not in text  # decisions.float8, layout.float8_linears and device.float8_tflops: all absent


def test_the_cluster_files_name_the_float8_peak():
    assert PRESETS["dgx-h100"].device.float8_tflops == 1979.0
    assert not PRESETS["dgx-a100-80gb"].device.has_float8 and not PRESETS["local-cpu"].device.has_float8
    assert load_cluster("examples/cluster.yaml").device.float8_tflops == 1979.0
    assert load_cluster("benchmarks/clusters/grand_teton_h100.yaml").device.float8_tflops == 1979.0
    d = PRESETS["dgx-h100"].to_dict()
    assert Cluster.from_dict(d).device == PRESETS["dgx-h100"].device
    with pytest.raises(AutoshardError, match="float8_tflops"):
        Cluster.from_dict({**d, "device": {**d["device"], "float8_tflops": -1}})


def test_the_program_converts_before_fsdp_and_computes_scales_after_each_step():
    plan = load_plan("tests/golden/float8_dp_zero3.plan.json")
    ops = [step.op for step in lower(plan)]
    assert ops.index("apply_float8") < ops.index("apply_fsdp") < ops.index("build_optimizer")
    program = emit_program(plan)
    assert 'FLOAT8 = "tensorwise"' in program
    assert "model = apply_float8(model, float8=FLOAT8, linears=FLOAT8_LINEARS, fsdp_float8_all_gather=True)" in program
    assert "float8_scales=True" in program


def test_rowwise_gathers_bf16_weights():
    """torchao's float8 all-gather is tensorwise only: a rowwise plan gathers its weights as FSDP2 does."""
    plan = autoshard.plan(
        GPT, cluster="dgx-h100", global_batch=64, dp=8, tp=1, pp=1, zero=3, microbatch_size=8, float8="rowwise"
    )
    step = next(s for s in lower(plan) if s.op == "apply_float8")
    assert step.kwargs["float8"] == "rowwise" and step.kwargs["fsdp_float8_all_gather"] is False
    assert "float8_scales" not in next(s for s in lower(plan) if s.op == "build_optimizer").kwargs


def test_verify_runs_the_twin_with_float8_off():
    plan = load_plan("tests/golden/float8_dp_zero3.plan.json")
    twin, notes = float8_twin(plan)
    assert twin.decisions == dataclasses.replace(plan.decisions, float8="off") and twin.float8_linears == ()
    assert "apply_float8" not in [s.op for s in lower(twin)]
    assert "verified through its twin: the same plan with float8 off (bf16-autocast)" in notes[0]
    assert float8_twin(twin) == (twin, ())


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down, self.out = nn.Linear(32, 64), nn.Linear(64, 32), nn.Linear(32, 10)

    def forward(self, x):
        return self.out(self.down(torch.relu(self.up(x))))


def test_the_applier_converts_the_named_linears_only():
    """On the meta device (as programs build), and emulated on CPU: the float8 model trains close to its twin."""
    with torch.device("meta"):
        meta = _Mlp()
    apply_float8(meta, "tensorwise", ("up", "down"), emulate=True)
    assert [type(m).__name__ for m in (meta.up, meta.down, meta.out)] == ["Float8Linear", "Float8Linear", "Linear"]
    torch.manual_seed(0)
    twin, model = _Mlp(), _Mlp()
    model.load_state_dict(twin.state_dict())
    apply_float8(model, "tensorwise", ("up", "down"), emulate=True)
    x = torch.randn(16, 32)
    assert torch.allclose(model(x), twin(x), atol=0.1)


def test_the_applier_refuses_without_float8_matmuls():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(AutoshardError, match="--float8 tensorwise: this torch build .* has no CUDA device"):
        apply_float8(_Mlp(), "tensorwise", ("up",))


def _trained_grads(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward: the output and each parameter's gradient (DTensors made whole)."""
    y = model(x)
    y.float().square().sum().backward()
    whole = {n: getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for n, p in model.named_parameters()}
    return y, whole


class _SpBlock(nn.Module):
    """An attention-like module (two column linears reading its input) and an MLP, residuals between."""

    def __init__(self):
        super().__init__()
        self.att = nn.Module()
        self.att.q, self.att.k = nn.Linear(32, 32), nn.Linear(32, 32)
        self.o, self.up, self.down = nn.Linear(32, 32), nn.Linear(32, 64), nn.Linear(64, 32)
        self.att.forward = lambda x: self.att.q(x) * self.att.k(x)

    def forward(self, x):
        h = x + self.o(self.att(x))
        return h + self.down(torch.relu(self.up(h)))


SP_LINEARS = ("att.q", "att.k", "o", "up", "down")
SP_STYLES = {
    "att": "gather-seq-module-input-dim0",
    "att.q": "colwise",
    "att.k": "colwise",
    "o": "rowwise-seq-output-dim0",
    "up": "colwise-seq-input-dim0",
    "down": "rowwise-seq-output-dim0",
}


def _float8_pair(build=_Mlp, linears=("up", "down")) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    twin, model = build(), build()
    model.load_state_dict(twin.state_dict())
    for m in (twin, model):
        apply_float8(m, "tensorwise", linears, emulate=True)
    return twin, model


def test_float8_beside_tp_takes_torchaos_float8_styles_and_trains_as_the_float8_model(one_rank):
    """Emulated on a one-rank TP mesh with sequence parallelism: torchao's Float8ColwiseParallel /
    Float8RowwiseParallel on the converted linears and the float8 gather into the attention-like module, outputs and
    weight gradients those of the unsharded float8 model. (gloo all-gathers no float8 bytes, so more ranks than one
    run these gathers on GPUs only.)"""
    from torch.distributed.device_mesh import init_device_mesh
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel

    from autoshard.runtime.parallel import apply_tp
    from autoshard.runtime.tensor_parallel import float8_styled, parallel_style

    twin, model = _float8_pair(_SpBlock, SP_LINEARS)
    assert float8_styled(model, SP_STYLES) == {"att", *SP_LINEARS}
    assert float8_styled(model, {**SP_STYLES, "att.k": "replicate"}) == {"att", "att.q", "o", "up", "down"}
    assert isinstance(parallel_style("colwise-seq-input-dim1", float8=True), Float8ColwiseParallel)
    assert parallel_style("colwise-seq-input-dim1", float8=True).input_layouts[0].dim == 1
    assert parallel_style("gather-seq-module-input-dim1", float8=True).float8
    apply_tp(model, init_device_mesh("cpu", (1,)), SP_STYLES, float8="tensorwise")
    x = torch.randn(16, 32)
    (y, grads), (y_twin, grads_twin) = _trained_grads(model, x), _trained_grads(twin, x)
    assert torch.equal(y, y_twin)
    assert all(torch.equal(grads[n], grads_twin[n]) for n in grads_twin if n.endswith("weight"))
    # the styles cast the output gradient to float8 (e5m2) at the module's output, after the bias is added, so a
    # bias's gradient is the sum of rounded values: within e5m2's relative step (2⁻²), not bitwise
    for name in ("up.bias", "down.bias"):
        assert not torch.equal(grads[name], grads_twin[name])
        assert torch.allclose(grads[name], grads_twin[name], atol=0.125 * grads_twin[name].abs().max().item())


@pytest.fixture(scope="module")
def tp_plans():
    """GPT over dp 4 x tp 2 on one DGX H100 (sequence parallelism searched), tensorwise and rowwise."""
    return {
        recipe: autoshard.plan(GPT, cluster="dgx-h100", global_batch=64, dp=4, tp=2, pp=1, float8=recipe)
        for recipe in ("tensorwise", "rowwise")
    }


def test_rowwise_beside_tp_keeps_the_plain_styles(tp_plans):
    """torchtitan's choice: torchao's float8 TP styles assume tensorwise scales; rowwise takes the plain ones."""
    plan, tensorwise = tp_plans["rowwise"], tp_plans["tensorwise"]
    assert "float8" not in next(s for s in lower(plan) if s.op == "apply_tp").kwargs
    program = emit_program(tensorwise)
    assert 'model = apply_tp(model, mesh["tp"], styles=TP_STYLES, before_split=False, float8=FLOAT8)' in program
    assert program.index("model = apply_float8(") < program.index("model = apply_tp(")
    assert float8_text(tensorwise).endswith("(torchao's float8 TP styles, all-gathers in float8)")
    assert float8_text(plan).endswith("(plain TP styles)")
    notes = float8_twin(tensorwise)[1]
    assert len(notes) == 2 and notes[1].startswith("float8 beside TP: torchao's Float8ColwiseParallel")


def test_float8_pipeline_converts_each_stage_after_the_split(one_rank):
    """The split traces the bf16 model, here with TP's local shards and traced collectives on a one-rank group;
    each stage's linear ops then become float8 matmuls (runtime.float8): state names unchanged, outputs and
    gradients those of torchao's Float8Linear model."""
    import torch.distributed as dist
    from torchao.float8 import Float8LinearConfig

    from autoshard.runtime.float8 import FLOAT8_MATMUL
    from autoshard.runtime.pipeline_parallel import split_model
    from autoshard.runtime.tensor_parallel_stages import shard_for_tracing

    plan = autoshard.plan(GPT, cluster="dgx-h100", global_batch=64, dp=4, tp=1, pp=2, float8="tensorwise")
    ops = [s.op for s in lower(plan)]
    assert ops.index("split_pipeline") + 1 == ops.index("apply_float8") and not plan.decisions.float8_all_gather
    assert "stages = apply_float8(stages, float8=FLOAT8" in emit_program(plan)
    assert float8_text(plan).endswith("(each stage's linears converted after the split)")
    assert float8_twin(plan)[1][1].startswith("float8 beside pipeline stages")

    twin, model = _float8_pair()
    bf16 = _Mlp()
    bf16.load_state_dict(model.state_dict())
    x = torch.randn(16, 32)
    shard_for_tracing(bf16, dist.group.WORLD, {"up": "colwise-seq-input-dim0", "down": "rowwise-seq-output-dim0"})
    pipe = split_model(bf16, (x,), ["down"])
    stages = [pipe.get_stage_module(i) for i in range(2)]
    names = [list(s.state_dict()) for s in stages]
    for stage in stages:
        convert_stage_linears(
            stage, dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"), emulate=True), ("up", "down")
        )
    assert [list(s.state_dict()) for s in stages] == names
    assert hasattr(stages[0].up, FLOAT8_MATMUL) and not hasattr(stages[1].out, FLOAT8_MATMUL)
    y = stages[1](stages[0](x))
    y.float().square().sum().backward()
    y_twin, grads = _trained_grads(twin, x)
    assert torch.equal(y, y_twin) and torch.equal(stages[0].up.weight.grad, grads["up.weight"])


def test_float8_tp_collectives_priced_with_float8_all_gathers(tp_plans):
    """Tensorwise under sequence parallelism: the all-gathers (half a block's TP bytes) in 1 byte, not 2."""
    d = tp_plans["tensorwise"].decisions
    assert d.sequence_parallel and float8_tp_comm_factor(d, 2) == 0.75
    assert float8_tp_comm_factor(dataclasses.replace(d, float8="rowwise"), 2) == 1.0
    assert float8_tp_comm_factor(dataclasses.replace(d, sequence_parallel=False), 2) == 1.0
    assert float8_tp_comm_factor(dataclasses.replace(d, float8="off"), 2) == 1.0


def test_a_pipeline_search_prices_float8_and_bf16_stages_apart():
    """One search's tables price both float8 and bf16 points of a pipeline mesh: a stage's units are cached per
    float8 recipe too, so the float8 point priced after its bf16 twin is priced as in tables of its own."""
    from autoshard.cost.step import price_parts
    from autoshard.ir.decisions import Decisions, Mesh

    _, graph = capture_graph(LLAMA_8B, use_cache=True, proofs=False)
    off = Decisions(Mesh(dp=4, pp=2), 1, 1, 4, schedule="1f1b", precision="bf16-autocast")
    on = dataclasses.replace(off, float8="tensorwise")
    shared = CostTables(graph, load_cluster("dgx-h100"))
    bf16, float8 = price_parts(shared, off, (1,)), price_parts(shared, on, (1,))
    alone = price_parts(CostTables(graph, load_cluster("dgx-h100")), on, (1,))
    assert float8 == alone and float8.forward_s < bf16.forward_s and float8.backward_s < bf16.backward_s
