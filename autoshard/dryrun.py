"""``autoshard dryrun plan.json``: one rank of the plan's world runs the program's setup and two training steps on
fake tensors, and torch's memory tracker says what it held at its peak, by part, beside the plan's prediction.

For each rank asked for (default: one of each distinct role, ``default_ranks``: rank 0, and the rank holding a
pipeline's last stage), in this one process:

1. a fake process group of the plan's world size (torch's ``FakeStore`` and "fake" backend: collectives,
   sends and receives return at once and move nothing) and the program's mesh on it (``runtime.build_mesh``,
   device type "cpu");
2. the program's setup: ``runtime.build_meta_model``, then the plan's steps (``passes.lowering.lower``) as its
   ``parallelize`` (or ``build_pipeline``) calls them, with the same run inputs (a pipeline's example
   micro-batch and loss), those before ``init_weights`` on the meta device, the rest under
   ``FakeTensorMode``: the rank's shards, optimizer and every activation are fake tensors (shapes, no memory);
3. the program's loop for ``steps`` steps under ``torch.distributed._tools.mem_tracker.MemTracker``, which
   counts every live tensor by what it is: the SPMD loop (``runtime.take_samples``, then the program's own
   ``runtime.forward_backward``: micro-batches, sequence shards, gradient sync, ring attention, the plan's
   precision), or
   the pipeline loop (``take_samples``, ``pipeline_parallel.pipeline_step`` under ``autocast``: the
   schedule runs this rank's stages over every micro-batch, and its receive buffers are made at the
   micro-batch's shapes as on a real run; they hold no values, which fake tensors never do).

The tracker's parts map to the plan's (``cost.rank_memory.spmd_moments``): parameters and buffers -> weights
(FSDP2's gathered bf16 weights too: the tracker tags a unit's parameters when it runs), gradients -> grads
(FSDP2's unsharded gradients too, tagged at the unit's backward), optimizer state -> optimizer (AdamW's step
temporaries too), activations -> activations (a recomputed block's too), temporaries -> transient (the
loss's and the activations' gradients, FSDP2's reduce-scatter copies). A pipeline rank is compared with its own
pp rank's prediction (``rank_prediction``). The predicted peak compared is the sum of the predicted parts: the
plan's own adds the allocator's slack, which no tracker sees. Nothing real is allocated beyond the meta model's
record, so an 8B or 70B plan's rank runs here.

Where the fake group differs from a real one, the program runs unchanged and the dry run stands in:
DDP's construction skips comparing and broadcasting parameter values (``apply_ddp``: ``init_sync`` off on
fake tensors, which have none); its reducer reads each bucket's all-reduce from the work's result, which the
fake backend leaves empty, so the same all-reduce runs in a hook that hands the bucket back, and the buckets
keep the layout they were built with (``_ddp_on_the_fake_group``); a pipeline's mean loss is not read
(``pipeline_parallel.global_mean_loss``: nan on fake tensors); transformers' experts' ``grouped_mm`` is
shaped without its fake kernel's bf16-only check (``_grouped_mm_shapes_in_any_dtype``). The tracker's module
hooks take a pipeline stage's received inputs through a view (``_tracked_stages``: they cannot wait on a
leaf's gradient inside the zero-bubble schedules' ``autograd.grad``), and a micro-batch's multi-grad hooks are removed
once its backward is over (``_chunk_hooks_released``: left on the graph they keep a split backward's saved tensors
alive, which a real run frees).

Attention runs as the plan's device runs it (``attention_kernel``, named in the report's notes). Fake tensors are
CPU tensors, and on the CPU scaled-dot-product attention with dropout takes the math path, which keeps the
attention probabilities and their dropout mask for its backward (b·h·s² each); CUDA's flash and memory-efficient
kernels keep q, k, v, the output, its log-sum-exp and a random-number state instead. For a plan of a GPU cluster
the dry run therefore calls attention with its dropout set aside (``_attention_as_on_the_device``): the CPU's
flash kernel then keeps what CUDA's does (the values differ; fake tensors have none). Without dropout the CPU
takes its flash kernel already, as CUDA does.

What it does not see: kernels' workspaces and the caching allocator's fragmentation. The tracker's parts are
those alive at the moment of the peak: gradients still being reduced count as temporaries there.

Expert parallelism sizes each all-to-all from the routing's values, which fake tensors do not have: on fake
tensors the dispatch takes the balanced split, every rank sending its token-expert pairs evenly over the ep
ranks and receiving as many (``expert_parallel._balanced_route``), the mean load; the report says so
(``notes``). The dispatch is one op whose fake kernel makes only its output, so its forward's exchange
buffers are not seen; its backward, which routes and exchanges again and recomputes the experts, is seen whole.
"""

