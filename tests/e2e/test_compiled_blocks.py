"""Plans with ``--compile on`` (each block compiled by inductor, ``runtime.compiled``) train like one process.

Each case is ``autoshard.verify`` of one plan in the session's 2-rank launch (one, 4 ranks, in its 4-rank launch): FSDP2 over compiled blocks that
recompute in full (the checkpoint traced inside the compiled block, FSDP2's hooks outside it), and DTensor tensor
parallelism inside compiled blocks with selective recompute, and with sequence parallelism under full recompute (the
block compiled inside its checkpoint) and under op-level selective recompute, on a transformers Llama with its
default dropout; context parallelism's ring run eager between compiled graphs, two pipeline stages each compiling
the blocks it holds, and both at once (pp 2 x cp 2, interleaved: the ring inside each stage's compiled blocks), all
with full recompute eager around the compiled block. Outside pipelines the loss is
compiled too (``runtime.compiled_loss``, the default under ``--compile on``).
The one-process reference runs eager, so the comparison covers inductor's kernels as well as the parallelism.
"""

import pytest

import autoshard
from e2e.one_launch import Cases, verify_cases

pytestmark = pytest.mark.e2e

CASES = {  # name: (model, cluster, pins)
    "gpt-zero2-full": (
        "examples/gpt.py:build",
        "local-cpu",
        dict(dp=2, tp=1, zero=2, microbatch_size=2, recompute="full"),
    ),
    "llama-tp2-selective": (
        "tests/models/hf_llama.py:build",
        "tests/clusters/fast_link_cpu.yaml",  # where TP pays
        dict(dp=1, tp=2, zero=0, recompute="selective"),
    ),
    # torchtitan's async-TP rows' layout (70B): sequence parallelism, the block compiled inside its full recompute
    "llama-tp2-sp-full": (
        "tests/models/hf_llama.py:build",
        "tests/clusters/fast_link_cpu.yaml",
        dict(dp=1, tp=2, zero=0, recompute="full", sequence_parallel=True),
    ),
    # (8B): sequence parallelism under torchtitan's op-level selective recompute, traced inside the compiled block
    "llama-tp2-sp-alternate": (
        "tests/models/hf_llama.py:build",
        "tests/clusters/fast_link_cpu.yaml",
        dict(dp=1, tp=2, zero=0, recompute="alternate", sequence_parallel=True),
    ),
    "gpt-cp2-full": ("examples/gpt.py:build", "local-cpu", dict(dp=1, tp=1, cp=2, recompute="full")),
    "gpt-pp2-full": ("examples/gpt.py:build", "local-cpu", dict(dp=1, tp=1, pp=2, schedule="1f1b", recompute="full")),
    # 4 ranks: the ring inside compiled stage blocks (a traced graph's attention, eager between compiled graphs)
    "gpt-pp2-cp2-full": (
        "examples/gpt.py:build",
        "local-cpu",
        dict(dp=1, tp=1, pp=2, cp=2, schedule="interleaved-1f1b", recompute="full"),
    ),
}
RANKS = {
    name: (pins.get("pp", 1) * pins.get("cp", 1) * pins["tp"] * pins["dp"]) for name, (_, _, pins) in CASES.items()
}
STEPS = 3


def _plan(name):
    model, cluster, pins = CASES[name]
    return autoshard.plan(
        model, cluster=cluster, devices_per_node=RANKS[name], global_batch=8, compile=True, **{"pp": 1, **pins}
    )


LAUNCHES = Cases(
    RANKS,
    *verify_cases(_plan, lambda name: STEPS),
    case_of=lambda test, params: params.get("name"),
)


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiled_blocks_train_like_one_process(launches, name):
    plan, report = launches.result(LAUNCHES, name)
    assert plan.decisions.compile and plan.recompute == CASES[name][2]["recompute"]
    pins = CASES[name][2]
    # the loss compiled with the blocks (torchtitan's default) outside pipelines and loss parallelism; eager there
    assert plan.decisions.compile_loss == (pins.get("pp", 1) == 1 and not plan.loss_parallel)
    assert (plan.mesh.tp, plan.mesh.cp, plan.mesh.pp) == (pins["tp"], pins.get("cp", 1), pins.get("pp", 1))
    assert plan.sequence_parallel == pins.get("sequence_parallel", plan.sequence_parallel)
    assert report.ok, report.failure
    assert len(report.parallel_losses) == STEPS and report.parallel_losses[-1] < report.parallel_losses[0]
