"""--compile on: the decision in the plan, its lowering, the applier under verify's fixed randomness, its price."""

import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import autoshard
from autoshard.cost.compiled import block_kernels, fused_ops
from autoshard.cost.hardware import load_cluster
from autoshard.cost.tables import CostTables, Runtime
from autoshard.errors import AutoshardError
from autoshard.ir.decisions import Mesh, compile_runs
from autoshard.ir.pins import Pins
from autoshard.ir.plan import Plan
from autoshard.passes.lowering.lower import lower
from autoshard.passes.planning import pin_checks
from autoshard.pipeline import capture_graph
from autoshard.runtime.compiled import apply_compile
from autoshard.runtime.randomness import RandomOpNotFixed, fixed_randomness

GPT = "examples/gpt.py:build"


class Block(nn.Module):
    def __init__(self, width=16, stochastic_depth=False):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.drop, self.stochastic_depth = nn.Dropout(0.5), stochastic_depth

    def forward(self, x):
        y = self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))
        if self.stochastic_depth:
            y = y * (torch.rand(x.shape[0], 1, 1) > 0.2)
        return x + y


class Stack(nn.Module):
    def __init__(self, blocks=3, **kw):
        super().__init__()
        self.layers = nn.ModuleList(Block(**kw) for _ in range(blocks))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_blocks_compile_once_keep_their_names_and_run_with_dropout_fixed():
    """Under verify's fixed randomness the compiled blocks are the eager ones with dropout the identity; the three
    blocks share one compiled graph (no recompilation), and parameter names are unchanged."""
    torch.manual_seed(0)
    eager, compiled = Stack(), Stack()
    compiled.load_state_dict(eager.state_dict())
    names = [n for n, _ in compiled.named_parameters()]
    apply_compile(compiled, ("layers.0", "layers.1", "layers.2"))
    assert [n for n, _ in compiled.named_parameters()] == names
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    x = torch.randn(2, 4, 16, requires_grad=True)  # as a block's input is in a model (the embeddings' output)
    with fixed_randomness():
        want, got = eager(x), compiled(x)
        got.sum().backward()
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] == 1 and counters["frames"]["ok"] >= 1  # compiled, once
    torch.testing.assert_close(got, want)
    assert all(p.grad is not None for p in compiled.parameters())
    with torch.no_grad():
        assert not torch.equal(compiled(x), compiled(x))  # outside verify dropout still draws


def test_a_first_blocks_input_hook_runs_before_its_recompute_so_every_block_shares_one_graph():
    """Sequence parallelism slices the first block's input in a forward pre-hook (``ScatterSequenceInput``). Under
    selective recompute the recompute wrapper is what is compiled; the hook runs before the wrapper
    (``parallel._hoist_input_hooks``), so every block traces the same code on the same shapes: one graph, where the
    first block's slicing inside its graph made a second (a recompilation on the sequence length, compiled
    dynamic). The checkpoint saves the slice, and the result is the eager one."""
    from autoshard.runtime.parallel import apply_recompute

    torch.manual_seed(0)
    eager, compiled = Stack(), Stack()
    compiled.load_state_dict(eager.state_dict())
    blocks = ("layers.0", "layers.1", "layers.2")
    for model in (eager, compiled):
        # this rank's slice of the sequence, contiguous as DTensor's scatter gives it
        model.layers[0].register_forward_pre_hook(lambda _, args: (args[0][:, :2].contiguous(), *args[1:]))
        apply_recompute(model, list(blocks), "selective")
    apply_compile(compiled, blocks)
    assert not compiled.layers[0]._checkpoint_wrapped_module._forward_pre_hooks  # on the wrapper now
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    x = torch.randn(2, 4, 16, requires_grad=True)
    with fixed_randomness():
        want, got = eager(x), compiled(x)
        got.sum().backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert got.shape == (2, 2, 16)
    torch.testing.assert_close(got, want)
    assert x.grad is not None and torch.equal(x.grad[:, 2:], torch.zeros_like(x.grad[:, 2:]))


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_a_compiled_checkpoints_dropout_is_fixed_under_verify_and_its_rand_refused(mode):
    """A recompute wrapper compiled whole: dynamo traces the checkpoint's body as a graph of its own, which verify's
    function mode does not reach, so its dropout drew random numbers in a run that fixes them: a false mismatch
    against one process wherever the program could not zero the rate first (``model.zero_dropout_rates`` zeroes
    dropout modules and attributes named so, not a functional call's own rate; here no rate is zeroed, as for such a
    call). The body's dropout is now fixed as the mode fixes it (``randomness.fix_graph_functions``); a random op no
    mode can fix there (stochastic depth's ``rand``) is refused in one line, not drawn."""
    from autoshard.runtime.parallel import apply_recompute

    torch.manual_seed(0)
    eager, compiled = Stack(), Stack()
    compiled.load_state_dict(eager.state_dict())
    blocks = ("layers.0", "layers.1", "layers.2")
    apply_compile(apply_recompute(compiled, list(blocks), mode), blocks)
    torch._dynamo.reset()
    x = torch.randn(2, 4, 16)
    with fixed_randomness():
        torch.testing.assert_close(compiled(x), eager(x))
    drawing = apply_compile(apply_recompute(Stack(blocks=1, stochastic_depth=True), ["layers.0"], mode), ("layers.0",))
    with fixed_randomness(), pytest.raises(RandomOpNotFixed, match="rand in layers.0 draws random numbers"):
        drawing(x)


