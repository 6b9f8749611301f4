"""Elastic runs' parts without a launch (``autoshard.elastic``): the range, which ranks count as lost, the re-plan
that keeps the global batch (or one line where none does), and the faults that take several ranks at once.
The launch itself: ``e2e/test_elastic.py``."""

import signal
from types import SimpleNamespace

import pytest

import autoshard
from autoshard.elastic import ElasticRange, describe, lost_ranks, plan_for_ranks
from autoshard.errors import AutoshardError
from autoshard.launch import read_failures, write_failures
from autoshard.runtime import faults

GPT = "examples/gpt.py:build"


@pytest.fixture(scope="module")
def gpt_four_ranks(in_repo_module):
    """The example at 4 CPU ranks and a global batch of 2: at 3 ranks no plan keeps that batch (dp = 3 does not
    divide it, 3 of its 4 heads cannot be split, 3 stages need 3 micro-batches of its 2 samples)."""
    return autoshard.plan(GPT, cluster="local-cpu", devices_per_node=4, global_batch=2)


def test_the_range_reads_min_colon_max_and_holds_the_plan():
    assert ElasticRange.parse("2:4") == ElasticRange(2, 4)
    for bad in ("4", "3:2", "0:2", "a:b", "2:", "-1:2"):
        with pytest.raises(AutoshardError, match="must be MIN:MAX"):
            ElasticRange.parse(bad)
    ElasticRange(2, 4).check_plan(4)
    with pytest.raises(AutoshardError, match="the plan runs on 8 ranks, outside --elastic 2:4; .* --elastic 2:8"):
        ElasticRange(2, 4).check_plan(8)


def test_only_ranks_killed_outright_are_lost():
    """SIGKILL: the process (its device, its host) went away; torchrun's SIGTERM to the others, an exception
    (exit 1) or a refusal (exit 2) are not lost workers."""
    failures = {0: -signal.SIGTERM, 1: 1, 2: -signal.SIGKILL, 3: -signal.SIGKILL, 4: 2}
    assert lost_ranks(failures) == [2, 3]
    assert lost_ranks({}) == []


def test_torchruns_failures_reach_the_launcher(tmp_path):
    path = tmp_path / "failures.json"
    assert read_failures(path) == {}  # the job did not fail
    write_failures(path, {3: SimpleNamespace(exitcode=-9), 1: SimpleNamespace(exitcode=1)})
    assert read_failures(path) == {1: 1, 3: -9}


def test_a_fault_may_kill_several_ranks_together():
    assert faults._parse("kill:2,3:4") == ("kill", (2, 3), 4)
    assert faults._parse("hang:1:3") == ("hang", (1,), 3)
    for bad in ("hang:1,2:3", "kill:2,:4", "kill:2;3:4"):
        with pytest.raises(SystemExit, match="kill may name several ranks"):
            faults._parse(bad)


def test_a_relaunch_of_an_elastic_job_runs_clean(monkeypatch):
    """An injected fault acts in the first launch only: a relaunch is a new torchrun job, its restart count 0."""
    monkeypatch.setenv(faults.INJECT_ENV, "kill:0:1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(faults.ELASTIC_ATTEMPT_ENV, "1")
    faults.inject("kill", 1)  # would SIGKILL this process in the first launch


def test_the_replan_keeps_the_global_batch_and_is_byte_identical(gpt_four_ranks, tmp_path):
    """Of 3 ranks left, the most that keep the global batch: 3 cannot, so 2; planned twice, the same bytes."""
    first, seconds = plan_for_ranks(gpt_four_ranks, 3, ElasticRange(2, 4))
    assert (first.world_size, first.global_batch) == (2, gpt_four_ranks.global_batch)
    assert seconds > 0 and "per rank" in describe(first)
    again, _ = plan_for_ranks(gpt_four_ranks, 3, ElasticRange(2, 4))
    first.save(tmp_path / "a.json")
    again.save(tmp_path / "b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert first.model == gpt_four_ranks.model and first.decisions.precision == gpt_four_ranks.decisions.precision


def test_no_plan_that_keeps_the_global_batch_is_one_line(gpt_four_ranks):
    with pytest.raises(AutoshardError) as refused:
        plan_for_ranks(gpt_four_ranks, 3, ElasticRange(3, 4))
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("3 rank(s) left and no plan of 3 to 3 ranks keeps the global batch of 2 (3 ranks: ")
    assert "fix: " in message
    with pytest.raises(AutoshardError, match=r"1 rank\(s\) left, fewer than --elastic 2:4 allows"):
        plan_for_ranks(gpt_four_ranks, 1, ElasticRange(2, 4))


def test_a_survivor_says_the_elastic_job_goes_on(monkeypatch):
    """The rank that saw its peer go says what comes next: a relaunch while the job has some left, else the end."""
    monkeypatch.delenv("TORCHELASTIC_MAX_RESTARTS", raising=False)
    monkeypatch.setenv(faults.ELASTIC_LEFT_ENV, "2")
    assert "autoshard run --elastic launches the job again" in faults.peer_gone_message()
    monkeypatch.setenv(faults.ELASTIC_LEFT_ENV, "0")
    assert "the job stops" in faults.peer_gone_message()


def test_a_steps_samples_do_not_depend_on_the_data_parallel_degree():
    """``runtime.data``'s module doc: step k of a dataset holds the same samples at every dp that divides the global
    batch (their order aside), so a job re-planned at another dp reads on where it stopped."""
    from autoshard.runtime.data import position, rank_indices, steps_per_epoch

    def samples(length, batch, dp, step):
        per_rank = batch // dp
        epoch, j = position(step, steps_per_epoch(length, batch, dp))
        ranks = (rank_indices(length, dp, r, 3, epoch)[j * per_rank : (j + 1) * per_rank] for r in range(dp))
        return sorted(i for indices in ranks for i in indices)

    for length, batch in ((37, 8), (101, 12)):
        for step in range(2 * (length // batch) + 1):  # across two epochs' ends
            assert samples(length, batch, 4, step) == samples(length, batch, 2, step) == samples(length, batch, 1, step)


def test_elastic_on_node_groups_is_refused_in_one_line():
    """Re-planning node groups for fewer ranks is not built: ``--elastic`` on such a plan is one line, before anything
    starts (else every world size's re-plan would fail and the job stop on a misleading reason)."""
    from types import SimpleNamespace

    from autoshard.commands import _elastic_of

    args = SimpleNamespace(elastic="2:4", checkpoint_dir="ckpt")
    groups = SimpleNamespace(cluster={"groups": [{"name": "fast"}, {"name": "slow"}]}, world_size=4)
    with pytest.raises(AutoshardError, match="node groups: re-planning node groups for fewer ranks is not built"):
        _elastic_of(args, groups)
    assert _elastic_of(args, SimpleNamespace(cluster={}, world_size=4)).min_ranks == 2
