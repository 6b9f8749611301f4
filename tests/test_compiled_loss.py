"""--compile-loss on|off: where it runs, the decision in the plan, its program lines, its price."""

import pytest

from autoshard.cost import eager
from autoshard.cost.hardware import load_cluster
from autoshard.cost.tables import CostTables, Runtime
from autoshard.cost.units import loss_logits, unit_activation_bytes
from autoshard.errors import AutoshardError
from autoshard.ir.decisions import Mesh, compile_loss_refusal
from autoshard.ir.pins import PIN_OF, Pins
from autoshard.ir.plan import Plan, load_plan
from autoshard.passes.lowering.codegen import emit_program
from autoshard.passes.planning import pin_checks
from autoshard.passes.planning.strategies import compile_loss_choices
from autoshard.pipeline import capture_graph

GOLDEN = "tests/golden/compiled_loss.plan.json"  # GPT on 2 CPU ranks: dp 2, ZeRO-3, compiled blocks and loss
GPT = "examples/gpt.py:build"


@pytest.fixture(scope="module")
def plan():
    return load_plan(GOLDEN)


def test_the_loss_is_compiled_with_the_blocks_outside_pipelines_and_refused_in_one_line_inside():
    spmd, piped = Mesh(dp=2), Mesh(dp=1, pp=2)
    assert compile_loss_choices(spmd, True, None) == (True,)  # torchtitan's default under --training.compile
    assert compile_loss_choices(spmd, False, None) == (False,)
    assert compile_loss_choices(spmd, True, False) == (False,) and compile_loss_choices(spmd, False, True) == (True,)
    assert compile_loss_choices(piped, True, None) == (False,) and compile_loss_choices(piped, True, True) == ()
    assert compile_loss_choices(Mesh(tp=2), True, None, True) == (False,)  # beside loss parallelism: eager
    assert compile_loss_refusal(spmd) == "" and "last stage" in compile_loss_refusal(piped)
    cluster = load_cluster("local-cpu", devices_per_node=2)
    for pins, words in ((dict(pp=2), "last stage"), (dict(tp=2, loss_parallel=True), "--loss-parallel off")):
        with pytest.raises(AutoshardError, match="--compile-loss on is not emitted here") as err:
            pin_checks.check_pins(Pins(compile_loss=True, **pins), cluster, 8)
        assert "\n" not in str(err.value) and "--compile-loss off" in str(err.value) and words in str(err.value)
    estimate_default = PIN_OF["compile_loss"].default
    assert estimate_default(Pins(compile=True, pp=1)) and not estimate_default(Pins(compile=True, pp=2))
    assert not estimate_default(Pins(pp=1)) and not estimate_default(Pins(compile=True, loss_parallel=True))


def test_the_plan_records_the_compiled_loss_and_older_plans_read_and_write_as_before(plan):
    assert plan.decisions.compile_loss and '"compile_loss": true' in plan.to_json()
    off = Plan.from_json(plan.to_json().replace('"compile_loss": true', '"compile_loss": false'))
    assert not off.decisions.compile_loss and '"compile_loss": ' not in off.to_json()  # WRITTEN_UNLESS


def test_the_program_calls_the_compiled_loss_only_when_the_plan_compiles_it(plan):
    program = emit_program(plan)
    assert "loss_fn = runtime.compiled_loss(model_file.loss)" in program
    assert "runtime.forward_backward(model, inputs, targets, loss_fn, mesh," in program
    without = emit_program(Plan.from_json(plan.to_json().replace('"compile_loss": true', '"compile_loss": false')))
    assert "compiled_loss" not in without and "targets, model_file.loss, mesh," in without


def test_the_compiled_loss_keeps_the_logits_in_place_of_the_fp32_copies_and_moves_fewer_bytes():
    """Eager (bf16 logits, n of them): saved 4·n in place of the logits, workspace 8·n; compiled: the logits kept
    (2·n), workspace their gradient 2·n (cost.eager "Loss"), forward and backward 2·2·n bytes each. On CPU ranks
    (the fused roofline) neither adds anything."""
    graph = capture_graph(GPT, use_cache=True, proofs=False)[1]
    gpu = load_cluster("dgx-h100")
    tables = CostTables(graph, gpu, Runtime.for_cluster(gpu, graph))
    b, elem = 4, tables.precision.activation_bytes
    eager_units, compiled_units = (tables.units(b, "none", None, False, None, loss) for loss in (False, True))
    n = loss_logits(graph, b)
    logits = int(graph.nodes[-1].bytes_written * b / graph.batch_size * elem / 4)
    assert elem == 2 and logits == pytest.approx(2 * n, rel=1e-6)
    base = unit_activation_bytes(graph, b, "none", elem, 4, "fused")  # the suffix without the loss's bytes
    assert eager_units.saved_bytes[-1] - compiled_units.saved_bytes[-1] == int(4 * n) - logits
    assert compiled_units.saved_bytes[:-1] == eager_units.saved_bytes[:-1]
    assert compiled_units.workspace_bytes[-1] == max(base[1][-1], logits)
    assert eager_units.workspace_bytes[-1] == max(base[1][-1], int(8 * n))
    forward_saved = eager.loss_forward_s(n, gpu.device) - eager.compiled_loss_forward_s(n, elem, gpu.device)
    backward_saved = eager.loss_backward_s(n, gpu.device) - eager.compiled_loss_backward_s(n, elem, gpu.device)
    assert eager_units.forward_s[-1] - compiled_units.forward_s[-1] == pytest.approx(forward_saved)
    assert eager_units.backward_s[-1] - compiled_units.backward_s[-1] == pytest.approx(backward_saved)
    assert forward_saved > 0 and backward_saved > 0
    cpu_tables = CostTables(graph, load_cluster("local-cpu", devices_per_node=2))
    assert cpu_tables.units(b, "none", None, False, None, True) == cpu_tables.units(b, "none", None, False, None)