def test_a_block_that_draws_random_numbers_is_refused_under_fixed_randomness():
    torch._dynamo.reset()
    model = apply_compile(Stack(blocks=1, stochastic_depth=True), ("layers.0",))
    with fixed_randomness(), pytest.raises(RandomOpNotFixed, match="rand in layers.0 draws random numbers"):
        model(torch.randn(2, 4, 16))


@pytest.fixture(scope="module")
def compiled_plan():
    return autoshard.plan(GPT, devices_per_node=2, global_batch=8, dp=2, zero=3, recompute="full", compile=True)


def test_the_plan_records_compile_and_lowers_it_between_recompute_and_fsdp(compiled_plan):
    plan = compiled_plan
    assert plan.decisions.compile and '"compile": true' in plan.to_json()
    ops = [s.op for s in lower(plan)]
    assert ops.index("apply_ac") < ops.index("apply_compile") < ops.index("apply_fsdp")
    assert dict(lower(plan)[ops.index("apply_compile")].arguments)["blocks"] == plan.blocks
    eager = autoshard.plan(GPT, devices_per_node=2, global_batch=8, dp=2, zero=3, recompute="full")
    assert '"compile"' not in eager.to_json() and "apply_compile" not in [s.op for s in lower(eager)]
    assert Plan.from_json(plan.to_json()).decisions.compile


def test_a_plan_whose_compile_is_not_a_flag_is_one_line(compiled_plan):
    text = compiled_plan.to_json().replace('"compile": true', '"compile": 1')
    with pytest.raises(AutoshardError, match="decisions.compile"):
        Plan.from_json(text)


@pytest.mark.parametrize(
    "pins, words",
    [
        (dict(pp=2, recompute="selective"), "--compile on with pipeline stages and --recompute selective"),
        (dict(cp=2, recompute="alternate"), "--compile on with --cp 2 and --recompute alternate"),
        (dict(cp=2, tp=2), "--compile on with --cp 2 and --tp 2"),
        (dict(pp=2, schedule="zbv"), "--compile on with pipeline stages and --schedule zbv"),
        (dict(ep=2), "--compile on with --ep 2 is not emitted yet"),
    ],
)
def test_compile_where_it_is_not_emitted_is_one_line(pins, words):
    cluster = load_cluster("local-cpu", devices_per_node=4)
    with pytest.raises(AutoshardError, match=words):
        pin_checks.check_pins(Pins(compile=True, **pins), cluster, 8)


def test_the_search_never_turns_compile_on_and_compiles_tp_with_sequence_parallelism_under_full_recompute():
    plan = autoshard.plan(GPT, devices_per_node=2, global_batch=8)
    assert not plan.decisions.compile
    pins = dict(tp=2, compile=True, sequence_parallel=True, recompute="full")
    tp = autoshard.plan(GPT, cluster="tests/clusters/fast_link_cpu.yaml", devices_per_node=2, global_batch=8, **pins)
    assert tp.decisions.compile and tp.recompute == "full" and any("seq" in s for s in tp.tensor_parallel.values())
    pin_checks.check_pins(Pins(**pins), load_cluster("local-cpu", devices_per_node=2), 8)  # no refusal left


