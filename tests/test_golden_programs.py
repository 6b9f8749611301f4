"""Emitted programs of every plan kind against their reviewed text, and the applier against the program.

``tests/golden/<kind>.plan.json`` is a plan; ``<kind>.py`` the program ``autoshard compile`` must print for
it, byte for byte. After a deliberate change to the programs, rewrite them with
``AUTOSHARD_UPDATE_GOLDEN=1 pytest tests/test_golden_programs.py`` and review the diff.

Each plan is the planner's own: ``PLAN_COMMANDS`` holds the ``autoshard plan`` command that made it, every
decision its kind is about pinned, so its decisions are ones the planner gives. After a change to the
planner or the plan format, remake them with ``python tests/test_golden_programs.py [KIND ...]`` (from the
repository root), then the programs as above.

The second test runs, in one process, the steps the Python API applies (``runtime.parallel.apply_steps``
on ``passes.lowering.lower``'s steps) and the emitted program's ``parallelize`` / ``build_pipeline``, each with the
applier's functions replaced by recorders, and requires the same calls with the same arguments in the
same order: the program and ``autoshard.parallelize`` cannot drift apart. The program's layout constants
(the mesh, the axes its loop reads, the sequence length) are ``passes.lowering.lower.layout``'s fields, which
``autoshard.parallelize`` reads, and the applier's table holds a function for every op the lowering emits.
"""

from __future__ import annotations

import ast
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from autoshard.ir.plan import load_plan
from autoshard.ir.steps import OPS, RESULTS
from autoshard.passes.lowering.codegen import emit_program
from autoshard.passes.lowering.lower import layout, lower
from autoshard.runtime import parallel

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"
KINDS = sorted(p.name.removesuffix(".plan.json") for p in GOLDEN.glob("*.plan.json"))
RUN_INPUTS = {"device": "DEVICE", "recipe": "RECIPE", "example_microbatch": "EXAMPLE", "loss_fn": "LOSS"}

