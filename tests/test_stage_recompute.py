"""Recompute inside pipeline stages (``runtime.stage_recompute``) and the planner's pp × recompute space.

Runtime: the bundled GPT (dropout added to each block) and a small transformers Llama are split into
2 stages with ``split_model``; ``pipe.split_gm`` runs the stage modules one after another in one
process. With recompute full, selective or mixed per block the loss and every parameter gradient
equal the run without recompute bit for bit (fp32, CPU): recompute reruns the same ops on the same
inputs, and checkpoint restores the RNG state, so dropout draws the same masks. The bytes the
forward leaves alive for backward show the recompute happens: full < selective < none.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autoshard.errors import AutoshardError
from autoshard.runtime.pipeline_parallel import (
    _prepare_split_backward,
    _recompute_once_per_weight_pass,
    split_model,
)
from autoshard.runtime.stage_recompute import apply_recompute_to_stage

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import gpt  # noqa: E402

GPT_BLOCKS = [f"h.{i}" for i in range(4)]
LLAMA_BLOCKS = [f"model.layers.{i}" for i in range(4)]
DROPOUT = 0.1


class DropoutBlock(gpt.Block):
    """GPT's block with dropout on both residual branches (the example keeps it off)."""

    def forward(self, x):
        x = x + F.dropout(self.attn(self.ln_1(x)), DROPOUT, self.training)
        return x + F.dropout(self.mlp(self.ln_2(x)), DROPOUT, self.training)


def build_gpt():
    model = gpt.build()
    for block in model.h:
        block.__class__ = DropoutBlock
    return model


def build_llama():
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(cfg)


def gpt_case():
    torch.manual_seed(0)
    (ids,), targets = gpt.example_batch(2)
    return build_gpt, ids, targets, ["h.2"], lambda out, y: gpt.loss_fn(out, y)


def llama_case():
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 16))
    loss = lambda out, y: F.cross_entropy(out.logits.reshape(-1, 128), y.reshape(-1))  # noqa: E731
    return build_llama, ids, ids.roll(-1, 1), ["model.layers.2"], loss


