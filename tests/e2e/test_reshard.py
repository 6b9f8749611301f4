"""A checkpoint saved under one plan resumes under another (DCP reshards by parameter name)."""

import pytest
import torch

import autoshard
from autoshard.launch import write_program
from autoshard.verify import WEIGHT_RTOL, weight_atol
from e2e.ckpt_driver import ROOT, job, run_jobs

pytestmark = pytest.mark.e2e

GPT, FAST = "examples/gpt.py:build", "tests/clusters/fast_link_cpu.yaml"
LR = 1e-3
CASES = {  # name: (cluster, ranks, pins saved under), (cluster, ranks, pins resumed under)
    "dp4-zero3-to-dp2-tp2": (("local-cpu", 4, dict(dp=4, zero=3)), (FAST, 4, dict(dp=2, tp=2, zero=3))),
    "pp2-1f1b-to-pp2-interleaved": (("local-cpu", 2, dict(pp=2, schedule="1f1b")),
                                    ("local-cpu", 2, dict(pp=2, schedule="interleaved-1f1b"))),
    "dp2-zero0-to-pp2": (("local-cpu", 2, dict(dp=2, zero=0)), ("local-cpu", 2, dict(pp=2, schedule="gpipe"))),
}


def reshard_runs(cases, root, ranks):
    """Per case: plan a trains 2 steps (checkpoint at step 2); plan b loads a copy of that checkpoint and
    runs no step; then each plan runs step 3 from its own copy. Every case's runs in one launch, each a
    fresh program, model and optimizer."""
    first, then = [], []
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)
        for case in cases:
            folder = root / case
            a, b = (write_program(autoshard.plan(GPT, cluster=cluster, devices_per_node=n, global_batch=8, **pins),
                                  folder / f"{name}.py") for name, (cluster, n, pins) in zip("ab", CASES[case]))
            assert all(n == ranks for _, n, _ in CASES[case])
            first.append(train(a, folder / "a2", 2, folder / "ckpt"))
            then += [train(b, folder / "b2", 2, folder / "ckpt_b", copy=(folder / "ckpt", folder / "ckpt_b")),
                     # b2 resumes at step 2 and runs nothing
                     train(a, folder / "a3", 3, folder / "ckpt"), train(b, folder / "b3", 3, folder / "ckpt_b")]
        run_jobs(ranks, first + then, root)
    return {case: root / case for case in cases}


def train(program, out, steps, ckpt, copy=None):
    return job(program, "--steps", steps, "--lr", LR, "--metrics-out", out, "--checkpoint-dir", ckpt,
               "--checkpoint-every", 2, copy=copy)


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    return reshard_runs(sorted(c for c in CASES if CASES[c][0][1] == 2), tmp_path_factory.mktemp("ranks2"), 2)


def params(out):
    return torch.load(out / "params.pt", weights_only=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_checkpoint_resumes_under_another_plan(request, tmp_path, case):
    ranks = CASES[case][0][1]
    if ranks == 2:
        folder = request.getfixturevalue("two_rank_runs")[case]
    else:
        folder = reshard_runs([case], tmp_path, ranks)[case]
    after_two, loaded = params(folder / "a2"), params(folder / "b2")
    assert loaded.keys() == after_two.keys()
    for name, value in after_two.items():
        assert torch.equal(loaded[name], value), name  # the same parameters, whatever the layout
    # one more step under each plan: equal up to reduction order only if the optimizer state moved too
    next_a, next_b = params(folder / "a3"), params(folder / "b3")
    for name, value in next_a.items():
        torch.testing.assert_close(next_b[name], value, rtol=WEIGHT_RTOL, atol=weight_atol(LR), msg=name)