def test_compile_runs_beside_tp_and_cp_inside_stages_but_not_beside_tp_and_cp_outside():
    """Stages compile blocks holding TP's local shards (their collectives are custom-op calls), beside cp too (the
    traced attention runs the ring eager between compiled graphs); SPMD beside cp, TP stays refused."""
    four = load_cluster("local-cpu", devices_per_node=4)
    pin_checks.check_pins(Pins(compile=True, tp=2, pp=2, recompute="full", sequence_parallel=True), four, 8)
    pin_checks.check_pins(Pins(compile=True, pp=2, cp=2, recompute="full"), four, 8)
    assert compile_runs(Mesh(tp=2, pp=2), recompute="full", schedule="1f1b")
    assert compile_runs(Mesh(tp=2, pp=2), recompute="none", schedule="interleaved-1f1b")
    assert compile_runs(Mesh(pp=2, cp=2), recompute="full", schedule="1f1b")
    assert compile_runs(Mesh(tp=2, pp=2, cp=2), recompute="full", schedule="1f1b")
    assert not compile_runs(Mesh(tp=2, cp=2), recompute="full")
    assert not compile_runs(Mesh(pp=2, cp=2), recompute="full", schedule="zbv")
    assert not compile_runs(Mesh(tp=2, pp=2), recompute="selective", schedule="1f1b")


def test_compiled_blocks_are_priced_with_fused_kernels_on_gpus_only(compiled_plan):
    """On a GPU a compiled plan moves fewer bytes and launches fewer kernels than eager (cost.compiled); on CPU ranks
    the fused roofline prices both the same. Fusion: a block's elementwise run (norm, gelu, dropout, residual add)
    becomes few kernels, each reading only what enters it."""
    graph = capture_graph(GPT, use_cache=True, proofs=False)[1]
    fused = fused_ops(graph)
    block = graph.blocks[0]
    ops = [graph.node(n) for n in block.node_names]
    eager_kernels = sum(1 for n in ops if n.bytes_read or n.bytes_written)
    assert 0 < block_kernels(graph)[block.path] < eager_kernels
    fused_bytes = sum(fused[n.name].read_bytes + fused[n.name].written_bytes for n in ops if n.name in fused)
    assert 0 < fused_bytes < sum(n.bytes_read + n.bytes_written for n in ops if n.name in fused)
    gpu = load_cluster("dgx-h100")
    tables = CostTables(graph, gpu, Runtime.for_cluster(gpu, graph))
    eager_units, compiled_units = tables.units(4, "none", None, False), tables.units(4, "none", None, True)
    assert sum(compiled_units.compute_s) < sum(eager_units.compute_s)
    assert compiled_units.saved_bytes == eager_units.saved_bytes  # memory priced as eager
    cpu = load_cluster("local-cpu", devices_per_node=2)
    cpu_tables = CostTables(graph, cpu)
    assert cpu_tables.units(4, "none", None, True) == cpu_tables.units(4, "none", None, False)


def test_a_compiled_blocks_recompute_runs_no_checkpoint_policy_on_the_host():
    """Compiled, a block's recompute is in its compiled backward: its host time is its share of the block's
    kernel launches, k(u) · LAUNCH_US · recompute(u) / fwd(u), whatever the checkpoint policy costs per op
    eager (units.compiled_recompute_host); eager, the policy's cost is there."""
    from dataclasses import replace

    from autoshard.cost import eager
    from autoshard.cost.tables import EAGER_GPU_HOST
    from autoshard.cost.units import unit_costs

    graph = capture_graph(GPT, use_cache=True, proofs=False)[1]
    device = load_cluster("dgx-h100").device
    host = replace(EAGER_GPU_HOST, selective_op_us=400.0)
    args = (graph, 4, "selective", device, 2, 4, "flash", host, False, "eager")
    compiled, eager_units = unit_costs(*args, compiled=True), unit_costs(*args)
    kernels = list(block_kernels(graph).values())
    for u, k in enumerate(kernels, start=1):
        expected = k * eager.LAUNCH_US * 1e-6 * compiled.recompute_s[u] / compiled.forward_s[u]
        assert compiled.host_recompute_s[u] == pytest.approx(expected)
        assert 0 < compiled.host_recompute_s[u] < 0.1 * eager_units.host_recompute_s[u]


def test_the_compile_flag_is_on_plan_and_estimate():
    for command in ("plan", "estimate"):
        out = subprocess.run(
            [sys.executable, "-m", "autoshard", command, "--help"], capture_output=True, text=True, check=True
        ).stdout
        assert "--compile {on,off}" in out


def test_inspect_and_diff_say_the_blocks_are_compiled(compiled_plan, tmp_path):
    from autoshard.show import decision_rows

    assert decision_rows(compiled_plan)["compiled blocks"] == "yes"
    compiled_plan.save(tmp_path / "p.json")
    out = subprocess.run(
        [sys.executable, "-m", "autoshard", "inspect", str(tmp_path / "p.json")], capture_output=True, text=True
    ).stdout
    assert "compiled" in out and "torch.compile" in out


