"""A checkpoint saved under one plan resumes under another (DCP reshards by parameter name).

Each case's runs are jobs of the session's one torchrun launch per world size (``one_launch.Cases``),
each a fresh program, model and optimizer, before every job that fixes randomness."""

import pytest
import torch

import autoshard
from autoshard.launch import write_program
from autoshard.runtime.report import read_weights
from autoshard.verify import WEIGHT_RTOL, weight_atol
from e2e.one_launch import Cases, attempt, job

pytestmark = pytest.mark.e2e

GPT, FAST = "examples/gpt.py:build", "tests/clusters/fast_link_cpu.yaml"
LR = 1e-3
CASES = {  # name: (cluster, ranks, pins saved under), (cluster, ranks, pins resumed under)
    "dp4-zero3-to-dp2-tp2": (("local-cpu", 4, dict(dp=4, zero=3)), (FAST, 4, dict(dp=2, tp=2, zero=3))),
    "pp2-1f1b-to-pp2-interleaved": (
        ("local-cpu", 2, dict(pp=2, schedule="1f1b")),
        ("local-cpu", 2, dict(pp=2, schedule="interleaved-1f1b")),
    ),
    "dp2-zero0-to-pp2": (("local-cpu", 2, dict(dp=2, zero=0)), ("local-cpu", 2, dict(pp=2, schedule="gpipe"))),
    # lm_head.weight tied to transformer.wte.weight: one optimizer state under DDP; in a V, rank 0 holds both
    # copies (stages 0 and 3), which load that one state
    "tied-dp2-zero0-to-pp2-zbv": (("local-cpu", 2, dict(dp=2, zero=0)), ("local-cpu", 2, dict(pp=2, schedule="zbv"))),
}
MODELS = {"tied-dp2-zero0-to-pp2-zbv": "tests/models/nanogpt.py:build_4_layers"}  # the others: GPT


def reshard_runs(case, folder, ranks):
    """Plan a trains 2 steps (checkpoint at step 2); plan b loads a copy of that checkpoint and runs no step;
    then each plan runs step 3 from its own copy. Each run a fresh program, model and optimizer."""
    a, b = (
        write_program(
            autoshard.plan(MODELS.get(case, GPT), cluster=cluster, devices_per_node=n, global_batch=8, **pins),
            folder / f"{name}.py",
        )
        for name, (cluster, n, pins) in zip("ab", CASES[case])
    )
    assert all(n == ranks for _, n, _ in CASES[case])
    return [
        train(a, folder / "a2", 2, folder / "ckpt"),
        # b2 resumes at step 2 and runs nothing
        train(b, folder / "b2", 2, folder / "ckpt_b", copy=(folder / "ckpt", folder / "ckpt_b")),
        train(a, folder / "a3", 3, folder / "ckpt"),
        train(b, folder / "b3", 3, folder / "ckpt_b"),
    ], folder


def train(program, out, steps, ckpt, copy=None):
    return job(
        program,
        ["--steps", steps, "--lr", LR, "--metrics-out", out, "--checkpoint-dir", ckpt, "--checkpoint-every", 2],
        out,
        copy=copy,
        draws=True,
    )


# case -> (its folder, each run's failure: "" when it ran to its end)
LAUNCHES = Cases(
    {case: CASES[case][0][1] for case in CASES},
    prepare=lambda names, ranks, root: {
        case: attempt(lambda: reshard_runs(case, root / case, ranks)) for case in names
    },
    finish=lambda case, folder, failures: (folder, failures),
    case_of=lambda test, params: params.get("case"),
)


def params(out):
    return read_weights(out)


@pytest.mark.parametrize("case", sorted(CASES))
def test_checkpoint_resumes_under_another_plan(launches, case):
    folder, failures = launches.result(LAUNCHES, case)
    assert not any(failures), "\n".join(failures)[-4000:]  # every run ran to its end
    after_two, loaded = params(folder / "a2"), params(folder / "b2")
    assert loaded.keys() == after_two.keys()
    for name, value in after_two.items():
        assert torch.equal(loaded[name], value), name  # the same parameters, whatever the layout
    # one more step under each plan: equal up to reduction order only if the optimizer state moved too
    next_a, next_b = params(folder / "a3"), params(folder / "b3")
    for name, value in next_a.items():
        torch.testing.assert_close(next_b[name], value, rtol=WEIGHT_RTOL, atol=weight_atol(LR), msg=name)