from __future__ import annotations

import contextlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from unittest import mock

from autoshard.errors import AutoshardError
from autoshard.ir.plan import Plan, without_float8
from autoshard.ir.plan_format import V_SCHEDULES

PARTS = ("weights", "grads", "optimizer", "activations", "transient")
# MemTracker's reference types -> the plan's memory parts
_PART_OF = {
    "Parameter": "weights",
    "Buffer": "weights",
    "Gradient": "grads",
    "Optstate": "optimizer",
    "Activation": "activations",
    "Temp": "transient",
    "Other": "transient",
}
_PREDICTED_KEY = {
    "weights": "params_bytes",
    "grads": "grads_bytes",
    "optimizer": "optimizer_bytes",
    "activations": "activations_bytes",
    "transient": "transient_bytes",
}


@dataclass
class RankMemory:
    """One rank's measured peak by part, beside the plan's prediction (bytes)."""

    rank: int
    peak_bytes: int
    predicted_peak_bytes: int
    parts: dict[str, tuple[int, int]] = field(default_factory=dict)  # part -> (measured, predicted)

    def as_json(self) -> dict:
        return {
            "rank": self.rank,
            "peak_bytes": self.peak_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "parts": {part: list(pair) for part, pair in self.parts.items()},
        }

    @property
    def most_off(self) -> str:
        """The part whose measured bytes differ most from the prediction."""
        return max(self.parts, key=lambda part: abs(self.parts[part][0] - self.parts[part][1]))


def notes(plan: Plan) -> list[str]:
    """What the dry run assumes where fake tensors have no values or the CPU's kernels differ, for the report."""
    said = [f"attention: counted as {attention_kernel(plan)} keeps it"]
    if plan.float8_linears:
        said.append(
            f"float8 {plan.decisions.float8}: its {len(plan.float8_linears)} linears run as their bf16 twin (the CPU "
            "kernels have no float8 matmuls; torchao's float8 keeps each weight and adds transient casts)"
        )
    if plan.model["spec"].startswith("hf:"):
        said.append(
            "transformers' causal mask: positions taken as one sequence per sample (fake tensors have no values "
            "for its packed-sequence check), so no mask is built, as on a real run of the program's own positions"
        )
    if plan.ep == 1:
        return said
    return said + [
        f"expert parallelism: each all-to-all's splits assumed balanced (each rank sends its token-expert "
        f"pairs evenly to the {plan.ep} ep ranks and receives as many, its mean load): fake tensors have no "
        f"routing to count; the cost model prices the time of the most loaded rank"
    ]


def on_gpus(plan: Plan) -> bool:
    """Whether the plan's cluster runs on GPUs (NCCL), not on CPU ranks (gloo)."""
    return plan.cluster.get("backend") != "gloo"


def attention_kernel(plan: Plan) -> str:
    """The attention kernel whose saved tensors the dry run counts (module doc)."""
    if on_gpus(plan):
        return "CUDA's flash or memory-efficient kernel (q, k, v, the output and its log-sum-exp)"
    return "the CPU's kernels (flash without dropout; with dropout the math path, its probabilities and mask)"