class Attention(nn.Module):
    """Causal self-attention then a residual: one block that calls SDPA, as context parallelism's ring takes it."""

    def __init__(self, width=16, heads=2):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x):
        b, s, w = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(torch.nn.functional.gelu(y.transpose(1, 2).reshape(b, s, w)))


def test_beside_context_parallelism_the_ring_runs_eager_in_the_compiled_block_and_in_its_recompute(monkeypatch):
    """Beside cp a recomputed block is compiled inside its eager checkpoint (recompute_outside): the ring (here one
    rank's attention, counted) runs between compiled graphs, once in the forward and once in the recomputation,
    under the mode; the compiled block trains as the eager one."""
    import torch.distributed as dist

    from autoshard.runtime import parallel

    cp = sys.modules["autoshard.runtime.context_parallel"]
    calls = []

    def one_rank_ring(query, key, value, group, is_causal=False, scale=None, balanced=False):
        calls.append(torch.compiler.is_compiling())
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=is_causal, scale=scale)

    monkeypatch.setattr(cp, "ring_attention", one_rank_ring)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    torch.manual_seed(0)
    eager, compiled = nn.Sequential(Attention()), nn.Sequential(Attention())
    compiled.load_state_dict(eager.state_dict())
    parallel.apply_recompute(compiled, ["0"], "full")
    apply_compile(compiled, ("0",), recompute_outside=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    x = torch.randn(2, 8, 16)
    with cp.ContextParallelMode(None, 0, 1, 8):
        for _ in range(2):
            compiled(x).square().sum().backward()
    eager(x).square().sum().backward()
    eager(x).square().sum().backward()
    counters = torch._dynamo.utils.counters
    assert calls == [False] * 4  # forward and recomputation, two steps, never traced
    assert counters["stats"]["unique_graphs"] >= 2 and not counters["recompiles"]  # compiled around the ring, once
    assert any("torch.compiler.disable" in reason for reason in counters["graph_break"])
    for got, want in zip(compiled.parameters(), eager.parameters()):
        torch.testing.assert_close(got.grad, want.grad)


def test_a_stage_block_compiled_runs_its_traced_attention_as_the_ring_eager(monkeypatch):
    """Inside a pipeline stage a block is a module of a torch.export-traced graph: its attention is
    ``aten.scaled_dot_product_attention`` and its positions ``aten.arange``. Compiled (``compile_stage_blocks``) and
    run under the ring's mode, dynamo breaks the graph at the ring (``torch.compiler.disable``), which runs eager,
    once per block, and the arange is the rank's global positions; the block trains as the eager stage does."""
    import torch.distributed as dist

    from autoshard.runtime import compiled as compiled_runtime

    cp = sys.modules["autoshard.runtime.context_parallel"]
    calls = []

    def one_rank_ring(query, key, value, group, is_causal=False, scale=None, balanced=False):
        calls.append(torch.compiler.is_compiling())
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=is_causal, scale=scale)

    class Positioned(Attention):
        def forward(self, x):
            return super().forward(x) + torch.arange(x.shape[1]).float()[:, None]

    monkeypatch.setattr(cp, "ring_attention", one_rank_ring)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)  # rank 1 of 2: positions 8 .. 15
    torch.manual_seed(0)
    x = torch.randn(2, 8, 16)
    model = nn.Sequential(Positioned(), Positioned())
    stages = [torch.export.unflatten(torch.export.export(model, (x,))) for _ in range(3)]
    assert compiled_runtime.compile_stage_blocks(stages[1], ["0", "1"]) == ["0", "1"]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    outs = []
    for stage in stages[:2]:
        with cp.ContextParallelMode(None, 1, 2, 8):
            outs.append(stage(x))
            outs[-1].square().sum().backward()
    counters = torch._dynamo.utils.counters
    assert calls == [False] * 4  # each block's ring, eager, in both stages
    assert counters["stats"]["unique_graphs"] >= 2 and any(
        "torch.compiler.disable" in r for r in counters["graph_break"]
    )
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-3, atol=1e-3)
    assert not torch.allclose(stages[2](x), outs[0], atol=1e-2)  # the local positions 0 .. 7 differ: shifted
    for got, want in zip(stages[1].parameters(), stages[0].parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-3, atol=1e-3)  # inductor's rounding beside eager


