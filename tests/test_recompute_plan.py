"""A mixed-recompute plan as users meet it: JSON round trip, the emitted program, inspect."""

from __future__ import annotations

from pathlib import Path

import pytest

import autoshard
from autoshard.cli import main
from autoshard.ir.plan import Plan, load_plan
from autoshard.passes.lowering.codegen import emit_program

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def mixed_plan():
    plan = autoshard.plan(
        str(ROOT / "tests/models/wide_gpt.py:build_deep"),
        cluster="dgx-a100-80gb",
        nodes=2,
        global_batch=64,
        sequence_parallel=False,
    )  # 60B on 16 A100s: some blocks recompute
    assert plan.recompute == "mixed"
    return plan


def test_round_trip_and_program(mixed_plan, tmp_path):
    path = tmp_path / "plan.json"
    mixed_plan.save(path)
    again = load_plan(path)
    assert again.to_json() == path.read_text() and again.recompute_blocks == mixed_plan.recompute_blocks
    program = emit_program(mixed_plan)
    compile(program, "train.py", "exec")
    assert "RECOMPUTE = {" in program and "model = apply_ac(model, modes=RECOMPUTE)" in program
    for block, mode in mixed_plan.recompute_blocks.items():
        assert f"{block!r}: {mode!r}," in program


def test_inspect_names_the_blocks_per_mode(mixed_plan, tmp_path, capsys):
    path = tmp_path / "plan.json"
    mixed_plan.save(path)
    assert main(["inspect", str(path)]) == 0
    assert "mixed: " in capsys.readouterr().out


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d["decisions"].update(recompute_blocks={}), "mixed plan gives every block"),
        (lambda d: d["decisions"]["recompute_blocks"].update({"h.0": "sometimes"}), "decisions.recompute_blocks.h.0"),
        (lambda d: d["decisions"].update(recompute="none"), "mixed plan gives every block"),
    ],
)
def test_tampered_mixed_plans_are_refused(mixed_plan, change, message):
    import json

    from autoshard.errors import AutoshardError

    d = json.loads(mixed_plan.to_json())
    change(d)
    with pytest.raises(AutoshardError, match=message):
        Plan.from_dict(d)
