"""A loss that couples the samples of a batch is found at plan time (passes/capturing/batch_coupling.py), and the planner
keeps such a batch whole on one rank or refuses in one line."""

import pytest

import autoshard
from autoshard.errors import AutoshardError
from autoshard.passes.capturing.batch_coupling import coupling_reason
from autoshard.runtime.model import load_model_file

CONTRASTIVE = "tests/models/contrastive.py:build"
SUMMED = "tests/models/contrastive.py:build_summed"


def test_the_check_tells_a_coupled_loss_a_summed_loss_and_a_mean(in_repo):
    assert "couples the samples" in coupling_reason(load_model_file(CONTRASTIVE))
    assert "a sum over the batch" in coupling_reason(load_model_file(SUMMED))
    assert coupling_reason(load_model_file("tests/models/mlp.py:build")) == ""
    assert coupling_reason(load_model_file("tests/models/random_layers.py:build_drop_path")) == ""  # random, but a mean
    assert coupling_reason(load_model_file("tests/models/bn_cnn.py:build")) == ""  # BatchNorm is synced by the program


def test_the_planner_keeps_a_coupled_batch_whole_or_refuses_in_one_line(in_repo):
    plan = autoshard.plan(CONTRASTIVE, cluster="local-cpu", global_batch=8, devices_per_node=2)
    assert plan.mesh.dp == 1 and plan.num_microbatches == 1 and plan.world_size == 2
    assert any("couples the samples" in note for note in plan.notes)
    for pins in (dict(dp=2), dict(dp=1, tp=1, pp=2, microbatch_size=2)):
        with pytest.raises(AutoshardError, match="couples the samples of a batch") as refused:
            autoshard.plan(CONTRASTIVE, cluster="local-cpu", global_batch=8, devices_per_node=2, **pins)
        assert "\n" not in str(refused.value) and "--dp 1" in str(refused.value)
    mean_loss = autoshard.plan(
        "tests/models/mlp.py:build", cluster="local-cpu", global_batch=8, devices_per_node=2, dp=2
    )
    assert mean_loss.mesh.dp == 2 and not any("batch stays whole" in note for note in mean_loss.notes)


def test_a_check_that_would_take_long_is_not_run(in_repo, monkeypatch):
    """The check's work is read off the captured graph before anything runs: the same folded (its layers copied back)
    or not, growing with the tokens; over ``MAX_CHECK_FLOPS`` or ``MAX_CHECK_VALUE_BYTES`` the model is not run and
    ``batch_coupling`` is None (the plan's notes say it was not checked)."""
    from autoshard.passes.capturing import batch_coupling
    from autoshard.passes.capturing.annotate import annotate
    from autoshard.passes.capturing.capture import capture

    model_file = load_model_file("examples/gpt.py:build")
    folded, whole = (annotate(capture(model_file, 2, fold)) for fold in (True, False))
    assert folded.fold is not None and len(folded.nodes) < len(whole.nodes)
    flops, largest_bytes = batch_coupling.check_work(folded)
    assert (flops, largest_bytes) == batch_coupling.check_work(whole) and flops > 0 and largest_bytes > 0
    shorter = annotate(capture(load_model_file("examples/gpt.py:build", seq_len=whole.tokens_per_sample // 2), 2, True))
    shorter_flops, shorter_bytes = batch_coupling.check_work(shorter)
    assert 2 * shorter_flops <= flops and shorter_bytes < largest_bytes

    assert batch_coupling.check_batch_coupling(model_file, folded).batch_coupling == ""  # within the bounds: run
    monkeypatch.setattr(batch_coupling, "coupling_reason", lambda *a, **k: pytest.fail("the model was run"))
    for name, bound in (("MAX_CHECK_FLOPS", flops), ("MAX_CHECK_VALUE_BYTES", largest_bytes)):
        with monkeypatch.context() as m:
            m.setattr(batch_coupling, name, bound - 1)
            assert batch_coupling.check_batch_coupling(model_file, folded).batch_coupling is None, name
