"""Every DP/ZeRO configuration the planner can emit trains like one process (gloo, CPU ranks).

Each case is ``autoshard.verify`` of one plan (``one_launch.verify_cases``: verify's own checks, command
line and judgement); the programs run in the session's one torchrun launch per world size.
"""

import math
from functools import cache

import pytest

import autoshard
from e2e.one_launch import Cases, verify_cases
from e2e.zoo import FAST_LINK

pytestmark = pytest.mark.e2e

MODELS = {
    "gpt": "examples/gpt.py:build",
    "llama": "tests/models/hf_llama.py:build",
}
DP_ZERO = {
    f"{model}-zero{zero}-{ranks}": (model, zero, ranks)
    for model in sorted(MODELS)
    for zero in (0, 1, 2, 3)
    for ranks in (2, 4)
}
# Two steps show a plan's gradients (the first update) and its optimizer state (sharded under ZeRO) carried into the
# next step; a third would run the same code again.
DP_ZERO_STEPS = 2
CASES = {  # name: (ranks, steps)
    **{name: (ranks, DP_ZERO_STEPS) for name, (_, _, ranks) in DP_ZERO.items()},
    "eight-ranks-zero3": (8, 2),
    "mixed-recompute": (2, 3),
    "llama-alternate-zero3-2": (2, 3),
    "llama-alternate-tp2-sp": (2, DP_ZERO_STEPS),
    "unread-ddp-2": (2, DP_ZERO_STEPS),
    "rerun-zero2-2": (2, DP_ZERO_STEPS),
    "shared-child-zero3-2": (2, DP_ZERO_STEPS),
    "no-grad-gate-pp2-2": (2, 3),
    **{
        name: (2, 3)
        for name in (
            "gpt-bf16-zero3-2",
            "gpt-bf16-pure-zero0-2",
            "gpt-fp16-zero1-2",
            "gpt-bf16-tp2",
            "gpt-bf16-pure-tp2",
        )
    },
}
# --precision cases: the pin, its ZeRO stage, micro-batch size and tp degree (FSDP2's bf16 gathers; DDP's bf16
# gradients of bf16 weights; ZeroRedundancyOptimizer stepped through a GradScaler; DTensor TP under autocast, whose
# row-parallel partial sums are reduced in bf16, and over bf16 weights)
PRECISION_CASES = {
    "gpt-bf16-zero3-2": ("bf16", 3, 4, 1),
    "gpt-bf16-pure-zero0-2": ("bf16-pure", 0, 4, 1),
    "gpt-fp16-zero1-2": ("fp16", 1, 2, 1),
    "gpt-bf16-tp2": ("bf16", 0, 8, 2),
    "gpt-bf16-pure-tp2": ("bf16-pure", 0, 8, 2),
}
MIXED_PINS = dict(dp=2, zero=0, microbatch_size=4)
UNREAD = "tests/models/unread_cross.py:build"  # a layer's module and a head that forward never calls
RERUN = "tests/models/rerun_in_backward.py:build"  # blocks an autograd Function runs again in its own backward
SHARED_CHILD = "tests/models/shared_child.py:build"  # every other layer holds one shared child (Zamba's)
NO_GRAD_GATE = "tests/models/no_grad_gate.py:build"  # each block's gate computed from its weights under no_grad