GPT = "examples/gpt.py:build"
CPU4 = "--cluster local-cpu --devices-per-node 4"
FAST_LINK = "--cluster tests/clusters/fast_link_cpu.yaml"  # TP pays off: the layout shards attention too
# kind -> the `autoshard plan` arguments that made tests/golden/<kind>.plan.json (run from the repository root)
PLAN_COMMANDS = {
    # data parallel: DDP, ZeRO-1 (ZeroRedundancyOptimizer), ZeRO-3 (FSDP2), HSDP (FSDP2 inside a node, replicas across)
    "dp_zero0": f"{GPT} {CPU4} --global-batch 8 --dp 4 --tp 1 --pp 1 --zero 0 --microbatch-size 2 --recompute none",
    "dp_zero1": f"{GPT} {CPU4} --global-batch 8 --dp 4 --tp 1 --pp 1 --zero 1 --microbatch-size 2 --recompute none",
    "dp_zero3": f"{GPT} --cluster local-cpu --devices-per-node 2 --global-batch 8 --dp 2 --tp 1 --pp 1 --zero 3 "
    "--microbatch-size 4 --recompute none",
    "hsdp_zero3": f"{GPT} --cluster local-cpu --nodes 2 --devices-per-node 2 --global-batch 8 --dp 4 --tp 1 --pp 1 "
    "--zero 3 --microbatch-size 2 --recompute none --dp-replicate 2",
    # dp x tp: FSDP2's replicate, the distributed optimizer, ZeRO-2; sequence parallel
    "dp_tp_zero0": f"{GPT} {FAST_LINK} --devices-per-node 4 --global-batch 8 --dp 2 --tp 2 --pp 1 --zero 0 "
    "--microbatch-size 2 --recompute none --sequence-parallel off",
    "dp_tp_zero1": f"{GPT} {FAST_LINK} --devices-per-node 4 --global-batch 8 --dp 2 --tp 2 --pp 1 --zero 1 "
    "--microbatch-size 2 --recompute none --sequence-parallel off",
    "dp_tp_zero2": f"{GPT} {FAST_LINK} --devices-per-node 4 --global-batch 8 --dp 2 --tp 2 --pp 1 --zero 2 "
    "--microbatch-size 4 --recompute none --sequence-parallel off",
    "dp_tp_sequence_parallel": f"{GPT} {FAST_LINK} --devices-per-node 4 --global-batch 8 --dp 2 --tp 2 --pp 1 "
    "--zero 1 --microbatch-size 2 --recompute none --sequence-parallel on",
    # context parallel (each sample's tokens over 2 ranks), expert parallel (a mixture-of-experts model)
    "dp_cp_zero3": f"{GPT} {CPU4} --global-batch 8 --seq-len 32 --dp 2 --tp 1 --pp 1 --cp 2 --zero 3 "
    "--microbatch-size 4 --recompute none",
    "dp_ep_zero3": f"tests/models/hf_mixtral.py:build {CPU4} --global-batch 8 --dp 4 --tp 1 --pp 1 --ep 2 --zero 3 "
    "--microbatch-size 2 --recompute none",
    # bf16: a GPU cluster (NCCL) trains fp32 parameters under bf16 autocast, FSDP2 gathering bf16 weights
    "bf16_dp_zero3": f"{GPT} --cluster dgx-h100 --nodes 1 --global-batch 64 --dp 8 --tp 1 --pp 1 --zero 3 "
    "--microbatch-size 8 --recompute none",
    # context parallel inside pipeline stages: the split traces a cp rank's tokens, the schedule runs the ring
    "pp_cp": f"{GPT} {CPU4} --global-batch 8 --dp 1 --tp 1 --pp 2 --cp 2 --zero 0 --microbatch-size 2 "
    "--schedule 1f1b --recompute none",
    # per-block recompute: recompute is left to the planner, which mixes modes to fit 2.5 MiB ranks
    "mixed_recompute": f"{GPT} --cluster tests/clusters/cpu4_tight_memory.yaml --global-batch 8 --dp 4 --tp 1 --pp 1 "
    "--zero 3 --microbatch-size 1",
    # pipelines: 1F1B with recompute in the stages, interleaved, zero-bubble in a V, and dp x tp x pp
    "pipeline_recompute": f"{GPT} {CPU4} --global-batch 8 --dp 2 --tp 1 --pp 2 --zero 1 --microbatch-size 2 "
    "--schedule 1f1b --recompute selective",
    "interleaved_pipeline": f"{GPT} {CPU4} --global-batch 16 --dp 2 --tp 1 --pp 2 --zero 3 --microbatch-size 2 "
    "--schedule interleaved-1f1b --virtual-stages 2 --recompute none",
    "zbv_pipeline": f"{GPT} {CPU4} --global-batch 16 --dp 2 --tp 1 --pp 2 --zero 1 --schedule zbv",
    "tp_pp": f"{GPT} {FAST_LINK} --devices-per-node 8 --global-batch 16 --dp 2 --tp 2 --pp 2 --zero 0 "
    "--microbatch-size 4 --schedule interleaved-1f1b --virtual-stages 2 --recompute none --sequence-parallel off",
    # the same with sequence parallelism inside the stages (its styles as local shards with traced sequence ops)
    "tp_pp_sequence_parallel": f"{GPT} {FAST_LINK} --devices-per-node 8 --global-batch 16 --dp 2 --tp 2 --pp 2 "
    "--zero 0 --microbatch-size 4 --schedule interleaved-1f1b --virtual-stages 2 --recompute none "
    "--sequence-parallel on",
    # compiled blocks (torch.compile after recompute, before FSDP2) with torchtitan's op-level selective recompute
    "compiled_alternate": f"{GPT} --cluster local-cpu --devices-per-node 2 --global-batch 8 --dp 2 --tp 1 --pp 1 "
    "--zero 3 --microbatch-size 4 --recompute alternate --compile on",
    # async TP on an H100 cluster: compiled blocks recomputed in full beside TP with sequence parallelism, symmetric
    # memory for the TP group and inductor's micro-pipeline TP pass turned on before the blocks compile
    "async_tp": f"{GPT} --cluster dgx-h100 --nodes 1 --global-batch 64 --dp 4 --tp 2 --pp 1 --zero 3 "
    "--microbatch-size 8 --recompute full --sequence-parallel on --compile on --async-tp on",
    # the loss compiled beside compiled blocks (torchtitan's build_cross_entropy_loss under --training.compile)
    "compiled_loss": f"{GPT} --cluster local-cpu --devices-per-node 2 --global-batch 8 --dp 2 --tp 1 --pp 1 "
    "--zero 3 --microbatch-size 4 --recompute none --compile on --compile-loss on",
    # float8 (torchao, tensorwise) on an H100 cluster: the linears converted first, FSDP2 gathering float8 weights
    # and their scales computed after each optimizer step
    "float8_dp_zero3": f"{GPT} --cluster dgx-h100 --nodes 1 --global-batch 64 --dp 8 --tp 1 --pp 1 --zero 3 "
    "--microbatch-size 8 --recompute none --float8 tensorwise",
    # float8 beside TP with sequence parallelism: torchao's float8 TP styles on the converted linears (apply_tp's float8)
    "float8_tp_sequence_parallel": f"{GPT} --cluster dgx-h100 --nodes 1 --global-batch 64 --dp 4 --tp 2 --pp 1 "
    "--zero 3 --microbatch-size 8 --recompute none --sequence-parallel on --float8 tensorwise",
    # float8 beside pipeline stages and TP: each stage's linears converted right after the split
    "float8_tp_pp": f"{GPT} --cluster dgx-h100 --nodes 1 --global-batch 64 --dp 2 --tp 2 --pp 2 --zero 1 "
    "--microbatch-size 8 --schedule 1f1b --recompute none --sequence-parallel on --float8 tensorwise",
    # host offload (FSDP2's CPUOffloadPolicy) on an H100 cluster: the shards and the optimizer state in host memory
    "offload_dp_zero3": f"{GPT} --cluster dgx-h100 --nodes 1 --global-batch 64 --dp 8 --tp 1 --pp 1 --zero 3 "
    "--microbatch-size 8 --recompute none --float8 off --offload cpu",
}
REQUEST_FLAGS = ("--cluster", "--nodes", "--devices-per-node", "--global-batch", "--seq-len")  # not decisions


