"""verify's parts in one process: the noise-relative comparison, its failure text, the crash block,
and the CPU BatchNorm over a process group (random ops fixed: test_randomness.py)."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from autoshard.launch import crash_block, last_own_frame
from autoshard.runtime.model import GlooSyncBatchNorm, convert_sync_batch_norm
from autoshard.verify import Run, _tensor_parallel_module, compare

NOISY = "h.0.k.bias"  # a parameter whose fp32 update is mostly rounding noise
CLEAN = "h.0.q.weight"


def _runs(par_shift: dict[str, float], loss_shift: float = 0.0):
    """ref64 exact; ref32 off by 1e-5 on NOISY and 1e-9 on CLEAN; the parallel run as ref32, shifted."""
    ref64 = Run(
        [2.0, 1.9, 1.8], {NOISY: torch.zeros(4, dtype=torch.float64), CLEAN: torch.ones(4, 4, dtype=torch.float64)}
    )
    ref32 = Run([2.0 + 1e-7, 1.9 + 1e-7, 1.8 - 1e-7], {NOISY: torch.full((4,), 1e-5), CLEAN: torch.ones(4, 4) + 1e-9})
    par = {k: v.clone() + par_shift.get(k, 0.0) for k, v in ref32.params.items()}
    par_losses = [x + (loss_shift if i == 2 else 0.0) for i, x in enumerate(ref32.losses)]
    return par_losses, par, ref32, ref64


def test_noise_as_large_as_the_references_passes():
    """NOISY is off by 4e-5 (4x what fp32 shows in one process): that is rounding, it passes; the
    fixed tolerance (2% of a step at lr 1e-3 = 2e-5) fails it."""
    par_losses, par, ref32, ref64 = _runs({NOISY: 3e-5})
    report = compare(3, par_losses, ref32.losses, par, ref32.params, 1e-3, exact=ref64)
    assert report.ok, report.failure
    assert not compare(3, par_losses, ref32.losses, par, ref32.params, 1e-3).ok


def test_a_small_bug_on_a_clean_tensor_fails_naming_step_and_tensor():
    par_losses, par, ref32, ref64 = _runs({CLEAN: 1e-6}, loss_shift=1e-4)
    report = compare(3, par_losses, ref32.losses, par, ref32.params, 1e-3, exact=ref64)
    assert not report.ok
    assert report.first_diverging_step == 2
    assert report.most_off[0].name == CLEAN and report.most_off[0].excess > 1
    assert report.failure.startswith("losses first differ at step 2")
    assert f"tensors most off: {CLEAN}" in report.failure
    assert NOISY not in report.failure  # within its noise: not listed


def test_integer_buffers_must_be_equal():
    par_losses, par, ref32, ref64 = _runs({})
    for run in (ref32, ref64):
        run.params["bn.num_batches_tracked"] = torch.tensor(3)
    par["bn.num_batches_tracked"] = torch.tensor(6)
    report = compare(3, par_losses, ref32.losses, par, ref32.params, 1e-3, exact=ref64)
    assert "bn.num_batches_tracked" in report.failure and report.first_diverging_step is None


def test_tensor_parallel_module_of_a_tensor():
    plan = SimpleNamespace(tensor_parallel={"h.0.attn.q": "colwise", "h.0.attn": "rowwise"})
    assert _tensor_parallel_module("h.0.attn.q.weight", plan) == "h.0.attn.q"
    assert _tensor_parallel_module("h.0.mlp.weight", plan) == ""


def test_crash_block_names_the_first_rank_and_the_model_line():
    stack = (
        "Traceback (most recent call last):\n"
        '  File "/work/x/train.py", line 80, in main\n    loss = model(x)\n'
        '  File "/work/x/my_model.py", line 12, in forward\n    raise RuntimeError("bad shape")\n'
        '  File "/usr/lib/python3/site-packages/torch/nn/functional.py", line 3, in linear\n    return op()\n'
        "RuntimeError: bad shape\n"
    )
    first = SimpleNamespace(
        timestamp=100,
        message={"message": "RuntimeError: bad shape", "extraInfo": {"py_callstack": stack}},
        error_file_data={"message": 1},
        exitcode=1,
    )
    peer = SimpleNamespace(
        timestamp=100,
        message={"message": "RuntimeError: Connection closed by peer", "extraInfo": {"py_callstack": ""}},
        error_file_data={"message": 1},
        exitcode=1,
    )
    block = crash_block({0: peer, 1: first})
    assert block.splitlines()[0] == "rank 1 failed: RuntimeError: bad shape"
    # torchrun stops the other ranks with SIGTERM once one fails: seen earlier than the failed rank's error file
    stopped = SimpleNamespace(
        timestamp=99, message="Signal 15 (SIGTERM) received by PID 7", error_file_data={}, exitcode=-15
    )
    assert crash_block({0: stopped, 2: first}).splitlines()[0] == "rank 2 failed: RuntimeError: bad shape"
    # ... but a rank that recorded its error before torchrun's SIGTERM reached it failed on its own
    recorded_then_stopped = SimpleNamespace(**{**vars(first), "exitcode": -15})
    assert crash_block({0: peer, 1: recorded_then_stopped}).splitlines()[0] == "rank 1 failed: RuntimeError: bad shape"
    # a rank that printed its error and exited has no error file: timed when torchrun saw it, after its peer's
    printed = SimpleNamespace(timestamp=101, message="error: the data file is short", error_file_data={}, exitcode=1)
    assert crash_block({0: peer, 3: printed}).splitlines()[0].startswith("rank 3 failed:")
    assert "my_model.py:12 in forward: raise RuntimeError" in block and "1 other rank(s)" in block
    assert last_own_frame(stack).endswith('my_model.py:12 in forward: raise RuntimeError("bad shape")')


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_gloo_sync_batch_norm_equals_batch_norm_on_one_rank(one_rank_group):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    synced = convert_sync_batch_norm(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), one_rank_group)
    synced.load_state_dict(plain.state_dict())
    assert isinstance(synced[1], GlooSyncBatchNorm)
    x = torch.randn(6, 3, 7, 7)
    for model in (plain, synced):
        model(x).square().mean().backward()
        model(x)
    torch.testing.assert_close(synced[0].weight.grad, plain[0].weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(synced.state_dict(), plain.state_dict(), rtol=1e-5, atol=1e-6)


def test_tensor_parallel_in_16_bits_is_judged_with_its_extra_roundings():
    """K is 50, and 50 · (1 + ⌈log₂ tp⌉) where tensor parallelism sums 16-bit partial results: a deviation
    of 80x the one-process noise fails an fp32 plan and passes a bf16 tp 2 one; 160x fails both."""
    from pathlib import Path

    from autoshard.ir.plan import load_plan
    from autoshard.verify import noise_factor

    golden = Path(__file__).resolve().parent / "golden"
    tp2 = load_plan(golden / "dp_tp_zero0.plan.json")
    assert tp2.precision == "fp32" and noise_factor(tp2) == 50

    def in_precision(precision):  # the three fields noise_factor reads
        return SimpleNamespace(precision=precision, mesh=tp2.mesh, tensor_parallel=tp2.tensor_parallel)

    bf16_tp2 = in_precision("bf16-autocast")
    assert noise_factor(bf16_tp2) == 100 and noise_factor(in_precision("bf16-pure")) == 100
    assert noise_factor(load_plan(golden / "bf16_dp_zero3.plan.json")) == 50  # no tensor parallelism
    par_losses, par, ref32, ref64 = _runs({NOISY: 80e-5 - 1e-5})  # 80x NOISY's 1e-5
    assert not compare(3, par_losses, ref32.losses, par, ref32.params, exact=ref64).ok
    judged = compare(3, par_losses, ref32.losses, par, ref32.params, exact=ref64, noise_factor=noise_factor(bf16_tp2))
    assert judged.ok and judged.noise_factor == 100
    par_losses, par, ref32, ref64 = _runs({NOISY: 160e-5 - 1e-5})
    failed = compare(3, par_losses, ref32.losses, par, ref32.params, exact=ref64, noise_factor=100)
    assert not failed.ok and "160x the rounding noise" in failed.failure


def _fake_references(monkeypatch):
    """verify's one-process runs, made up: float64 exact, fp32 off by 1e-7, bf16 autocast off by 1e-3."""
    import autoshard.verify as verify

    off = {"fp32": 1e-7, "bf16-autocast": 1e-3}

    def train_reference(model_file, batch_size, steps, seed, lr, dtype=torch.float32, precision="fp32", **_):
        shift = 0.0 if dtype == torch.float64 else off[precision]
        return Run([2.0 + shift, 1.9 + shift], {CLEAN: torch.ones(4, 4, dtype=dtype) + shift})

    monkeypatch.setattr(verify, "train_reference", train_reference)