def default_ranks(plan: Plan) -> list[int]:
    """One rank of each distinct role: rank 0 (the first pipeline stage; under expert parallelism every rank
    holds experts), and with pipeline stages the rank holding the last stage when that is another one: pp
    rank pp − 1 with dp, cp and tp rank 0 (in a V, rank 0 holds the first and the last stage)."""
    if plan.mesh.pp == 1 or plan.schedule in V_SCHEDULES:
        return [0]
    return [0, (plan.mesh.pp - 1) * (plan.world_size // plan.mesh.pp)]


def dryrun(plan: Plan, ranks: list[int] | None = None, steps: int = 2) -> list[RankMemory]:
    """Each rank of ``ranks`` (default: ``default_ranks``) through setup and ``steps`` steps (module doc)."""
    if plan.predicted is None:
        raise AutoshardError("the plan has no prediction to compare with (it does not fit); re-plan it")
    world = plan.world_size
    for rank in ranks or ():
        if not 0 <= rank < world:
            raise AutoshardError(f"--rank {rank} is not a rank of this plan's {world}; give 0 to {world - 1}")
    twin = without_float8(plan)  # the dry run's CPU kernels have no float8 matmuls (notes)
    return [_one_rank(twin, rank, steps) for rank in ranks or default_ranks(plan)]


def _one_rank(plan: Plan, rank: int, steps: int) -> RankMemory:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autoshard.passes.lowering.lower import layout

    spec = layout(plan)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=spec.world_size)
    try:
        peak = _setup_and_train(plan, spec, steps)
    finally:
        dist.destroy_process_group()
    predicted = rank_prediction(plan, rank)
    parts = {part: (peak.get(part, 0), int(getattr(predicted, _PREDICTED_KEY[part]))) for part in PARTS}
    # the parts' sum: the plan's peak adds the allocator's slack (cost.rank_memory), which no tracker sees
    return RankMemory(rank, sum(peak.values()), sum(pair[1] for pair in parts.values()), parts)


def rank_prediction(plan: Plan, rank: int):
    """The plan's predicted memory of ``rank``: its pipeline rank's own (``Predicted.pp_rank_memory``, the pp
    rank of the stages holding it), else the plan's one figure (every SPMD rank alike; older pipeline plans)."""
    by_pp_rank = plan.predicted.pp_rank_memory
    stage = next((stage.index for stage in plan.stages if rank in stage.ranks), None)
    if stage is None or len(by_pp_rank) != plan.mesh.pp:
        return plan.predicted.memory
    return by_pp_rank[_pp_rank_of_stage(plan, stage)]


def _pp_rank_of_stage(plan: Plan, stage: int) -> int:
    """The pp rank holding stage ``stage``: s mod pp looped, min(s, 2·pp − 1 − s) in a V."""
    pp = plan.mesh.pp
    return min(stage, 2 * pp - 1 - stage) if plan.schedule in V_SCHEDULES else stage % pp


def _setup_and_train(plan: Plan, spec, steps: int) -> dict[str, int]:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autoshard import runtime
    from autoshard.passes.lowering.lower import lower
    from autoshard.runtime.recipe import Recipe

    device = torch.device("cpu")
    mesh = runtime.build_mesh("cpu", dict(spec.mesh), dict(spec.flatten))
    model_file = runtime.load_model_file(plan.model["spec"], expected_hash=plan.model["hash"], seq_len=spec.seq_len)
    model = runtime.build_meta_model(model_file, seed=0, device=device)
    pipeline = plan.mesh.pp > 1
    run_inputs = {"device": device, "recipe": Recipe()}  # the optimizer's state is the same size whatever its settings
    if pipeline:  # as the emitted pipeline program: the stages' buffers are sized from one micro-batch
        first_inputs = runtime.global_batch(model_file, plan.global_batch, 0, 0)[0]
        run_inputs |= {
            "example_microbatch": tuple(t[: plan.microbatch_size].to(device) for t in first_inputs),
            "loss_fn": model_file.loss,
        }
    lowered = lower(plan)
    first_made = next(i for i, step in enumerate(lowered) if step.op == "init_weights")
    model = runtime.apply_steps(model, lowered[:first_made], mesh, **run_inputs)["model"]
    tracker = _peak_tracker()
    with FakeTensorMode(allow_non_fake_inputs=True), _grouped_mm_shapes_in_any_dtype():
        applied = runtime.apply_steps(model, lowered[first_made:], mesh, **run_inputs)
        model, optimizer = applied["model"], applied["optimizer"]
        modules = model.modules if pipeline else [model]
        optimizers = optimizer.optimizers if pipeline else [optimizer]
        tracker.track_external(*modules, *optimizers)
        _ddp_on_the_fake_group(model, tracker)
        released = _chunk_hooks_released(applied["schedule"]) if pipeline else contextlib.nullcontext()
        attention = _attention_as_on_the_device() if on_gpus(plan) else contextlib.nullcontext()
        with (
            _tracked_stages(tracker, modules if pipeline else []),
            released,
            _propagation_apart(),
            attention,
            _one_sequence_per_sample(),
            tracker,
        ):
            for step in range(steps):
                if pipeline:
                    _pipeline_step(plan, spec, model_file, model, applied["schedule"], optimizer, mesh, device, step)
                else:
                    _train_step(plan, spec, model_file, model, optimizer, mesh, device, step, tracker)
    return _parts(tracker.get_tracker_snapshot("peak"))


def _peak_tracker():
    """torch's ``MemTracker``, keeping the rank's peak only. After every op the tracker also raises the peak
    of each module then running, iterating over every module it has seen (a deep model's hundreds, on each of
    a step's ten thousands of ops) and copying the snapshot for each new module peak: per-module records the
    dry run never reads, and the most of the tracker's own time on a deep model. The rank's peak is kept as
    the tracker keeps it (``_peak_mem``, ``_peak_mem_snap``)."""
    from copy import deepcopy

    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

    class PeakTracker(MemTracker):
        def _update_peak_stats(self, peak_state) -> None:
            for device, snapshot in self._curr_mem_snap.items():
                if self._peak_mem.get(device, 0) < snapshot[_TOTAL_KEY]:
                    self._peak_mem[device] = snapshot[_TOTAL_KEY]
                    self._peak_mem_snap[device] = deepcopy(snapshot)

    return PeakTracker()


@contextlib.contextmanager
def _grouped_mm_shapes_in_any_dtype():
    """``aten._grouped_mm`` on fake tensors in the dtype the program runs it in. Its fake kernel (torch's meta
    function) checks first that the inputs are bf16, CUDA's kernel's limit, where the CPU kernel, which a
    CPU plan's program runs (transformers' experts in fp32), takes any float: for the dry run's duration the
    output is made from torch's own shape function alone (``_create_grouped_mm_output_tensor``)."""
    import torch
    from torch._meta_registrations import _create_grouped_mm_output_tensor
    from torch._subclasses import fake_impls
    from torch._subclasses.fake_tensor import FakeTensor

    op = torch.ops.aten._grouped_mm.default

    def grouped_mm(fake_mode, func, mat_a, mat_b, offs=None, bias=None, out_dtype=None):
        with fake_impls.in_kernel_invocation_manager(fake_mode):
            out = _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)
        return FakeTensor(fake_mode, out, mat_a.device)

    if op in fake_impls.op_implementations_dict:  # torch has its own now: nothing to stand in for
        yield
        return
    fake_impls.op_implementations_dict[op] = grouped_mm
    try:
        yield
    finally:
        fake_impls.op_implementations_dict.pop(op, None)