def test_the_kinds_cover_every_plan_shape():
    plans = [load_plan(GOLDEN / f"{kind}.plan.json") for kind in KINDS]
    assert len(KINDS) >= 12
    spmd = [p for p in plans if p.mesh.pp == 1]
    pipelines = [p for p in plans if p.mesh.pp > 1]
    assert {p.zero_stage for p in spmd if p.mesh.dp > 1 and p.mesh.tp == 1} >= {0, 1, 3}  # DDP, ZeRO-1, FSDP2
    assert {p.zero_stage for p in spmd if p.mesh.tp > 1 and p.mesh.dp > 1} >= {
        0,
        1,
        2,
    }  # replicate; distributed optimizer
    assert any(p.dp_replicate > 1 for p in plans)  # HSDP
    assert any(p.sequence_parallel for p in plans)
    assert any(p.mesh.cp > 1 and p.mesh.dp > 1 and p.model.get("seq_len") for p in plans)  # context parallel, --seq-len
    assert any(p.ep > 1 for p in plans)  # expert parallel
    assert any(p.precision == "bf16-autocast" for p in plans)
    assert any(p.decisions.float8 == "tensorwise" and p.float8_linears for p in plans)
    assert any(p.decisions.async_tp and p.decisions.compile and p.recompute == "full" for p in plans)
    assert any(p.decisions.compile_loss for p in spmd)
    assert any(p.decisions.float8 == "tensorwise" and p.mesh.tp > 1 for p in spmd)  # torchao's float8 TP styles
    assert any(p.decisions.float8 == "tensorwise" and p.mesh.tp > 1 for p in pipelines)  # converted after the split
    assert any(p.recompute == "mixed" and len(set(p.recompute_blocks.values())) > 1 for p in plans)
    assert {p.schedule for p in pipelines} >= {"1f1b", "interleaved-1f1b", "zbv"}  # zbv: stages in a V, backward split
    assert {p.zero_stage for p in pipelines} >= {0, 1, 3}
    assert any(p.recompute != "none" for p in pipelines)
    assert any(p.mesh.tp > 1 and p.mesh.dp > 1 for p in pipelines)


