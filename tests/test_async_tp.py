"""--async-tp on: where it runs, the decision in the plan, its lowering and program lines, its price, its twin."""

import types

import pytest

import autoshard
from autoshard.cost import eager
from autoshard.cost.async_tp import exposed_tp_comm_s, fused_collectives
from autoshard.cost.hardware import load_cluster
from autoshard.errors import AutoshardError
from autoshard.ir.decisions import Mesh, async_tp_refusal
from autoshard.ir.pins import Pins
from autoshard.ir.plan import Plan, load_plan
from autoshard.passes.lowering.codegen import emit_program
from autoshard.passes.lowering.lower import lower
from autoshard.passes.planning import pin_checks
from autoshard.passes.planning.strategies import async_tp_choices
from autoshard.runtime.compiled import apply_async_tp
from autoshard.verify import async_tp_twin

GOLDEN = "tests/golden/async_tp.plan.json"  # GPT on dgx-h100: dp 4 x tp 2, SP, full recompute, compile, async TP


@pytest.fixture(scope="module")
def plan():
    return load_plan(GOLDEN)


@pytest.mark.parametrize(
    "pins, words",
    [
        (dict(tp=2, compile=False), "pin --compile on"),
        (dict(tp=2, compile=True, sequence_parallel=False), "pin --sequence-parallel on"),
        (dict(tp=1, compile=True), "the plan has tp 1"),
        (dict(tp=2, pp=2, compile=True), "micro-pipeline pass does not match"),
    ],
)
def test_async_tp_where_it_does_not_run_is_one_line(pins, words):
    cluster = load_cluster("dgx-h100")
    with pytest.raises(AutoshardError, match=words) as err:
        pin_checks.check_pins(Pins(async_tp=True, **pins), cluster, 64)
    assert "\n" not in str(err.value) and "--async-tp" in str(err.value)


def test_async_tp_is_refused_on_gloo_and_searched_only_under_compile_with_sequence_parallelism_on_nccl():
    gloo, nccl = load_cluster("local-cpu", devices_per_node=2), load_cluster("dgx-h100")
    with pytest.raises(AutoshardError, match="CPUs on gloo"):
        pin_checks.check_pins(Pins(async_tp=True, tp=2, compile=True), gloo, 8)
    tp2 = Mesh(dp=4, tp=2)
    assert async_tp_choices(tp2, True, True, nccl) == (False, True)
    assert async_tp_choices(tp2, True, True, gloo) == (False,)
    assert async_tp_choices(tp2, False, True, nccl) == async_tp_choices(tp2, True, False, nccl) == (False,)
    assert async_tp_refusal(tp2, True, True, "nccl") == ""
    assert async_tp_choices(Mesh(dp=2, tp=2, pp=2), True, True, nccl) == (False,)  # stages: custom-op collectives


def test_the_plan_records_async_tp_and_older_plans_read_and_write_as_before(plan):
    assert plan.decisions.async_tp and '"async_tp": true' in plan.to_json()
    assert Plan.from_json(plan.to_json()).decisions.async_tp
    off = Plan.from_json(plan.to_json().replace('"async_tp": true', '"async_tp": false'))
    assert not off.decisions.async_tp and '"async_tp": ' not in off.to_json()  # WRITTEN_UNLESS: older plans unchanged
    with pytest.raises(AutoshardError, match="async_tp is true but cannot run in this plan: it is an inductor pass"):
        Plan.from_json(plan.to_json().replace('"compile": true', '"compile": false'))


def test_async_tp_is_lowered_before_the_blocks_compile_and_emitted_as_torchtitan_turns_it_on(plan):
    steps = lower(plan)
    ops = [s.op for s in steps]
    assert ops.index("apply_ac") < ops.index("apply_async_tp") == ops.index("apply_compile") - 1
    assert steps[ops.index("apply_async_tp")].mesh_dim == "tp"
    program = emit_program(plan)
    assert 'model = apply_async_tp(model, mesh["tp"])' in program
    assert program.index("apply_async_tp(model") < program.index("apply_compile(model")
    without = emit_program(Plan.from_json(plan.to_json().replace('"async_tp": true', '"async_tp": false')))
    assert "apply_async_tp" not in without