class LiveStorages(TorchDispatchMode):
    """Weak references to every storage an op makes; ``bytes_alive`` sums those still alive.

    Measured this way rather than with ``saved_tensors_hooks``: inside a checkpointed region
    checkpoint's own hooks (and selective recompute's cache) hold what is kept, out of an outer
    hook's sight, so the outer hook would see full and selective alike."""

    def __init__(self):
        super().__init__()
        self.made: list[tuple[StorageWeakRef, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.made.append((StorageWeakRef(storage), storage._cdata, storage.nbytes()))
        return out

    def bytes_alive(self) -> int:
        gc.collect()
        return sum(dict((cdata, n) for ref, cdata, n in self.made if not ref.expired()).values())


def run_stages(pipe, ids):
    """The pipe's top graph, which calls the stage modules in order (stage i's outputs into stage i + 1)."""
    return torch.fx.Interpreter(pipe.split_gm).run(ids)


CASES = {"gpt": gpt_case, "llama": llama_case}
_RUNS: dict[tuple, tuple] = {}


def run(name: str, modes: dict[str, str]):
    """(loss, {name: gradient}, wrapped blocks per stage, forward bytes left for backward, stage modules),
    once per (model, modes) in this module."""
    key = (name, tuple(sorted(modes.items())))
    if key not in _RUNS:
        _RUNS[key] = _run(CASES[name](), modes)
    return _RUNS[key]


def _run(case, modes: dict[str, str]):
    build, ids, targets, split, loss_fn = case
    torch.manual_seed(0)
    pipe = split_model(build(), (ids,), split)
    stages = [module for _, module in pipe.split_gm.named_children()]
    wrapped = [apply_recompute_to_stage(stage, modes) for stage in stages]
    torch.manual_seed(1)  # the dropout masks
    with LiveStorages() as live:
        flat = run_stages(pipe, ids)
        out = pytree.tree_unflatten(list(flat), pipe.model_output_spec)
        loss = loss_fn(out, targets)
    kept = live.bytes_alive()
    loss.backward()
    grads = {name: p.grad for name, p in pipe.split_gm.named_parameters()}
    return loss.detach(), grads, wrapped, kept, stages


def assert_same(reference, other):
    loss, grads = reference[0], reference[1]
    assert torch.equal(loss, other[0]), (loss, other[0])
    assert grads.keys() == other[1].keys()
    for name, grad in grads.items():
        assert grad is not None and torch.equal(grad, other[1][name]), name


@pytest.fixture(params=sorted(CASES))
def case(request):
    return request.param


@pytest.fixture
def baseline(case):
    return run(case, {})


def blocks_of(case: str) -> list[str]:
    return GPT_BLOCKS if case == "gpt" else LLAMA_BLOCKS


@pytest.mark.parametrize("mode", ["full", "selective", "mixed"])
def test_recompute_matches_bit_for_bit(case, baseline, mode):
    blocks = blocks_of(case)
    modes = (
        dict(zip(blocks, ["full", "selective", "none", "full"])) if mode == "mixed" else {path: mode for path in blocks}
    )
    result = run(case, modes)
    assert_same(baseline, result)
    assert result[2] == [[p for p in blocks[:2] if modes[p] != "none"], [p for p in blocks[2:] if modes[p] != "none"]]


def test_recompute_keeps_fewer_bytes(case, baseline):
    blocks = blocks_of(case)
    full = run(case, {path: "full" for path in blocks})[3]
    selective = run(case, {path: "selective" for path in blocks})[3]
    assert full < selective < baseline[3], (full, selective, baseline[3])


class SplitStage:
    """A split backward's two passes as torch's ``PipelineStage`` runs them past the first stage: the input pass
    (``backward_one_chunk(full_backward=False)``: ``stage_backward_input``, which ends in ``detach_()`` on every
    output) and the weight pass (``backward_weight_one_chunk``: ``stage_backward_weight`` over the parameter groups
    the input pass captured)."""

    def __init__(self, module: torch.nn.Module, outputs: list, inputs: list, output_grads: list | None):
        self.module, self.output_grads = module, output_grads
        self.fwd_cache = {0: (outputs, inputs)}
        self.groups: list = []

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward=True, last_backward=False) -> None:
        outputs, inputs = self.fwd_cache.pop(bwd_chunk_id)
        needing = [x for x in inputs if x.requires_grad]
        _, self.groups = stage_backward_input(list(outputs), self.output_grads, needing, self.module.parameters())

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        stage_backward_weight(self.module.parameters(), self.groups)


class _Received(Exception):
    pass


class _UpTo(torch.fx.Interpreter):
    """Runs the pipe's top graph until it calls stage ``target``, keeps that call's arguments (``received``) and
    stops there (the interpreter rewrites an exception's message, so they are kept here, not on it)."""

    def __init__(self, module, target: str):
        super().__init__(module)
        self.target, self.received = target, None

    def call_module(self, target, args, kwargs):
        if target == self.target:
            self.received = args
            raise _Received
        return super().call_module(target, args, kwargs)


def stage_inputs(pipe, ids, stage: str) -> list[torch.Tensor]:
    """What ``stage`` receives from the stages before it, as it receives it: detached, floats needing a gradient."""
    interpreter = _UpTo(pipe.split_gm, stage)
    with torch.no_grad(), pytest.raises(_Received):
        interpreter.run(ids)
    return [t.detach().requires_grad_(t.is_floating_point()) for t in interpreter.received]


def stage_backward(case: str, cuts: list[str], stage_name: str, split: str) -> tuple[int, int, dict, list, list]:
    """Stage ``stage_name`` of ``case`` cut at ``cuts``, under full recompute, its backward run as ``split`` says:
    "whole" (one backward call), "split" (torch's input pass, then its weight pass), "grouped" (the weight pass in
    one ``GraphExecGroup``: ``_recompute_once_per_weight_pass``), "program" (the emitted program's: grouped, and
    the inputs it passes on needing a gradient again after the input pass: ``_prepare_split_backward``, applied
    twice as two schedules over the same stages would).
    The last stage's backward starts from the loss, another's from ones on each output. Returns (block forwards
    rerun by the input pass or the whole backward, by the weight pass, parameter gradients, input gradients,
    whether each output is one of the stage's inputs)."""
    build, ids, targets, _, loss_fn = CASES[case]()
    torch.manual_seed(0)
    pipe = split_model(build(), (ids,), cuts)
    stage = pipe.split_gm.get_submodule(stage_name)
    calls = [0]
    for path in apply_recompute_to_stage(stage, {path: "full" for path in blocks_of(case)}):
        stage.get_submodule(path).register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    inputs = stage_inputs(pipe, ids, stage_name)
    torch.manual_seed(1)  # the dropout masks
    flat = stage(*inputs)
    flat = list(flat) if isinstance(flat, tuple) else [flat]
    passed = [any(out is x for x in inputs) for out in flat]
    if stage_name == max(name for name, _ in pipe.split_gm.named_children()):
        outputs, output_grads = [loss_fn(pytree.tree_unflatten(flat, pipe.model_output_spec), targets)], None
    else:
        outputs = [out for out in flat if out.requires_grad]  # torch's stage sends no gradient for the others
        output_grads = [torch.ones_like(out) for out in outputs]
    calls[0] = 0
    if split == "whole":
        torch.autograd.backward(outputs, output_grads)
        first, weight = calls[0], 0
    else:
        runner = SplitStage(stage, outputs, inputs, output_grads)
        if split == "program":
            for _ in range(2):  # a second schedule over the same stages wraps nothing twice
                _prepare_split_backward(runner)
        if split == "grouped":
            _recompute_once_per_weight_pass(runner)
        runner.backward_one_chunk(0, full_backward=False)
        first, calls[0] = calls[0], 0
        runner.backward_weight_one_chunk(0, last_backward=True)
        weight = calls[0]
    grads = {name: p.grad for name, p in stage.named_parameters()}
    return first, weight, grads, [x.grad for x in inputs], passed


def assert_same_gradients(whole, other) -> None:
    assert other[2].keys() == whole[2].keys()
    assert all(g is not None and torch.equal(g, other[2][name]) for name, g in whole[2].items())
    assert all((a is None) == (b is None) and (a is None or torch.equal(a, b)) for a, b in zip(whole[3], other[3]))


def test_the_weight_pass_reruns_each_block_once_and_trains_alike(case):
    """A zero-bubble schedule's weight pass makes one ``autograd`` call per parameter group, and torch reruns a
    checkpointed block in each (8 for each of GPT's blocks, 9 for Llama's); the emitted program's weight pass
    (``_recompute_once_per_weight_pass``: one ``GraphExecGroup``) reruns each block once, and the last stage's
    parameter and input gradients equal those of one backward call bit for bit (GPT with dropout on)."""
    blocks, cuts = 2, ["h.2"] if case == "gpt" else ["model.layers.2"]  # the last stage's blocks
    whole, plain, grouped = (
        stage_backward(case, cuts, "submod_pp_1", split) for split in ("whole", "split", "grouped")
    )
    assert whole[:2] == (blocks, 0)
    assert plain[0] == grouped[0] == blocks
    assert plain[1] >= 8 * blocks and grouped[1] == blocks
    assert_same_gradients(whole, plain)
    assert_same_gradients(whole, grouped)


def test_a_stage_that_passes_inputs_on_reruns_its_blocks_as_the_forward_ran():
    """Llama's middle stage passes the rotary ``cos`` and ``sin`` on unchanged: those outputs are its input tensors,
    and torch's input pass ``detach_()``es every output, so the inputs stop needing a gradient. Its blocks read
    them through ``pipeline_skips.grad_sendable`` (which makes the gradients sent back contiguous), made while they
    still needed one, so the weight pass's rerun saves what the forward did; the program also gives the inputs
    their ``requires_grad`` back after the input pass (``_keep_passed_inputs_needing_grad``). Either way the
    weights' gradients equal one backward call's bit for bit."""
    cuts = ["model.layers.1", "model.layers.3"]  # the middle stage holds layers 1 and 2
    whole = stage_backward("llama", cuts, "submod_pp_1", "whole")
    assert sum(whole[4]) >= 2, "the middle stage passes cos and sin on as they came"
    for split in ("grouped", "program"):
        run = stage_backward("llama", cuts, "submod_pp_1", split)
        assert run[:2] == (2, 2), split
        assert_same_gradients(whole, run)


def test_state_is_unchanged(case, baseline):
    stages = run(case, {path: "full" for path in blocks_of(case)})[4]
    for before, after in zip(baseline[4], stages):
        assert list(before.state_dict()) == list(after.state_dict())
        assert [n for n, _ in before.named_parameters()] == [n for n, _ in after.named_parameters()]
        assert [n for n, _ in before.named_buffers()] == [n for n, _ in after.named_buffers()]


def test_dropout_is_on():
    first = run("gpt", {})[0]
    build, ids, targets, split, loss_fn = gpt_case()
    torch.manual_seed(0)
    pipe = split_model(build(), (ids,), split)
    torch.manual_seed(2)
    assert not torch.equal(first, loss_fn(run_stages(pipe, ids)[0], targets).detach())


# ---------------------------------------------------------------------------- flat graphs: outlining


def flat_gpt():
    torch.manual_seed(0)
    (ids,), targets = gpt.example_batch(2)
    model = build_gpt()
    return torch.export.export(model, (ids,)).module(), ids, targets


def flat_run(modes):
    module, ids, targets = flat_gpt()
    wrapped = apply_recompute_to_stage(module, modes)
    torch.manual_seed(1)
    loss = gpt.loss_fn(module(ids), targets)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in module.named_parameters()}, wrapped, module