def test_every_plan_is_the_planners_for_its_command():
    """Each golden plan is a version 2 file ``PLAN_COMMANDS`` made: its model, request and pins are the command's."""
    assert set(PLAN_COMMANDS) == set(KINDS)
    for kind, command in PLAN_COMMANDS.items():
        path = GOLDEN / f"{kind}.plan.json"
        assert json.loads(path.read_text())["version"] == 2, kind
        plan = load_plan(path)
        model, *options = shlex.split(command)
        flags = dict(zip(options[::2], options[1::2], strict=True))
        assert model == plan.model["spec"], kind
        assert int(flags["--global-batch"]) == plan.global_batch, kind
        assert flags.get("--seq-len") == (str(plan.model["seq_len"]) if plan.model.get("seq_len") else None), kind
        for flag, field in (("--nodes", "nodes"), ("--devices-per-node", "devices_per_node")):
            assert flag not in flags or int(flags[flag]) == plan.cluster[field], (kind, flag)
        pins = {
            flag.removeprefix("--").replace("-", "_"): value
            for flag, value in flags.items()
            if flag not in REQUEST_FLAGS
        }
        assert set(plan.pinned) == set(pins), kind
        assert {name: _pin_text(plan, name) for name in pins} == pins, kind


def _pin_text(plan, name: str) -> str:
    """The value of the decision a pin fixes, as its flag writes it."""
    values = {
        "dp": plan.mesh.dp,
        "tp": plan.mesh.tp,
        "pp": plan.mesh.pp,
        "cp": plan.mesh.cp,
        "ep": plan.ep,
        "zero": plan.zero_stage,
        "microbatch_size": plan.microbatch_size,
        "recompute": plan.recompute,
        "schedule": plan.schedule,
        "virtual_stages": plan.virtual_stages,
        "dp_replicate": plan.dp_replicate,
        "sequence_parallel": "on" if plan.sequence_parallel else "off",
        "compile": "on" if plan.decisions.compile else "off",
        "float8": plan.decisions.float8,
        "offload": plan.decisions.offload,
        "async_tp": "on" if plan.decisions.async_tp else "off",
        "compile_loss": "on" if plan.decisions.compile_loss else "off",
    }
    return str(values[name])


@pytest.mark.parametrize("kind", KINDS)
def test_program_is_the_reviewed_one(kind):
    program = emit_program(load_plan(GOLDEN / f"{kind}.plan.json"))
    golden = GOLDEN / f"{kind}.py"
    if os.environ.get("AUTOSHARD_UPDATE_GOLDEN"):
        golden.write_text(program)
    compile(program, str(golden), "exec")
    assert program == golden.read_text(), f"{kind}: the emitted program changed; review it and update the golden"


@pytest.mark.parametrize("kind", KINDS)
def test_applier_and_program_make_the_same_calls(kind, monkeypatch):
    plan = load_plan(GOLDEN / f"{kind}.plan.json")
    applied: list = []
    for op in OPS:
        monkeypatch.setitem(parallel.APPLIERS, op, _recorder(applied, op))
    parallel.apply_steps("MODEL", lower(plan), FakeMesh(), **RUN_INPUTS)

    printed: list = []
    namespace = {"__name__": "emitted"}  # the program's main() runs only as __main__
    exec(compile(emit_program(plan), f"{kind}.py", "exec"), namespace)
    for op in OPS:
        if op in namespace:
            namespace[op] = _recorder(printed, op)
    if plan.mesh.pp > 1:
        namespace["build_pipeline"]("MODEL", FakeMesh(), "DEVICE", "RECIPE", "EXAMPLE", "LOSS")
    else:
        namespace["parallelize"]("MODEL", FakeMesh(), "DEVICE", "RECIPE")

    assert printed == applied
    assert [call[0] for call in applied] == [step.op for step in lower(plan)]


