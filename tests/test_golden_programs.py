"""Emitted programs of every plan kind against their reviewed text, and the applier against the program.

``tests/golden/<kind>.plan.json`` is a plan; ``<kind>.py`` the program ``autoshard compile`` must print for
it, byte for byte. After a deliberate change to the programs, rewrite them with
``AUTOSHARD_UPDATE_GOLDEN=1 pytest tests/test_golden_programs.py`` and review the diff.

The second test runs, in one process, the steps the Python API applies (``runtime.parallel.apply_steps``
on ``passes.lower``'s steps) and the emitted program's ``parallelize`` / ``build_pipeline``, each with the
applier's functions replaced by recorders, and requires the same calls with the same arguments in the
same order: the program and ``autoshard.parallelize`` cannot drift apart. The program's layout constants
(the mesh, the axes its loop reads, the sequence length) are ``passes.lower.layout``'s fields, which
``autoshard.parallelize`` reads, and the applier's table holds a function for every op the lowering emits.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from autoshard.ir.plan import load_plan
from autoshard.ir.steps import OPS, RESULTS
from autoshard.passes.codegen import emit_program
from autoshard.passes.lower import layout, lower
from autoshard.runtime import parallel

GOLDEN = Path(__file__).resolve().parent / "golden"
KINDS = sorted(p.name.removesuffix(".plan.json") for p in GOLDEN.glob("*.plan.json"))
RUN_INPUTS = {"device": "DEVICE", "lr": 0.5, "example_microbatch": "EXAMPLE", "loss_fn": "LOSS"}


def test_the_kinds_cover_every_plan_shape():
    plans = [load_plan(GOLDEN / f"{kind}.plan.json") for kind in KINDS]
    assert len(KINDS) >= 6
    assert {p.zero_stage for p in plans if p.mesh.pp == 1 and p.mesh.dp > 1} >= {1, 2, 3}
    assert any(p.mesh.tp > 1 and p.mesh.dp > 1 and p.mesh.pp == 1 for p in plans)
    assert any(p.schedule == "interleaved-1f1b" for p in plans)
    assert any(p.schedule == "zbv" for p in plans)  # stages in a V, backward split
    assert any(p.mesh.tp > 1 and p.mesh.pp > 1 for p in plans)
    assert any(p.recompute == "mixed" for p in plans)
    assert any(p.recompute != "none" and p.mesh.pp > 1 for p in plans)
    assert {p.zero_stage for p in plans if p.mesh.tp > 1 and p.mesh.dp > 1} >= {0, 1}  # replicate; distributed optimizer
    assert any(p.dp_replicate > 1 for p in plans)  # HSDP
    assert any(p.mesh.cp > 1 and p.mesh.dp > 1 and p.model.get("seq_len") for p in plans)  # context parallel, --seq-len


@pytest.mark.parametrize("kind", KINDS)
def test_program_is_the_reviewed_one(kind):
    program = emit_program(load_plan(GOLDEN / f"{kind}.plan.json"))
    golden = GOLDEN / f"{kind}.py"
    if os.environ.get("AUTOSHARD_UPDATE_GOLDEN"):
        golden.write_text(program)
    compile(program, str(golden), "exec")
    assert program == golden.read_text(), f"{kind}: the emitted program changed; review it and update the golden"


@pytest.mark.parametrize("kind", KINDS)
def test_applier_and_program_make_the_same_calls(kind, monkeypatch):
    plan = load_plan(GOLDEN / f"{kind}.plan.json")
    applied: list = []
    for op in OPS:
        monkeypatch.setitem(parallel.APPLIERS, op, _recorder(applied, op))
    parallel.apply_steps("MODEL", lower(plan), FakeMesh(), **RUN_INPUTS)

    printed: list = []
    namespace = {"__name__": "emitted"}  # the program's main() runs only as __main__
    exec(compile(emit_program(plan), f"{kind}.py", "exec"), namespace)
    for op in OPS:
        if op in namespace:
            namespace[op] = _recorder(printed, op)
    if plan.mesh.pp > 1:
        namespace["build_pipeline"]("MODEL", FakeMesh(), "DEVICE", 0.5, "EXAMPLE", "LOSS")
    else:
        namespace["parallelize"]("MODEL", FakeMesh(), "DEVICE", 0.5)

    assert printed == applied
    assert [call[0] for call in applied] == [step.op for step in lower(plan)]


def test_every_op_the_lowering_emits_has_its_applier():
    """``apply_steps`` finds each op's function in ``runtime.parallel.APPLIERS``: one for every op of ``ir.steps``
    (a Step refuses any other op), each the function the emitted programs import under the op's name."""
    emitted = {step.op for kind in KINDS for step in lower(load_plan(GOLDEN / f"{kind}.plan.json"))}
    assert set(parallel.APPLIERS) == set(OPS) >= emitted
    for op, function in parallel.APPLIERS.items():
        assert getattr(parallel, op) is function, op


@pytest.mark.parametrize("kind", KINDS)
def test_program_constants_are_the_plans_layout(kind):
    """The constants the emitted loop hands to the runtime are the layout ``autoshard.parallelize`` applies."""
    plan = load_plan(GOLDEN / f"{kind}.plan.json")
    spec = layout(plan)
    constants = {t.id: ast.literal_eval(n.value) for n in ast.parse(emit_program(plan)).body
                 if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)
                 and t.id in ("MESH", "FLATTEN", "DATA_AXIS", "SEQUENCE_AXIS", "LOSS_AXIS", "SEQ_LEN",
                              "TOKENS_PER_SAMPLE")}
    expected = {"MESH": dict(spec.mesh), "FLATTEN": dict(spec.flatten), "DATA_AXIS": spec.data_axis,
                "SEQ_LEN": spec.seq_len, "TOKENS_PER_SAMPLE": spec.tokens_per_sample}
    if plan.mesh.pp == 1:  # a pipeline's schedule averages the loss itself; cp is not emitted with pp
        expected |= {"SEQUENCE_AXIS": spec.sequence_axis, "LOSS_AXIS": spec.loss_axis}
    assert constants == expected
    assert list(constants["MESH"]) == [d for d in ("pp", "dp", "cp", "tp") if d != "cp" or plan.mesh.cp > 1]
    assert spec.world_size == plan.world_size


class FakeMesh:
    """Stands for the DeviceMesh: ``mesh["dp"]`` is the string "mesh[dp]"."""

    def __getitem__(self, dim: str) -> str:
        return f"mesh[{dim}]"

    def __eq__(self, other) -> bool:
        return isinstance(other, FakeMesh)


def _recorder(calls: list, op: str):
    def record(target, *args, **kwargs):
        calls.append((op, target, _plain(list(args)), _plain(kwargs)))
        if op == "split_pipeline":
            return "STAGES"
        return RESULTS.get(op, target).upper() if op in RESULTS else target
    return record


def _plain(value):
    """Lists for tuples, so a constant printed as a list equals the step's tuple."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value