def test_flat_graph_is_outlined_without_moving_state():
    reference = flat_run({})
    result = flat_run({"h.1": "full", "h.2": "selective"})
    assert_same(reference, result)
    module = result[3]
    assert result[2] == ["h.1", "h.2"]
    assert list(module.state_dict()) == list(reference[3].state_dict())
    for name in ("_recompute_h_1", "_recompute_h_2"):
        outlined = module.get_submodule(name)
        assert not list(outlined.parameters()) and not list(outlined.buffers())
        assert not any(n.op == "get_attr" for n in outlined.graph.nodes)


def test_non_contiguous_block_is_refused():
    module, _, _ = flat_gpt()
    run_nodes = [
        n for n in module.graph.nodes if any(v[0] == "h.1" for v in (n.meta.get("nn_module_stack") or {}).values())
    ]
    middle = run_nodes[len(run_nodes) // 2]
    middle.meta["nn_module_stack"] = {
        k: v for k, v in middle.meta["nn_module_stack"].items() if v[0] != "h.1" and not v[0].startswith("h.1.")
    }
    with pytest.raises(AutoshardError, match="not one contiguous run"):
        apply_recompute_to_stage(module, {"h.1": "full"})


def test_buffer_update_is_refused():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.bn = torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)

        def forward(self, x):
            return self.bn(self.lin(x))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block() for _ in range(2))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    pipe = split_model(Net(), (torch.randn(4, 8),), ["blocks.1"])
    with pytest.raises(AutoshardError, match="mutates a tensor in place"):
        apply_recompute_to_stage(pipe.split_gm.submod_pp_0, {"blocks.0": "full"})