@contextlib.contextmanager
def _tracked_stages(tracker, stage_modules: list):
    """Two hooks on each pipeline stage's forward, run before the tracker's (global hooks, registered first):

    - MemTracker keeps one forward's record per module and refuses a module's second forward (the SPMD loop
      clears the records before each micro-batch); a schedule runs each stage once per micro-batch,
      interleaved with other micro-batches' backwards: a stage's records are dropped as it begins a forward
      (the peak stays);
    - the tracker's module hooks wait on the gradients of a module's inputs with a multi-grad hook, which
      autograd cannot evaluate for a leaf inside ``autograd.grad``, and the zero-bubble schedules take a
      stage's input gradients with ``autograd.grad`` on its received inputs, leaves: the stage takes a view of
      each (no memory; the gradient flows through it to the leaf as before)."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    roots = {id(module) for module in stage_modules}

    def before_forward(module, args):
        if id(module) not in roots:
            return None
        for sub in module.modules():
            tracker.memory_tracking.pop(sub, None)
        return tuple(a.view_as(a) if getattr(a, "is_leaf", False) and a.requires_grad else a for a in args)

    handle = register_module_forward_pre_hook(before_forward) if roots else None
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()


@contextlib.contextmanager
def _chunk_hooks_released(schedule):
    """The tracker's multi-grad hooks of a stage's micro-batch removed once that micro-batch's backward is over
    (after ``backward_one_chunk`` with the full backward, after ``backward_weight_one_chunk`` when it is split).

    ``ModTracker`` hooks every module's inputs (``register_multi_grad_hook``, mode "all") and keeps no handle. Each
    hook's closure holds the ``grad_fn`` of the tensors it waits on and is stored on that same node: a cycle,
    which Python's collector does not free. A one-call backward releases every node's saved tensors as it runs
    it, so the nodes kept alive hold nothing. A split backward does not: the input pass runs with the graph
    retained, and a node it ran that the weight pass does not reach (GELU's, between a block's two linears)
    keeps its saved input until the process ends, one per hooked node per micro-batch. The dry run read that as
    activations held to the step's end; a real run without the tracker frees them (benchmarks/reports/
    dryrun-zero-bubble-2026-11-29). Removing a micro-batch's hooks when its backward is over breaks the cycle;
    the hooks have all run by then."""
    from torch.distributed._tools import mod_tracker

    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    handles: dict[tuple[int, int], list] = {}  # (stage index, micro-batch) -> the hooks its forward registered
    forwarding: list[list] = []  # the handles of the micro-batch whose forward is running
    register = mod_tracker.register_multi_grad_hook

    def registered(*args, **kwargs):
        handle = register(*args, **kwargs)
        if forwarding:
            forwarding[-1].append(handle)
        return handle

    def release(stage, chunk: int) -> None:
        for handle in handles.pop((stage.stage_index, chunk), []):
            handle.remove()

    def wrapped(stage):
        forward, backward, weight = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

        def forward_one_chunk(fwd_chunk_id, *args, **kwargs):
            forwarding.append(handles.setdefault((stage.stage_index, fwd_chunk_id), []))
            try:
                return forward(fwd_chunk_id, *args, **kwargs)
            finally:
                forwarding.pop()

        def backward_one_chunk(bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
            out = backward(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)
            if full_backward:
                release(stage, bwd_chunk_id)
            return out

        def backward_weight_one_chunk(bwd_chunk_id, last_backward=False):
            out = weight(bwd_chunk_id, last_backward=last_backward)
            release(stage, bwd_chunk_id)
            return out

        return forward_one_chunk, backward_one_chunk, backward_weight_one_chunk

    names = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
    with contextlib.ExitStack() as patches:  # each restored on exit: the program's own wrappers, or the class's method
        patches.enter_context(mock.patch.object(mod_tracker, "register_multi_grad_hook", registered))
        for stage in stages:  # over the program's own wrappers (``pipeline_parallel``'s split backward), if any
            for name, method in zip(names, wrapped(stage)):
                patches.enter_context(mock.patch.object(stage, name, method))
        yield


def _ddp_on_the_fake_group(model, tracker) -> None:
    """DDP's reducer takes each bucket's all-reduced gradients from the work's future; the fake backend's
    works complete with no value, which the reducer refuses. The same all-reduce (averaged in place, as
    DDP's own hook does) runs through a hook whose future holds the bucket: a no-op on the fake group, and
    the gradients stay in the bucket they are views of (``gradient_as_bucket_view``). The buckets were made
    at construction, outside the tracker, which first sees them written in the backward and would count
    them as temporaries: once the last bucket is ready, every gradient (a view of its bucket) is known to
    the tracker as the gradient it is (``track_external``), so the second step counts the buckets as grads."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return

    def all_reduce(group, bucket):
        buffer = bucket.buffer()
        buffer.div_(dist.get_world_size(group))
        dist.all_reduce(buffer, group=group)
        if bucket.is_last():
            tracker.track_external(model)
        done = torch.futures.Future()
        done.set_result(buffer)
        return done

    model.register_comm_hook(model.process_group, all_reduce)
    model.reducer = _BucketsAsBuilt(model.reducer)


class _BucketsAsBuilt:
    """DDP's reducer keeping the buckets it was built with. After the first backward DDP rebuilds them in
    the order the gradients came, agreeing the order with rank 0 in a broadcast whose tensor it reads:
    on fake tensors there is nothing to read. The buckets hold the same gradients either way (the first
    one capped smaller until the rebuild), so the bytes are the same."""

    def __init__(self, reducer):
        self._reducer = reducer

    def __getattr__(self, name):
        return getattr(self._reducer, name)

    def _rebuild_buckets(self) -> bool:
        return False


@contextmanager
def _one_sequence_per_sample():
    """transformers' causal-mask builder reads the positions' values to find packed sequences
    (``masking_utils.find_packed_sequence_indices``); on fake tensors it cannot, keeps the "packed" mask, and
    materialises a (b, 1, s, s) mask that every layer's attention converts and keeps (Llama-3.1-70B at 8,192
    tokens: 128 MiB a layer). A program's positions are its own ``arange``, one sequence per sample: a real run
    finds no packing, builds no mask and attends with ``is_causal``. The dry run answers as the real run does."""
    import sys

    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or not hasattr(masking, "find_packed_sequence_indices"):
        yield
        return
    with mock.patch.object(masking, "find_packed_sequence_indices", lambda position_ids: None):
        yield


@contextmanager
def _attention_as_on_the_device():
    """``F.scaled_dot_product_attention`` called with dropout set aside while the dry run trains (module doc): the
    CPU then runs its flash kernel, whose saved tensors are CUDA's flash kernel's, where with dropout it would take
    the math path and keep the probabilities. A function mode, so that it sees the call however the model file
    names the function (transformers' ``sdpa_attention_forward``, a module's own ``F.``)."""
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    class AsOnTheDevice(TorchFunctionMode):
        rerun_under_recompute = True  # a recomputed block's attention too (runtime.selective.recompute_contexts)

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention:
                if len(args) > 4:
                    args = (*args[:4], 0.0, *args[5:])
                elif kwargs.get("dropout_p"):
                    kwargs = {**kwargs, "dropout_p": 0.0}
            return func(*args, **kwargs)

    with AsOnTheDevice():
        yield


@contextmanager
def _propagation_apart():
    """DTensor's sharding propagation makes tensors of the global shapes to learn an op's output metadata
    (``_op_schema._rebuild_tensor_from_dtensor_meta``), on the mesh's device: under the dry run's fake mode
    the tracker counted them as the rank's memory (three whole fp32 embeddings in a 70B's optimizer step).
    Here they are made on the meta device, which the tracker counts apart from the rank's (``_parts``
    reads the rank's device only)."""
    import torch
    from torch.distributed.tensor import _op_schema

    def on_meta(arg):
        meta = arg.tensor_meta
        return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device="meta")

    original = _op_schema._rebuild_tensor_from_dtensor_meta
    _op_schema._rebuild_tensor_from_dtensor_meta = on_meta
    try:
        yield
    finally:
        _op_schema._rebuild_tensor_from_dtensor_meta = original