def test_the_applier_turns_on_symmetric_memory_and_the_micro_pipeline_pass_on_cuda_only(monkeypatch):
    import torch
    import torch.distributed._symmetric_memory as symm_mem

    with pytest.raises(AutoshardError, match="async TP needs CUDA ranks") as err:
        apply_async_tp("MODEL", types.SimpleNamespace(device_type="cpu"))
    assert "\n" not in str(err.value) and "--async-tp off" in str(err.value)
    groups = []
    monkeypatch.setattr(symm_mem, "enable_symm_mem_for_group", groups.append)
    monkeypatch.setattr(torch._inductor.config, "_micro_pipeline_tp", False)
    mesh = types.SimpleNamespace(device_type="cuda", get_group=lambda: types.SimpleNamespace(group_name="tp-7"))
    assert apply_async_tp("MODEL", mesh) == "MODEL"
    assert groups == ["tp-7"] and torch._inductor.config._micro_pipeline_tp


def test_async_tp_hides_the_shorter_stream_but_one_chunk_and_pays_a_launch_per_chunk():
    """exposed(C) = max(0, C − M) + min(C, M)/tp + n·tp·LAUNCH_US (cost.async_tp): comm longer than the matmuls
    shows its excess, shorter is hidden but for one chunk in tp; never above the collectives run synchronously
    plus the chunks' launches."""
    launch = 6 * 4 * eager.LAUNCH_US * 1e-6
    assert exposed_tp_comm_s(0.0, 1.0, 6, 4) == pytest.approx(launch)
    assert exposed_tp_comm_s(0.4, 1.0, 6, 4) == pytest.approx(0.1 + launch)
    assert exposed_tp_comm_s(3.0, 1.0, 6, 4) == pytest.approx(2.0 + 0.25 + launch)
    for comm in (0.1, 1.0, 10.0):
        assert exposed_tp_comm_s(comm, 1.0, 6, 4) < comm + launch


def test_the_fused_collectives_are_the_blocks_sequence_gathers_and_reduce_scatters(plan):
    """One all-gather into attention and one into the MLP, one reduce-scatter out of each, per block; the head's
    and the embeddings' stay outside the compiled blocks. Forward and backward, full recompute's rerun × 1.5."""
    styles = plan.tensor_parallel
    per_block = {"gather-seq-module-input-dim1", "rowwise-seq-output-dim1"}
    expected = sum(1 for path, s in styles.items() if s in per_block and path.startswith(tuple(plan.blocks)))
    assert expected == 4 * len(plan.blocks)
    assert fused_collectives(styles, tuple(plan.blocks), 1.5) == expected * 2 * 1.5


def test_async_tp_is_priced_on_the_same_compute_and_searched_against_the_plan_without_it(plan):
    """Repriced with async TP off, the same layout's compute stays; async TP trades the hidden collectives for a launch
    per chunk (cost.async_tp), so it never exposes more than those launches beyond the plan without it. On this tiny
    GPT the launches outweigh what it hides, and the search (async TP unpinned) keeps it off."""
    pins = dict(dp=4, tp=2, pp=1, zero=3, microbatch_size=8, recompute="full", sequence_parallel=True, compile=True)
    kw = dict(cluster="dgx-h100", nodes=1, global_batch=64, **pins)
    on, off, searched = (autoshard.plan("examples/gpt.py:build", async_tp=at, **kw) for at in (True, False, None))
    assert on.decisions.async_tp and not off.decisions.async_tp
    assert on.predicted.compute_s == pytest.approx(off.predicted.compute_s)
    launches = on.num_microbatches * fused_collectives(on.tensor_parallel, tuple(on.blocks), 1.5) * 2
    launches_s = launches * eager.LAUNCH_US * 1e-6
    assert off.predicted.comm_exposed_s < on.predicted.comm_exposed_s <= off.predicted.comm_exposed_s + launches_s
    assert not searched.decisions.async_tp and searched.predicted.step_time_s == off.predicted.step_time_s


def test_verify_runs_the_twin_without_async_tp_and_says_what_cpu_ranks_leave_unproven(plan):
    twin, notes = async_tp_twin(plan)
    assert not twin.decisions.async_tp and twin.decisions.compile and twin.tensor_parallel == plan.tensor_parallel
    assert len(notes) == 1 and "symmetric memory" in notes[0] and "not proven here" in notes[0]
    assert async_tp_twin(twin) == (twin, ())