def test_unknown_mode_is_refused():
    module, _, _ = flat_gpt()
    with pytest.raises(AutoshardError, match="recompute mode 'some'"):
        apply_recompute_to_stage(module, {"h.0": "some"})


# ---------------------------------------------------------------------------- TP stages: custom-op collectives


@pytest.fixture(scope="module")
def tp_group():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29641")
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", rank=0, world_size=1)
    yield dist.new_group([0])
    if owned:
        dist.destroy_process_group()


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[str(func)] = self.count.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))


def tp_run(group, mode: str):
    """GPT with Megatron's layout in every block over a tp group of 1 (the collectives are in the graph)."""
    from autoshard.runtime.tensor_parallel_stages import shard_for_tracing

    torch.manual_seed(0)
    (ids,), targets = gpt.example_batch(2)
    model = build_gpt()
    styles = {}
    for i in range(4):
        styles.update({f"h.{i}.attn.{p}": "colwise" for p in ("q_proj", "k_proj", "v_proj")})
        styles.update({f"h.{i}.attn.c_proj": "rowwise", f"h.{i}.mlp.c_fc": "colwise", f"h.{i}.mlp.c_proj": "rowwise"})
    shard_for_tracing(model, group, styles)
    pipe = split_model(model, (ids,), ["h.2"])
    for _, stage in pipe.split_gm.named_children():
        apply_recompute_to_stage(stage, {path: mode for path in GPT_BLOCKS})
    torch.manual_seed(1)
    loss = gpt.loss_fn(run_stages(pipe, ids)[0], targets)
    with OpCount() as ops:
        loss.backward()
    grads = {n: p.grad for n, p in pipe.split_gm.named_parameters()}
    return loss.detach(), grads, ops.count.get("autoshard.tp_reduce.default", 0)


def test_tp_stage_recompute_repeats_forward_collectives_only_when_full(tp_group):
    reference = tp_run(tp_group, "none")
    full, selective = tp_run(tp_group, "full"), tp_run(tp_group, "selective")
    assert_same(reference, full)
    assert_same(reference, selective)
    # backward of tp_copy all-reduces (4 per block); full recompute reruns the 2 forward tp_reduces per block
    assert (reference[2], selective[2], full[2]) == (16, 16, 24)


# ---------------------------------------------------------------------------- the planner: pp × recompute

GPT_FILE = str(ROOT / "examples/gpt.py:build")
TIGHT = str(ROOT / "tests/clusters/cpu4_tight_memory.yaml")


def test_pipeline_configurations_enumerate_uniform_recompute():
    from autoshard.ir.decisions import Mesh
    from autoshard.passes.planning.pin_checks import check_pins
    from autoshard.passes.planning.strategies import Pins, mesh_configs

    configs = mesh_configs(Mesh(dp=2, tp=1, pp=2), 8, Pins(), blocks=4)
    assert {c.recompute for c in configs} == {"none", "selective", "full"}
    assert {c.recompute for c in mesh_configs(Mesh(dp=2, tp=1, pp=2), 8, Pins(recompute="full"), 4)} == {"full"}
    from autoshard.cost.hardware import load_cluster

    check_pins(Pins(pp=2, recompute="selective"), load_cluster("local-cpu", devices_per_node=4), 8)


