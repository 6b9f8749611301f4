"""What bf16 autocast does to an eager GPU step's bytes (``cost.autocast``), on Llama-3's block (tiny shape).

Each test pins one rule of torch's autocast to the graph: the dtype an op runs in (matmuls bf16, the
fp32 residual stream and rotary embeddings promoted), the casts it launches (a weight once per micro-batch
under DDP, none under FSDP2's bf16 param_dtype, an fp32 activation before every matmul that reads it, each
undone on the gradient), and which plans are priced with them.
"""

import pytest

from autoshard.cost import eager
from autoshard.cost.autocast import LOWER_PRECISION_TARGETS, autocast_traffic
from autoshard.cost.hardware import PRESETS, load_cluster
from autoshard.cost.step import price_parts
from autoshard.cost.tables import CostTables, Runtime
from autoshard.cost.units import node_backward_s, node_forward_s
from autoshard.ir.decisions import Decisions, Mesh
from autoshard.pipeline import capture_graph

H100 = PRESETS["dgx-h100"]


@pytest.fixture(scope="module")
def tiny():
    return capture_graph("benchmarks/llama3.py:llama3_tiny", use_cache=True, proofs=False)[1]


def _matmul_weights(graph) -> dict[str, int]:
    """Parameter -> numel, for every parameter a matmul-class op reads (each is cast once per micro-batch)."""
    out = {}
    for node in graph.nodes:
        if node.target.startswith(LOWER_PRECISION_TARGETS):
            for name in node.param_inputs:
                out[name] = graph.param(name).numel
    return out


def test_ddp_casts_each_matmul_weight_once_per_microbatch_and_its_gradient_back(tiny):
    """fp32 weights under DDP: Σ forward weight casts = Σ_w numel·(4 + 2) over the weights matmuls read,
    each counted once however often it is read; the same bytes again for the gradients' casts to fp32."""
    traffic = autocast_traffic(tiny, "bfloat16", None)
    weights = _matmul_weights(tiny)
    assert weights, "the tiny Llama has matmul weights"
    assert sum(t.weight_forward_cast_bytes for t in traffic) == 6 * sum(weights.values())
    assert sum(t.weight_backward_cast_bytes for t in traffic) == 6 * sum(weights.values())
    assert sum(t.weight_casts for t in traffic) == len(weights)


def test_fsdp2_reads_bf16_weights_without_a_cast_and_casts_their_gradients_to_fp32(tiny):
    """FSDP2 gathers bf16 weights (param_dtype): no forward cast; every trainable weight's bf16 gradient
    is cast to the fp32 reduce dtype, norms' and the embedding's included."""
    traffic = autocast_traffic(tiny, "bfloat16", "bfloat16")
    trainable = sum(p.numel for p in tiny.params if not p.is_buffer)
    assert sum(t.weight_forward_cast_bytes for t in traffic) == 0
    assert sum(t.weight_backward_cast_bytes for t in traffic) == 6 * trainable


def test_dtypes_follow_autocast_lists_and_promotion(tiny):
    """Matmuls write bf16 (write ratio ½ of the fp32 capture); the residual add of a bf16 projection to the
    fp32 embedding stream promotes to fp32 (ratio 1); q·cos with fp32 cos promotes (rotary embeddings run in
    fp32); an fp32 activation read by a matmul is cast first."""
    traffic = dict(zip((n.name for n in tiny.nodes), autocast_traffic(tiny, "bfloat16", None)))
    nodes = {n.name: n for n in tiny.nodes}
    linear = next(n for n in tiny.nodes if n.target.startswith("aten.linear"))
    assert traffic[linear.name].write_ratio == 0.5
    assert traffic[linear.name].forward_cast_kernels == 1  # its input, the fp32 norm output
    assert traffic[linear.name].forward_cast_bytes == nodes[linear.inputs[0]].output_numel * 6
    adds = [
        n
        for n in tiny.nodes
        if n.target.startswith("aten.add")
        and any(nodes.get(i) is not None and nodes[i].target.startswith("aten.linear") for i in n.inputs)
    ]
    assert adds and all(traffic[a.name].write_ratio == 1.0 for a in adds)
    assert all(traffic[a.name].backward_cast_kernels == 1 for a in adds)  # the gradient to the bf16 projection
    rope = next(n for n in tiny.nodes if n.target.startswith("aten.mul") and "cos" in n.inputs)
    assert traffic[rope.name].write_ratio == 1.0


def test_autocast_adds_the_casts_to_the_step_and_only_under_autocast(tiny):
    """The same op priced with autocast's traffic takes its casts' time more than its own kernel; plans
    in fp32 (CPU ranks) or bf16-pure carry no autocast."""
    plain = node_forward_s(tiny, 2, H100.device, 2, 4, "flash", "eager")
    cast = node_forward_s(tiny, 2, H100.device, 2, 4, "flash", "eager", ("bfloat16", None))
    linear = next(i for i, n in enumerate(tiny.nodes) if n.target.startswith("aten.linear"))
    assert cast[linear] > plain[linear] + eager.KERNEL_FIXED_US * 1e-6
    back = node_backward_s(tiny, 2, H100.device, 2, 4, "flash", "eager", ("bfloat16", None))
    assert back[linear] > node_backward_s(tiny, 2, H100.device, 2, 4, "flash", "eager")[linear]
    runtime = Runtime.for_cluster(H100, tiny)
    assert runtime.autocast_for(fsdp2=False) == ("bfloat16", None)
    assert runtime.autocast_for(fsdp2=True) == ("bfloat16", "bfloat16")
    assert Runtime.for_cluster(H100, tiny, "bf16-pure").autocast_for(fsdp2=False) is None
    assert Runtime.for_cluster(load_cluster("local-cpu"), tiny).autocast_for(fsdp2=False) is None


def test_ddp_pays_the_weight_casts_fsdp2_does_not(tiny):
    """One rank, same micro-batches: ZeRO-0 (DDP, fp32 weights cast each micro-batch) prices more forward
    time than the same point would with bf16 weights; the forward difference is the weight casts."""
    tables = CostTables(tiny, H100)
    ddp = Decisions(mesh=Mesh(dp=1), zero_stage=0, microbatch_size=2, num_microbatches=2, recompute="none")
    forward_ddp = price_parts(tables, ddp).forward_s
    bf16_weights = tables.units(2, "none", ("bfloat16", "bfloat16"))
    fp32_weights = tables.units(2, "none", ("bfloat16", None))
    assert forward_ddp == pytest.approx(2 * sum(fp32_weights.forward_s))
    assert sum(fp32_weights.forward_s) > sum(bf16_weights.forward_s)


def test_a_convolutional_model_runs_its_convolutions_in_bf16_and_the_rest_as_promoted():
    """A model with no transformer in it (convolutions, BatchNorm, pooling): every node gets a traffic record,
    convolutions write bf16 (autocast's lower-precision list), and each fp32 weight a convolution reads is cast
    once; ops outside both lists keep their widest input's dtype."""
    graph = capture_graph("tests/models/bn_cnn.py:build", use_cache=True, proofs=False)[1]
    traffic = autocast_traffic(graph, "bfloat16", None)
    assert len(traffic) == len(graph.nodes)
    convs = [i for i, n in enumerate(graph.nodes) if n.target.startswith("aten.conv")]
    assert convs and all(traffic[i].write_ratio == 0.5 for i in convs)
    assert sum(t.weight_casts for t in traffic) == len(_matmul_weights(graph))