@cache
def _tight_cluster():
    """local-cpu with device memory between what full recompute and no recompute need."""
    from dataclasses import replace

    from autoshard.cost.hardware import load_cluster

    cluster = load_cluster("local-cpu", devices_per_node=2)
    need = {
        mode: autoshard.plan(
            MODELS["gpt"], cluster=cluster, global_batch=8, recompute=mode, **MIXED_PINS
        ).predicted.memory_peak_bytes_per_rank
        for mode in ("none", "full")
    }
    return replace(cluster, device=replace(cluster.device, memory_bytes=(need["none"] + need["full"]) // 2))


def _plan(name):
    if name in PRECISION_CASES:
        precision, zero, micro, tp = PRECISION_CASES[name]
        cluster = "local-cpu" if tp == 1 else "tests/clusters/fast_link_cpu.yaml"  # where TP pays: attention shards
        return autoshard.plan(
            MODELS["gpt"],
            cluster=cluster,
            devices_per_node=2,
            global_batch=8,
            dp=2 // tp,
            tp=tp,
            pp=1,
            zero=zero,
            microbatch_size=micro,
            recompute="none",
            precision=precision,
        )
    if name in DP_ZERO:
        model, zero, ranks = DP_ZERO[name]
        return autoshard.plan(
            MODELS[model],
            cluster="local-cpu",
            devices_per_node=ranks,
            global_batch=8,
            dp=ranks,
            tp=1,
            pp=1,
            zero=zero,
            microbatch_size=1 if zero % 2 else None,
            recompute={0: "none", 1: "full", 2: "selective", 3: "full"}[zero],
        )
    if name == "llama-alternate-zero3-2":  # torchtitan's op-level policy (runtime.selective)
        return autoshard.plan(
            MODELS["llama"],
            cluster="local-cpu",
            devices_per_node=2,
            global_batch=8,
            dp=2,
            zero=3,
            recompute="alternate",
        )
    if name == "llama-alternate-tp2-sp":  # the same policy over sequence-parallel TP: all-gathers rerun in backward
        return autoshard.plan(
            MODELS["llama"],
            cluster=FAST_LINK,
            devices_per_node=2,
            global_batch=8,
            tp=2,
            sequence_parallel=True,
            recompute="alternate",
        )
    if name == "unread-ddp-2":  # modules the forward never calls: DDP's reducer waited for their gradients
        return autoshard.plan(UNREAD, cluster="local-cpu", devices_per_node=2, global_batch=8, dp=2, zero=0)
    if name == "rerun-zero2-2":  # ZeRO-3 refused for it (tests/test_hidden_backward.py); ZeRO-2 keeps them gathered
        return autoshard.plan(RERUN, cluster="local-cpu", devices_per_node=2, global_batch=8, dp=2, zero=2)
    if name == "shared-child-zero3-2":  # FSDP2 refused a parameter in two blocks' units
        return autoshard.plan(SHARED_CHILD, cluster="local-cpu", devices_per_node=2, global_batch=8, dp=2, zero=3)
    if name == "no-grad-gate-pp2-2":  # pipeline() could not split around the regions; they are inlined now
        return autoshard.plan(NO_GRAD_GATE, cluster="local-cpu", devices_per_node=2, global_batch=8, pp=2)
    if name == "eight-ranks-zero3":
        return autoshard.plan(MODELS["gpt"], cluster="local-cpu", devices_per_node=8, global_batch=16, zero=3)
    return autoshard.plan(MODELS["gpt"], cluster=_tight_cluster(), global_batch=8, **MIXED_PINS)


def _case_of(test, params):
    if test == "test_verify_dp_and_zero":
        return f"{params['model']}-zero{params['zero']}-{params['ranks']}"
    if test == "test_verify_pinned_precision":
        return params["name"]
    return {
        "test_verify_eight_ranks_zero3": "eight-ranks-zero3",
        "test_verify_mixed_recompute_chosen_under_memory_pressure": "mixed-recompute",
        "test_verify_alternate_recompute": "llama-alternate-zero3-2",
        "test_verify_alternate_recompute_reruns_the_tp_all_gathers": "llama-alternate-tp2-sp",
        "test_ddp_leaves_what_the_forward_never_reads_out_of_its_buckets": "unread-ddp-2",
        "test_zero2_trains_blocks_an_autograd_function_runs_again_in_backward": "rerun-zero2-2",
        "test_zero3_leaves_blocks_sharing_a_child_to_the_root_unit": "shared-child-zero3-2",
        "test_pp2_splits_a_model_with_no_grad_regions_reading_its_weights": "no-grad-gate-pp2-2",
    }.get(test)


LAUNCHES = Cases(
    {name: ranks for name, (ranks, _) in CASES.items()},
    *verify_cases(_plan, lambda name: CASES[name][1]),
    case_of=_case_of,
)


@pytest.fixture(scope="module")
def verified(launches):
    """name -> (plan, verify report)."""
    return lambda name: launches.result(LAUNCHES, name)


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_verify_dp_and_zero(verified, model, zero, ranks):
    plan, report = verified(f"{model}-zero{zero}-{ranks}")
    assert plan.mesh.dp == ranks and plan.zero_stage == zero
    assert report.ok, report.failure
    assert len(report.parallel_losses) == DP_ZERO_STEPS
    assert report.parallel_losses[-1] < report.parallel_losses[0]  # it trains


def test_ddp_leaves_what_the_forward_never_reads_out_of_its_buckets(verified):
    """A model holding modules its forward never calls (each layer's ``cross``, an ``unused_head``) under DDP: their
    gradients never come, so DDP's reducer stopped the second step ("Expected to have finished reduction in the
    prior iteration"). The plan names them by their outermost module, the program leaves them out of DDP's
    buckets, and it trains like one process, which leaves them untouched."""
    plan, report = verified("unread-ddp-2")
    assert plan.decisions.dp_runtime.name == "ddp" and plan.mesh.dp == 2
    assert plan.layout.unread_params == (*(f"layers.{i}.cross" for i in range(4)), "unused_head")
    assert report.ok, report.failure
    assert report.parallel_losses[-1] < report.parallel_losses[0]


def test_zero2_trains_blocks_an_autograd_function_runs_again_in_backward(verified):
    """Blocks inside an autograd Function whose own backward runs their layers again (Reformer's reversible layers):
    FSDP2 at ZeRO-2 keeps their parameters gathered until the end of the backward, and the program trains like one
    process (ZeRO-3 is refused for this model: tests/test_hidden_backward.py)."""
    plan, report = verified("rerun-zero2-2")
    assert plan.zero_stage == 2 and plan.decisions.dp_runtime.fsdp2
    assert report.ok, report.failure
    assert report.parallel_losses[-1] < report.parallel_losses[0]


def test_zero3_leaves_blocks_sharing_a_child_to_the_root_unit(verified):
    """Layers that hold one shared child module (Zamba's transformer block): FSDP2 refuses a parameter in two units,
    so the blocks holding it are left to the root's unit (``runtime.parallel._blocks_sharing_nothing``), and ZeRO-3
    trains like one process."""
    plan, report = verified("shared-child-zero3-2")
    assert plan.zero_stage == 3 and plan.layout.blocks == ("layers.0", "layers.1", "layers.2", "layers.3")
    assert report.ok, report.failure
    assert report.parallel_losses[-1] < report.parallel_losses[0]


def test_verify_eight_ranks_zero3(verified):
    plan, report = verified("eight-ranks-zero3")
    assert plan.mesh.dp == 8
    assert report.ok, report.failure


def test_verify_alternate_recompute(verified):
    """--recompute alternate (attention and every other weight matmul kept) trains like one process."""
    plan, report = verified("llama-alternate-zero3-2")
    assert plan.recompute == "alternate" and plan.zero_stage == 3
    assert report.ok, report.failure
    assert report.parallel_losses[-1] < report.parallel_losses[0]


def test_verify_alternate_recompute_reruns_the_tp_all_gathers(verified):
    """Over tp 2 with sequence parallelism alternate keeps the reduce-scatters only, as torchtitan's policy does: the
    all-gathers of the column-parallel linears' inputs run again in the backward's recomputation, and the program
    trains like one process."""
    plan, report = verified("llama-alternate-tp2-sp")
    assert plan.recompute == "alternate" and plan.mesh.tp == 2 and plan.sequence_parallel
    assert report.ok, report.failure
    assert report.parallel_losses[-1] < report.parallel_losses[0]


def test_verify_mixed_recompute_chosen_under_memory_pressure(verified):
    """With device memory between what full recompute and no recompute need, the planner recomputes
    some blocks only (passes.planning.recompute); that program trains like one process too."""
    plan, report = verified("mixed-recompute")
    tight = _tight_cluster()
    assert plan.recompute == "mixed" and len(set(plan.recompute_blocks.values())) > 1  # blocks differ
    assert plan.predicted.memory_peak_bytes_per_rank <= tight.device.memory_bytes
    assert report.ok, report.failure


@pytest.mark.parametrize("name", sorted(PRECISION_CASES))
def test_verify_pinned_precision(verified, name):
    """Each --precision trains like one process in that precision (verify's reference: autocast, the bf16 cast,
    the GradScaler; FSDP2's bf16 gathers). The program did run the precision: bf16-pure's losses are bf16
    numbers (their mean over the dp ranks), and an autocast run's first loss is the same-precision one-process loss, not the
    fp32 one (with tensor parallelism, whose 16-bit partial sums round otherwise: far from the fp32 one)."""
    from autoshard.modelfile import load_model_file
    from autoshard.verify import train_reference

    plan, report = verified(name)
    assert (
        plan.precision
        == {"bf16": "bf16-autocast", "bf16-pure": "bf16-pure", "fp16": "fp16-autocast"}[PRECISION_CASES[name][0]]
    )
    assert report.ok, report.failure
    assert report.parallel_losses[-1] < report.parallel_losses[0]  # it trains
    assert plan.mesh.tp == PRECISION_CASES[name][3]
    if plan.precision == "bf16-pure":
        # each rank's loss is a bf16 number (8 significant bits), the logged one their mean over the dp ranks
        spacing = [2.0 ** (math.floor(math.log2(loss)) - 7) for loss in report.parallel_losses]
        assert all((loss * plan.mesh.dp / ulp).is_integer() for loss, ulp in zip(report.parallel_losses, spacing))
        return
    fp32 = train_reference(load_model_file(MODELS["gpt"]), 8, 1, 0, 1e-3, fixed_randomness=True).losses[0]
    first, same_precision = report.parallel_losses[0], report.reference_losses[0]
    if plan.mesh.tp == 1:
        assert abs(first - same_precision) < abs(first - fp32)
    else:  # its 16-bit partial sums round otherwise than one process; an fp32 run would sit on fp32's loss (~1e-7)
        assert abs(first - fp32) > abs(same_precision - fp32) / 4


def test_pp2_splits_a_model_with_no_grad_regions_reading_its_weights(verified):
    """Each block computes a gate from its own weights and input under ``torch.no_grad()`` (a sparse-attention
    indexer's scores, a router's choice alike). ``pipeline()`` could not split a graph holding such regions, so the
    model was kept in one stage; inlined between calls that set the grad mode and put it back (runtime.grad_regions),
    the pp 2 program trains like one process: the gates' weights get no gradient, as in one process."""
    plan, report = verified("no-grad-gate-pp2-2")
    assert plan.mesh.pp == 2 and plan.layout.split_points
    assert report.ok, report.failure
    assert report.parallel_losses[-1] < report.parallel_losses[0]