def _run_off_by(shift: float) -> Run:
    return Run([2.0 + shift, 1.9 + shift], {CLEAN: torch.ones(4, 4) + shift})


@pytest.mark.parametrize("twin_shift, ok", [(2e-7, True), (1e-4, False)])
def test_a_16_bit_plan_is_judged_first_through_its_fp32_twin(monkeypatch, twin_shift, ok):
    """The bf16 run is 5x bf16's noise off (within K = 50 of it); its fp32 twin (the same layout) 2x fp32's noise
    (it passes, and the report says the layout was verified in fp32) or 1000x (a layout bug the bf16 tolerance
    hides: the plan fails, saying it is the layout)."""
    from autoshard.ir.plan import load_plan
    from autoshard.ir.recipe import Recipe
    from autoshard.modelfile import load_model_file
    from autoshard.verify import TWIN_FAILED, fp32_twin, judge

    _fake_references(monkeypatch)
    plan = load_plan("tests/golden/bf16_dp_zero3.plan.json")
    twin = fp32_twin(plan)
    assert (plan.precision, twin.precision, twin.mesh, twin.layout) == ("bf16-autocast", "fp32", plan.mesh, plan.layout)
    assert fp32_twin(twin) is None  # an fp32 plan is verified once
    model_file = load_model_file(plan.model["spec"])
    alone = judge(plan, model_file, _run_off_by(5e-3), 2, 0, Recipe())
    assert alone.ok and alone.twin is None, alone.failure
    report = judge(plan, model_file, _run_off_by(5e-3), 2, 0, Recipe(), layout_run=_run_off_by(twin_shift))
    assert report.ok == ok and report.twin.ok == ok, report.failure
    if ok:
        assert any("verified first in fp32" in note for note in report.notes)
    else:
        assert report.failure.startswith(TWIN_FAILED) and CLEAN in report.failure


def test_the_float64_reference_makes_dtype_less_tensors_in_float64(in_repo):
    """The float64 reference's steps run with torch's default dtype at float64: a model that makes a tensor without a
    dtype from its activations' dtype's minimum (XGLM's attention) stopped it with "value cannot be converted to
    type float without overflow" on every plan; the default is restored after."""
    from autoshard.modelfile import load_model_file
    from autoshard.reference import train_reference

    run = train_reference(load_model_file("tests/models/dtype_min_mask.py:build"), 4, 2, 0, 1e-3, dtype=torch.float64)
    assert len(run.losses) == 2 and all(math.isfinite(loss) for loss in run.losses)
    assert torch.get_default_dtype() == torch.float32