IMPORTS_NO_DYNAMO = """
import sys
import autoshard.runtime.context_parallel
cp = sys.modules["autoshard.runtime.context_parallel"]  # the package's name is the function
before = "torch._dynamo" in sys.modules
cp.ContextParallelMode(None, 0, 1, 8)
print(before, getattr(cp.ContextParallelMode._attention, "_torchdynamo_disable", False))
"""


def test_the_ring_is_eager_under_compile_from_its_first_mode_and_the_runtime_imports_no_dynamo_before():
    """The ring's ``torch.compiler.disable`` is applied as the first ring mode is made: importing the runtime imports
    no ``torch._dynamo`` (about 1.2 s of CPU per process, in every rank of every program without a ring)."""
    out = subprocess.run([sys.executable, "-c", IMPORTS_NO_DYNAMO], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"]


@pytest.mark.parametrize("pins, outside", [(dict(dp=1, cp=2), True), (dict(dp=1, pp=2), False)])
def test_beside_cp_and_in_stages_the_recompute_is_eager_around_the_compiled_block(pins, outside):
    """The search keeps compile beside cp and in stages to none or full recompute; beside cp the lowered step says
    the recompute wraps the compiled block (an older plan's step is unchanged), in stages the stage applier does."""
    plan = autoshard.plan(GPT, devices_per_node=2, global_batch=8, tp=1, compile=True, **pins)
    assert plan.decisions.compile and plan.recompute in ("none", "full")
    full = autoshard.plan(GPT, devices_per_node=2, global_batch=8, tp=1, compile=True, recompute="full", **pins)
    steps = lower(full)
    ops = [s.op for s in steps]
    assert ops.index("apply_ac") < ops.index("apply_compile")
    assert dict(steps[ops.index("apply_compile")].arguments).get("recompute_outside", False) == outside


def test_verify_says_what_cpu_ranks_leave_unproven_of_compiled_blocks(compiled_plan):
    from autoshard.verify import compile_notes

    (note,) = compile_notes(compiled_plan)
    assert "inductor's CPU kernels" in note and "Triton kernels" in note
    assert compile_notes(autoshard.plan(GPT, devices_per_node=2, global_batch=8, dp=2, zero=3)) == ()


def test_stage_blocks_compile_static_so_the_recompute_reruns_the_forwards_graph(monkeypatch):
    """A rank holding several stages meets one block code under more than one guard set; compiled static, no dynamic
    graph can match the same inputs as the static one, so an eager recompute reruns the forward's graph."""
    import torch.fx

    from autoshard.runtime import compiled

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.h = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

        def forward(self, x):
            return self.h[1](self.h[0](x))

    calls = []
    monkeypatch.setattr(compiled.torch, "compile", lambda fn, **kw: calls.append(kw) or fn)
    stage = torch.fx.symbolic_trace(Stage())
    assert compiled.compile_stage_blocks(stage, ["h.0", "h.1", "h.2"]) == ["h.0", "h.1"]  # h.2: another stage's
    assert [kw["dynamic"] for kw in calls] == [False, False]


def test_per_block_recompute_beside_compiled_blocks_takes_only_the_modes_they_run_under():
    """Beside cp the search's per-block recompute (``passes.planning.recompute``) offers none and full only: a
    selective block's policy is a dispatch mode under which dynamo compiles nothing, so it would be priced compiled
    and run eager. SPMD without cp every mode runs compiled; without compile every mode is offered."""
    from autoshard.ir.decisions import Decisions
    from autoshard.passes.planning.recompute import block_modes_run

    def point(mesh, compile):
        return Decisions(mesh=mesh, zero_stage=0, microbatch_size=2, num_microbatches=1, compile=compile)

    assert block_modes_run(point(Mesh(dp=1, cp=2), True)) == ("none", "full")
    assert block_modes_run(point(Mesh(dp=1, cp=2), False)) == ("none", "selective", "full")
    assert block_modes_run(point(Mesh(dp=1, tp=2), True)) == ("none", "selective", "full")


def test_a_plan_file_with_compile_where_it_is_not_emitted_is_one_line(in_repo):
    """A hand-edited plan whose compiled blocks are not emitted (a zero-bubble schedule's split backward) is refused
    when read."""
    import json

    plan = autoshard.plan(GPT, devices_per_node=2, global_batch=8, dp=1, pp=2, schedule="zbv", recompute="full")
    doc = json.loads(plan.to_json())
    doc["decisions"]["compile"] = True
    with pytest.raises(AutoshardError, match="compiled blocks are not emitted") as refused:
        Plan.from_json(json.dumps(doc))
    assert "\n" not in str(refused.value)
