"""``autoshard verify`` fails programs with a bug injected into their ranks and passes the same plans unpatched.

The bugs (``inject_driver.py``, patched at the torch level in the ranks only, rank 1 of 2): its linear outputs 1 %
too large, its loss gradient doubled, its optimizer steps 1 % further, and the dp ranks reading the same samples.
Every plan kind (DDP, FSDP, tp 2, pp 2, cp 2, ep 2) runs unpatched in bf16, which verify runs twice: its fp32 twin
(the same layout at --precision fp32, so the fp32 plan unpatched) at fp32's tolerance, then the bf16 run at
bf16's. The bugs run on the cheapest subset that still covers each bug and each kind: all three rank bugs on the
bf16 tp 2 plan (which the bf16 tolerance alone passed: its worst tensor within 100x the bf16 noise), each caught
by its fp32 twin; and one fp32 plan per bug. The full matrix (6 kinds x fp32, bf16 x 5) is
``benchmarks/bench_verify_injected.py`` (docs/verify.md, the smallest bug caught). Every case is a job of the session's
2-rank launch (``one_launch.Cases``; ``injected_cases.py``).
"""

from __future__ import annotations

import pytest

from autoshard.verify import TWIN_FAILED, summary_lines
from e2e.injected_cases import KINDS, injected_cases
from e2e.one_launch import Cases

pytestmark = pytest.mark.e2e

UNPATCHED = {f"{kind}-bf16-none": (kind, "bf16", "none") for kind in KINDS}
BF16_BUGS = {  # the bugs bf16's tolerance alone did not catch on the tp 2 plan
    f"tp2-bf16-{name}": ("tp2", "bf16", bug)
    for name, bug in (("linear-1pct", "linear:1:0.01"), ("loss-grad-x2", "loss-grad:1:2"), ("step-1pct", "step:1:1.01"))
}
FP32_BUGS = {
    "ddp-fp32-step-1pct": ("ddp", "fp32", "step:1:1.01"),  # the replica whose weights DCP does not write
    "fsdp-fp32-same-samples": ("fsdp", "fp32", "same-samples"),
    "pp2-fp32-loss-grad-x2": ("pp2", "fp32", "loss-grad:1:2"),  # the last stage's loss
    "cp2-fp32-linear-1pct": ("cp2", "fp32", "linear:1:0.01"),  # one rank's half of every sequence
    "ep2-fp32-linear-1pct": ("ep2", "fp32", "linear:1:0.01"),
}
CASES = {**UNPATCHED, **BF16_BUGS, **FP32_BUGS}
LAUNCHES = Cases(
    dict.fromkeys(CASES, 2),
    *injected_cases(CASES),
    case_of=lambda test, params: params.get("name"),
)


@pytest.fixture(scope="module")
def verified(launches):
    """name -> (plan, verify report)."""
    return lambda name: launches.result(LAUNCHES, name)


@pytest.mark.parametrize("name", sorted(UNPATCHED))
def test_verify_passes_each_plan_kind_unpatched_in_fp32_and_bf16(verified, name):
    plan, report = verified(name)
    assert plan.precision == "bf16-autocast"
    assert report.ok, report.failure
    assert report.twin is not None and report.twin.ok  # the fp32 twin: the same layout in fp32
    assert len(report.twin.parallel_losses) == len(report.parallel_losses) == 2
    assert report.twin.parallel_losses != report.parallel_losses  # two programs, two precisions
    assert any("verified first in fp32" in line for line in summary_lines(report))


@pytest.mark.parametrize("name", sorted(BF16_BUGS))
def test_verify_fails_bf16_layout_bugs_through_the_fp32_twin(verified, name):
    plan, report = verified(name)
    assert plan.mesh.tp == 2 and plan.precision == "bf16-autocast"
    assert not report.ok, f"{name} passed:\n" + "\n".join(summary_lines(report))
    assert report.failure.startswith(TWIN_FAILED), report.failure
    assert report.twin.most_off[0].excess > 1


@pytest.mark.parametrize("name", sorted(FP32_BUGS))
def test_verify_fails_fp32_plans_with_a_rank_bug(verified, name):
    plan, report = verified(name)
    assert plan.precision == "fp32" and report.twin is None
    assert not report.ok, f"{name} passed:\n" + "\n".join(summary_lines(report))
