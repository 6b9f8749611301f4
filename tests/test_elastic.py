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


@pytest.mark.parametrize(
    "text, gone",
    [
        ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4513", True),
        ("NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error", True),
        (
            "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.",
            True,
        ),
        ("socketProgress: Connection closed by remote peer node-7<41280>", True),
        ("NCCL communicator was aborted on rank 3.", True),
        (
            "NCCL communicator was aborted on rank 3. Original reason for failure was: [Rank 3] Watchdog caught "
            "collective operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE) ran for 600000 milliseconds",
            False,
        ),
        ("CUDA out of memory. Tried to allocate 2.00 GiB", False),
    ],
)
def test_a_lost_peer_is_told_from_a_hang_and_from_a_rank_s_own_error_in_gloo_and_nccl_words(text, gone):
    """A survivor names the lost peer only where the backend says one went away; an aborted NCCL communicator whose
    reason is the watchdog's timeout is a hang (``hang_message``), and any other error is the rank's own."""
    assert faults._is_peer_gone(RuntimeError(text)) is gone


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


def _fake_plan(world_size):
    mesh = SimpleNamespace(dp=world_size, tp=1, pp=1, cp=1)
    decisions = SimpleNamespace(mesh=mesh, zero_stage=0, num_microbatches=1, microbatch_size=8 // world_size)
    return SimpleNamespace(world_size=world_size, global_batch=8, decisions=decisions)


def _supervise(monkeypatch, launches, environ=None):
    """``run_elastic`` over fake launches (each a torchrun result: exit status, failed ranks' statuses); the
    environment each launch was given beside the caller's, and the exit status."""
    import autoshard.elastic as elastic
    import autoshard.launch as launch

    given = []

    def run_torchrun(program, nproc, args, extra_env=None):
        given.append((nproc, dict(extra_env or {})))
        returncode, failures = launches[len(given) - 1]
        return SimpleNamespace(returncode=returncode, failures=failures)

    monkeypatch.setattr(launch, "run_torchrun", run_torchrun)
    monkeypatch.setattr(elastic, "warm_planner", lambda: None)
    monkeypatch.setattr(elastic, "plan_for_ranks", lambda plan, available, _: (_fake_plan(available), 0.01))
    monkeypatch.setattr(elastic, "_attempt_for", lambda plan, *_: elastic.Attempt(plan, "train.py"))
    for key, value in (environ or {}).items():
        monkeypatch.setenv(key, value)
    first = elastic.Attempt(_fake_plan(4), "train.py")
    code = elastic.run_elastic(first, ElasticRange(1, 4), [], "ckpt", max_restarts=3)
    return given, code


def test_a_relaunch_after_a_loss_runs_on_the_surviving_devices(monkeypatch):
    """Local rank r runs on the r-th device CUDA_VISIBLE_DEVICES shows: after rank 1 of devices 4,5,6,7 is lost the
    3 ranks left run on 4,6,7, and after the new rank 2 (device 7) is lost too, on 4,6."""
    kill, term = -signal.SIGKILL, -signal.SIGTERM
    given, code = _supervise(
        monkeypatch,
        [(1, {1: kill, 0: faults.PEER_FAULT_EXIT, 2: term, 3: term}), (1, {2: kill, 0: term, 1: term}), (0, {})],
        {"CUDA_VISIBLE_DEVICES": "4,5,6,7"},
    )
    assert code == 0
    assert [nproc for nproc, _ in given] == [4, 3, 2]
    assert [env.get("CUDA_VISIBLE_DEVICES") for _, env in given] == [None, "4,6,7", "4,6"]


def test_without_a_device_list_the_survivors_are_named_by_index(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    given, code = _supervise(monkeypatch, [(1, {0: -signal.SIGKILL, 1: -signal.SIGTERM}), (0, {})])
    assert code == 0 and given[1][1]["CUDA_VISIBLE_DEVICES"] == "1,2,3"


def test_an_error_of_the_program_stops_the_elastic_job(monkeypatch, capsys):
    """An exception on a rank (exit 1) with no rank lost would fail the same way again: one line, the run's status,
    no relaunch. A rank ended by a peer's fault (a timed-out collective: exit 3) is relaunched."""
    given, code = _supervise(monkeypatch, [(1, {0: 1, 1: -signal.SIGTERM, 2: faults.PEER_FAULT_EXIT})])
    assert (code, len(given)) == (1, 1)
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and said[0].startswith("elastic: rank(s) 0 failed with an error of the program"), said
    given, code = _supervise(monkeypatch, [(1, {0: faults.PEER_FAULT_EXIT, 1: -signal.SIGTERM}), (0, {})])
    assert code == 0 and [nproc for nproc, _ in given] == [4, 4]


def test_tied_optimizer_state_is_kept_under_the_first_name():
    """A pipeline's last stage holds lm_head.weight, tied to transformer.wte.weight: its optimizer state is saved
    and loaded under the first name, as an SPMD plan's is; a rank holding both copies saves one."""
    from autoshard.runtime.checkpoint import one_name_per_tie

    aliases = (("transformer.wte.weight", "lm_head.weight"),)
    last_stage = {"state.lm_head.weight.exp_avg": 1, "param_groups.lm_head.weight.lr": 0.1, "state.h.1.w.step": 2}
    saved, copies = one_name_per_tie(last_stage, aliases)
    assert saved == {
        "state.transformer.wte.weight.exp_avg": 1,
        "param_groups.transformer.wte.weight.lr": 0.1,
        "state.h.1.w.step": 2,
    }
    assert copies == {}
    both = {"state.transformer.wte.weight.exp_avg": 1, "state.lm_head.weight.exp_avg": 1}  # a V placement's rank 0
    saved, copies = one_name_per_tie(both, aliases)
    assert saved == {"state.transformer.wte.weight.exp_avg": 1}
    assert copies == {"state.lm_head.weight.exp_avg": "state.transformer.wte.weight.exp_avg"}


def test_a_batch_norm_model_keeps_its_micro_batches(in_repo_module):
    """BatchNorm normalises over each micro-batch: one micro-batch (the whole step) is kept at any dp; with two, which
    samples share one depends on dp, so dp 4 is kept and 3 or 2 ranks are refused (the search alone would take
    another split, another computation)."""
    cnn = "tests/models/bn_cnn.py:build"
    whole = autoshard.plan(cnn, cluster="local-cpu", devices_per_node=4, global_batch=8, dp=4)
    assert whole.decisions.num_microbatches == 1
    replanned, _ = plan_for_ranks(whole, 3, ElasticRange(2, 4))
    assert replanned.world_size < 4 and replanned.decisions.num_microbatches == 1
    halves = autoshard.plan(cnn, cluster="local-cpu", devices_per_node=4, global_batch=16, dp=4, microbatch_size=2)
    assert halves.decisions.num_microbatches == 2
    with pytest.raises(AutoshardError) as refused:
        plan_for_ranks(halves, 3, ElasticRange(2, 4))
    assert "\n" not in str(refused.value)
    assert "3 ranks: the model's BatchNorm normalises over each of the plan's 2 micro-batches" in str(refused.value)


def test_a_batch_norm_model_gets_no_pipeline_beside_data_parallelism(in_repo_module):
    """Inside pipeline stages BatchNorm's statistics are not synchronised over dp (a stage is a traced graph: no
    module to swap for SyncBatchNorm), so a BatchNorm model's search offers pipelines only at dp 1, and pinning one
    beside dp > 1 is refused in one line; a model without BatchNorm keeps them."""
    cnn = "tests/models/bn_cnn.py:build"
    with pytest.raises(AutoshardError) as refused:
        autoshard.plan(cnn, cluster="local-cpu", devices_per_node=4, global_batch=8, dp=2, pp=2)
    assert "\n" not in str(refused.value) and "BatchNorm" in str(refused.value) and "--dp 1" in str(refused.value)
    piped = autoshard.plan(cnn, cluster="local-cpu", devices_per_node=2, global_batch=8, pp=2)
    assert piped.mesh.pp == 2 and piped.mesh.dp == 1
    gpt = autoshard.plan("examples/gpt.py:build", cluster="local-cpu", devices_per_node=4, global_batch=8, dp=2, pp=2)
    assert (gpt.mesh.dp, gpt.mesh.pp) == (2, 2)