def _train_step(plan: Plan, spec, model_file, model, optimizer, mesh, device, step: int, tracker) -> None:
    """The emitted SPMD loop's body (``passes.lowering.codegen``), one step. The tracker's per-module records are
    cleared before each forward (it takes one forward per module; its peak stays)."""
    import torch

    from autoshard import runtime

    batch = runtime.global_batch(model_file, plan.global_batch, 0, step)
    inputs, targets = runtime.take_samples(batch, mesh, spec.data_axis, device)
    runtime.forward_backward(
        model,
        inputs,
        targets,
        model_file.loss,
        mesh,
        plan.num_microbatches,
        spec.sequence_axis,
        spec.tokens_per_sample,
        plan.precision,
        before_each=tracker.reset_mod_stats,
        loss_parallel=spec.loss_parallel,
    )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    torch.distributed.barrier()


def _pipeline_step(plan: Plan, spec, model_file, stages, schedule, optimizer, mesh, device, step: int) -> None:
    """The emitted pipeline loop's body (``passes.lowering.codegen``), one step: the schedule runs this rank's stages
    over every micro-batch, its sends and receives over the fake group (they move nothing: the received
    buffers, sized from the micro-batch, stay as made, which is all a fake tensor is)."""
    import torch

    from autoshard import runtime
    from autoshard.runtime import pipeline_parallel as pp

    inputs, targets = (), None  # a rank holding neither the first nor the last stage reads nothing
    if stages.reads:
        batch = runtime.global_batch(model_file, plan.global_batch, 0, step)
        inputs, targets = runtime.take_samples(batch, mesh, spec.data_axis, device)
    with runtime.autocast(plan.precision, device):
        pp.pipeline_step(schedule, stages, inputs, targets)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    torch.distributed.barrier()


