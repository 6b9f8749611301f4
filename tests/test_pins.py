"""The pins: one table (``ir.pins.PINS``) gives ``Pins``' fields, the flags of ``autoshard plan`` and
``estimate``, and the Python API's keywords; each pin is a field of ``Decisions`` (the mesh's by axis) or the
stage cuts."""

from dataclasses import fields

import pytest

from autoshard.cli import build_parser
from autoshard.commands import pins_of
from autoshard.errors import AutoshardError
from autoshard.ir.decisions import Decisions, Mesh
from autoshard.ir.pins import PIN_OF, PINS, Pins
from autoshard.passes.planning import strategies

GPT = "examples/gpt.py:build"


def test_every_pin_is_a_decision_and_a_field_of_pins():
    decided = {f.name for f in fields(Decisions)} | {f.name for f in fields(Mesh)} | {"stage_cuts"}
    assert [f.name for f in fields(Pins)] == [row.name for row in PINS]
    assert {row.name for row in PINS} <= decided
    assert strategies.Pins is Pins  # still importable where it lived
    assert len({row.flag for row in PINS}) == len(PINS) and len(PIN_OF) == len(PINS) + 1  # zero beside zero_stage


@pytest.mark.parametrize("command", ["plan", "estimate"])
def test_every_pin_is_a_flag_stored_under_its_field(command):
    sub = build_parser()._subparsers._group_actions[0].choices[command]
    flags = {opt: action for action in sub._actions for opt in action.option_strings}
    for row in PINS:
        assert flags[row.flag].dest == row.name and flags[row.flag].help == row.help
    args = build_parser().parse_args(
        [
            command,
            GPT,
            "--cluster",
            "local-cpu",
            "--global-batch",
            "8",
            "--zero",
            "3",
            "--sequence-parallel",
            "ON",
            "--schedule",
            "GPipe",
            "--stage-cuts",
            "even",
        ]
    )
    pins = Pins(**pins_of(args))
    assert (pins.zero_stage, pins.sequence_parallel, pins.schedule, pins.stage_cuts) == (3, True, "gpipe", "even")
    assert pins.names == ("zero", "schedule", "stage_cuts", "sequence_parallel")  # provenance.pinned: the flags' names


def test_the_api_keyword_and_the_field_name_are_one_pin():
    assert Pins(zero=3) == Pins(zero_stage=3) and Pins(zero=3).names == ("zero",)
    assert Pins(zero=None, zero_stage=2).zero_stage == 2
    with pytest.raises(AutoshardError, match="zero and zero_stage pin the same decision \\(--zero\\); give one"):
        Pins(zero=1, zero_stage=2)
    with pytest.raises(AutoshardError, match="unknown pin 'colour'; the pins are dp, tp, pp, zero, "):
        Pins(colour=1)


@pytest.mark.parametrize(
    "pins, message",
    [
        (dict(dp=0), "--dp 0 must be a positive integer"),
        (dict(dp_replicate=True), "--dp-replicate True must be a positive integer"),
        (dict(zero=5), "--zero 5 must be 0, 1, 2 or 3"),
        (dict(recompute="sometimes"), "--recompute sometimes must be one of none, selective, full"),
        (dict(schedule="ZB"), "--schedule zb must be one of gpipe, "),
        (dict(stage_cuts="3,2"), "--stage-cuts 3,2 must be 'even' or increasing block indices"),
        (dict(sequence_parallel="maybe"), "--sequence-parallel 'maybe' must be on or off"),
    ],
)
def test_each_pin_is_checked_by_its_row(pins, message):
    with pytest.raises(AutoshardError, match=message):
        Pins(**pins)


def test_estimate_defaults_come_from_the_rows():
    pins = Pins(dp=2, tp=2, pp=1, zero=1, microbatch_size=2, recompute="none").with_defaults()
    assert (pins.schedule, pins.virtual_stages, pins.dp_replicate, pins.ep, pins.cp, pins.sequence_parallel) == (
        "none",
        1,
        1,
        1,
        1,
        True,
    )
    assert Pins(pp=2, virtual_stages=2).with_defaults().schedule == "interleaved-1f1b"
    assert Pins(pp=2).missing_for_estimate() == ("dp", "tp", "zero", "microbatch_size", "recompute", "schedule")
    assert [PIN_OF[name].flag for name in Pins().missing_for_estimate()][:4] == ["--dp", "--tp", "--pp", "--zero"]