def _estimate(cluster, plan, recompute, **kwargs):
    from autoshard.api import estimate

    return estimate(
        GPT_FILE,
        cluster=cluster,
        global_batch=8,
        dp=plan.mesh.dp,
        tp=plan.mesh.tp,
        pp=plan.mesh.pp,
        zero=plan.zero_stage,
        microbatch_size=plan.microbatch_size,
        recompute=recompute,
        schedule=plan.schedule,
        **kwargs,
    )


def test_pinned_pipeline_recompute_is_planned_and_priced():
    import autoshard

    plan = autoshard.plan(GPT_FILE, cluster="local-cpu", devices_per_node=4, global_batch=8, pp=2, recompute="full")
    assert (plan.mesh.pp, plan.recompute) == (2, "full")
    assert _estimate("local-cpu", plan, "full", devices_per_node=4).predicted == plan.predicted
    without = _estimate("local-cpu", plan, "none", devices_per_node=4).predicted
    assert plan.predicted.memory_peak_bytes_per_rank < without.memory_peak_bytes_per_rank
    assert plan.predicted.compute_s > without.compute_s  # the recomputed forward


def test_tight_memory_plans_recompute_inside_pipeline_stages():
    import autoshard

    plan = autoshard.plan(GPT_FILE, cluster=TIGHT, global_batch=8, pp=2)
    assert plan.mesh.pp > 1 and plan.recompute in ("selective", "full"), (plan.mesh, plan.recompute)
    assert _estimate(TIGHT, plan, plan.recompute).predicted == plan.predicted
    assert any("does not fit" in note for note in _estimate(TIGHT, plan, "none").notes)
    # no pipeline of it fits without recompute, but with sequence parallelism (its stages' norms, residuals and
    # boundaries on 1/tp of the tokens)
    with pytest.raises(AutoshardError, match="no plan fits in memory"):
        autoshard.plan(GPT_FILE, cluster=TIGHT, global_batch=8, pp=2, recompute="none", sequence_parallel=False)
    assert autoshard.plan(GPT_FILE, cluster=TIGHT, global_batch=8, pp=2, recompute="none").sequence_parallel


def test_second_application_is_refused():
    module, _, _ = flat_gpt()
    apply_recompute_to_stage(module, {"h.1": "full"})
    with pytest.raises(AutoshardError, match="already recomputed"):
        apply_recompute_to_stage(module, {"h.1": "selective"})
    case = gpt_case()
    pipe = split_model(case[0](), (case[1],), case[3])
    apply_recompute_to_stage(pipe.split_gm.submod_pp_0, {"h.0": "full"})
    with pytest.raises(AutoshardError, match="already recomputed"):
        apply_recompute_to_stage(pipe.split_gm.submod_pp_0, {"h.0": "full"})


def test_the_weight_pass_inputs_are_priced_as_torch_keeps_them(in_repo):
    """What a split backward keeps of a micro-batch from its input pass to its weight pass: torch's
    ``stage_backward_input`` hooks, for each parameter group, the gradients flowing into the ops where the weights'
    paths meet the inputs'. Their bytes on a GPT block equal ``cost.saved.weight_grad_inputs`` of the block's
    captured ops (the gradients of the outputs of the ops that read a trained parameter)."""
    from autoshard.cost.saved import weight_grad_inputs
    from autoshard.pipeline import capture_graph

    _, graph = capture_graph("examples/gpt.py:build")
    torch.manual_seed(0)
    model = gpt.build()
    block = graph.blocks[1]
    module = model.get_submodule(block.path)
    batch, cfg = 2, gpt.CONFIG
    x = torch.randn(batch, cfg.block_size, cfg.n_embd, requires_grad=True)
    out = module(x)
    _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], module.parameters())
    grads = [t for g in groups for grad in g.get("grads") or () for t in pytree.tree_leaves(grad) if t is not None]
    kept = {t.data_ptr(): t.numel() * t.element_size() for t in grads}  # per output of each hooked op
    priced = weight_grad_inputs(graph, (graph.node(n) for n in block.node_names), 1.0) * batch / graph.batch_size
    assert len(kept) >= 8 and sum(kept.values()) == pytest.approx(priced, rel=0.01)
    stage_backward_weight(module.parameters(), groups)