def test_programs_have_no_unused_or_undefined_names():
    """Every golden program passes pyflakes' checks (ruff's F rules, on their own): no unused import, no name
    used before it is bound, whatever the plan's kind."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "check",
            "--no-cache",
            "--isolated",
            "--select",
            "F",
            *sorted(str(GOLDEN / f"{kind}.py") for kind in KINDS),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_every_op_the_lowering_emits_has_its_applier():
    """``apply_steps`` finds each op's function in ``runtime.parallel.APPLIERS``: one for every op of ``ir.steps``
    (a Step refuses any other op), each the function the emitted programs import under the op's name."""
    emitted = {step.op for kind in KINDS for step in lower(load_plan(GOLDEN / f"{kind}.plan.json"))}
    assert set(parallel.APPLIERS) == set(OPS) >= emitted
    for op, function in parallel.APPLIERS.items():
        assert getattr(parallel, op) is function, op


@pytest.mark.parametrize("kind", KINDS)
def test_program_constants_are_the_plans_layout(kind):
    """The constants the emitted loop hands to the runtime are the layout ``autoshard.parallelize`` applies."""
    plan = load_plan(GOLDEN / f"{kind}.plan.json")
    spec = layout(plan)
    constants = {
        t.id: ast.literal_eval(n.value)
        for n in ast.parse(emit_program(plan)).body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
        and t.id in ("MESH", "FLATTEN", "DATA_AXIS", "SEQUENCE_AXIS", "LOSS_AXIS", "SEQ_LEN", "TOKENS_PER_SAMPLE")
    }
    expected = {
        "MESH": dict(spec.mesh),
        "FLATTEN": dict(spec.flatten),
        "DATA_AXIS": spec.data_axis,
        "SEQ_LEN": spec.seq_len,
        "TOKENS_PER_SAMPLE": spec.tokens_per_sample,
    }
    if plan.mesh.pp == 1:
        expected |= {"SEQUENCE_AXIS": spec.sequence_axis, "LOSS_AXIS": spec.loss_axis}
    elif spec.sequence_axis:  # a pipeline's schedule averages the loss itself; its split cuts the tokens
        expected |= {"SEQUENCE_AXIS": spec.sequence_axis}
    assert constants == expected
    assert list(constants["MESH"]) == [d for d in ("pp", "dp", "cp", "tp") if d != "cp" or plan.mesh.cp > 1]
    assert spec.world_size == plan.world_size


class FakeMesh:
    """Stands for the DeviceMesh: ``mesh["dp"]`` is the string "mesh[dp]"."""

    def __getitem__(self, dim: str) -> str:
        return f"mesh[{dim}]"

    def __eq__(self, other) -> bool:
        return isinstance(other, FakeMesh)


def _recorder(calls: list, op: str):
    def record(target, *args, **kwargs):
        calls.append((op, target, _plain(list(args)), _plain(kwargs)))
        if op == "split_pipeline":
            return "STAGES"
        return RESULTS.get(op, target).upper() if op in RESULTS else target

    return record


def _plain(value):
    """Lists for tuples, so a constant printed as a list equals the step's tuple."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


if __name__ == "__main__":  # remake the golden plans: python tests/test_golden_programs.py [KIND ...]
    for kind in sys.argv[1:] or PLAN_COMMANDS:
        out = GOLDEN / f"{kind}.plan.json"
        subprocess.run(
            [sys.executable, "-m", "autoshard", "plan", *shlex.split(PLAN_COMMANDS[kind]), "-o", str(out)],
            cwd=ROOT,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        print(f"{out.relative_to(ROOT)}: autoshard plan {PLAN_COMMANDS[kind]}")
    print("now rewrite the programs: AUTOSHARD_UPDATE_GOLDEN=1 pytest tests/test_golden_programs.py; review the diff")