def _parts(snapshot: dict) -> dict[str, int]:
    """MemTracker's peak snapshot ({device: {reference type: bytes, "Total": bytes}}) by the plan's parts."""
    parts = dict.fromkeys(PARTS, 0)
    for device, by_type in snapshot.items():
        if getattr(device, "type", device) == "meta":  # DTensor's propagation (``_propagation_apart``)
            continue
        for kind, nbytes in by_type.items():
            name = getattr(kind, "value", kind)
            if name in _PART_OF:
                parts[_PART_OF[name]] += int(nbytes)
    return parts


def summary_lines(plan: Plan, results: list[RankMemory]) -> list[str]:
    """A table per rank: each part measured and predicted, and the part that differs most."""
    lines = [f"note: {note}" for note in notes(plan)]
    for result in results:
        lines.append(
            f"rank {result.rank}: peak {_gib(result.peak_bytes)} measured on fake tensors, "
            f"{_gib(result.predicted_peak_bytes)} predicted ({_ratio(result.peak_bytes, result.predicted_peak_bytes)})"
        )
        for part in PARTS:
            measured, predicted = result.parts[part]
            lines.append(
                f"  {part:<12} {_gib(measured):>11} measured  {_gib(predicted):>11} predicted  "
                f"{_ratio(measured, predicted)}"
            )
        lines.append(f"  most off: {result.most_off}")
    return lines


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _ratio(measured: int, predicted: int) -> str:
    if predicted == 0:
        return "(none predicted)" if measured else ""
    return f"{(measured - predicted) / predicted:+.1%}"
