"""verify on models that used to fail it, on a deliberately broken program, and on a crashing rank.

tests/models/tiny_attention.py: a key bias (true gradient zero) and dropout 0.1;
tests/models/bn_cnn.py: BatchNorm after conv biases (their gradient is zero too).

Each case but the crashing one is ``autoshard.verify`` of one plan (``one_launch.verify_cases``: verify's
own checks, command line and judgement), in the session's 2-rank launch; the crashing rank goes
through the CLI's ``verify`` and ``run``, each its own launch.
"""

import pytest
import torch

import autoshard
from autoshard.cli import main
from autoshard.errors import AutoshardError
from autoshard.runtime.data import global_batch, take_shard
from autoshard.runtime.model import build_model, load_model_file
from autoshard.runtime.randomness import fixed_randomness
from autoshard.verify import VerifyReport, likely_cause
from e2e.one_launch import Cases, verify_cases

pytestmark = pytest.mark.e2e

TINY = "tests/models/tiny_attention.py"
MODEL_LINE = "tests/models/tiny_attention.py:"
PADDED = "tests/models/tiny_attention_padded.py:build"
SEED = 0


def _plan(spec, **pins):
    return autoshard.plan(spec, cluster="local-cpu", devices_per_node=2, global_batch=8, **pins)


CASES = {  # name: (model spec, pins, steps), all on 2 ranks
    "zero-gradients-and-dropout": (f"{TINY}:build", dict(dp=2, zero=0), 3),
    "tensor-parallel-dropout": (f"{TINY}:build", dict(tp=2), 2),
    "batch-norm-zero0": ("tests/models/bn_cnn.py:build", dict(dp=2, zero=0), 3),
    "batch-norm-zero3": ("tests/models/bn_cnn.py:build", dict(dp=2, zero=3), 3),
    "broken-program": (f"{TINY}:build_perturbed", dict(dp=2, zero=0), 3),
}
TEST_CASES = {
    "test_zero_gradient_parameters_and_dropout_pass": "zero-gradients-and-dropout",
    "test_tensor_parallel_with_dropout_passes": "tensor-parallel-dropout",
    "test_broken_program_fails_naming_step_and_tensor": "broken-program",
}


LAUNCHES = Cases(
    dict.fromkeys(CASES, 2),
    *verify_cases(lambda name: _plan(CASES[name][0], **CASES[name][1]), lambda name: CASES[name][2]),
    case_of=lambda test, params: f"batch-norm-zero{params['zero']}" if "zero" in params else TEST_CASES.get(test),
)


@pytest.fixture(scope="module")
def verified(launches):
    """name -> (plan, verify report)."""
    return lambda name: launches.result(LAUNCHES, name)


def test_zero_gradient_parameters_and_dropout_pass(verified):
    """dp=2: dropout is off in both runs, and the key bias's rounding noise is judged against the
    one-process run's own."""
    _, report = verified("zero-gradients-and-dropout")
    assert report.ok, report.failure
    assert any(
        note.startswith("random ops at their expectation in both runs") and "dropout" in note for note in report.notes
    ), report.notes
    assert report.parallel_losses[-1] < report.parallel_losses[0]


def test_tensor_parallel_with_dropout_passes(verified):
    plan, report = verified("tensor-parallel-dropout")
    assert plan.mesh.tp == 2
    assert report.ok, report.failure


@pytest.mark.parametrize("zero", [0, 3])
def test_batch_norm_cnn_verifies_at_dp2(verified, zero):
    """BatchNorm statistics over both dp ranks (GlooSyncBatchNorm); ZeRO-3 also recomputes each block,
    whose BatchNorm must update its running statistics once per step, not twice."""
    _, report = verified(f"batch-norm-zero{zero}")
    assert report.ok, report.failure
    assert any("BatchNorm statistics over the 2 data-parallel rank(s)" in note for note in report.notes)


def test_broken_program_fails_naming_step_and_tensor(verified):
    """The parallel run adds one AdamW step to h.1.mlp.bias before every forward from step 1 on."""
    _, report = verified("broken-program")
    assert not report.ok
    assert report.first_diverging_step == 1
    assert report.most_off[0].name == "h.1.mlp.bias"
    assert "losses first differ at step 1" in report.failure
    assert "tensors most off: h.1.mlp.bias" in report.failure


def test_crashing_rank_is_named_in_verify_and_run(in_repo, tmp_path, capfd):
    plan = _plan(f"{TINY}:build_crash_on_rank1", dp=2, zero=0)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json())
    assert main(["verify", str(plan_file), "--steps", "1"]) != 0
    err = capfd.readouterr().err
    assert "rank 1 failed: RuntimeError: tiny attention refuses to run on rank 1" in err, err[-3000:]
    assert MODEL_LINE in err and "ChildFailedError" not in err
    assert main(["run", str(plan_file), "--steps", "1", "--program", str(tmp_path / "train.py")]) != 0
    captured = capfd.readouterr()
    assert "rank 1 failed: RuntimeError: tiny attention refuses to run on rank 1" in captured.err, captured.err[-3000:]
    assert MODEL_LINE in captured.err and "ChildFailedError" not in captured.out + captured.err


def test_a_loss_averaged_over_a_data_dependent_count_is_refused_at_plan_time():
    """The capture's batch-coupling check sees the padded loss's count (passes.capturing.batch_coupling)."""
    with pytest.raises(AutoshardError, match="a mean over a count the data decide.*plan with --dp 1"):
        _plan(PADDED, dp=2, zero=0)


def test_verify_names_a_data_dependent_count_when_the_plan_could_not_check_it(in_repo):
    """A plan whose capture did not run the check (a model too large for it) still gets verify's diagnosis:
    the program's first loss is the mean of its ranks' means, not the batch's mean."""
    plan = _plan(f"{TINY}:build", dp=2, zero=0)  # the same model and layout, its loss a plain mean
    padded = load_model_file(PADDED)
    model = build_model(padded, SEED)
    inputs, targets = global_batch(padded, plan.global_batch, SEED, 0)
    with fixed_randomness(), torch.no_grad():
        whole = padded.loss(model(*inputs), targets).item()
        halves = [
            padded.loss(model(*x), y).item()
            for r in range(2)
            for x, y in [take_shard((inputs, targets), r, 2, torch.device("cpu"))]
        ]
    assert abs(whole - sum(halves) / 2) > 1e-4  # the padding makes the two differ
    report = VerifyReport(
        1, [sum(halves) / 2], [whole], abs(whole - sum(halves) / 2), 0.0, "", "differs", first_diverging_step=0
    )
    assert "the loss is not a mean over equal shares" in likely_cause(report, plan, padded, SEED)
    fair = VerifyReport(1, [whole + 1e-3], [whole], 1e-3, 0.0, "", "differs", first_diverging_step=0)
    assert "mean over equal shares" not in likely_cause(fair, plan, padded, SEED)
