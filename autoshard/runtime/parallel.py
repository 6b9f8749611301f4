"""The applier: executes a plan's apply steps (``ir.steps``, made by ``passes.lowering.lower``) with PyTorch's parts.

One function per step, torchtitan-shaped, each found by its op in ``APPLIERS``; ``apply_steps`` runs
a list of them, and the emitted programs call the same functions in the same order (``passes.lowering.codegen``
prints the steps):

    use_cp_attention  a transformers model's attention switched to one that builds no mask (context parallelism:
                      ``context_parallel.use_cp_attention``); a model calling SDPA itself is left as it is
    apply_tp          DTensor ``parallelize_module`` (styles: ``ir.decisions.TP_STYLES``); before a
                      pipeline split, local shards with traceable collectives (``tensor_parallel_stages``)
    apply_ep          expert parallelism: each rank keeps E/ep experts of each MoE experts module, tokens
                      sent to them with all-to-all (``expert_parallel``); before a split, plain local shards
    split_pipeline    this rank's stages (``pipeline_parallel.build_pipeline_stages``)
    apply_ac          recompute per block: "full" recomputes the block in backward, "selective" keeps
                      matmul/attention outputs and recomputes the rest (op-level SAC); on pipeline
                      stages the block's region of its stage graph (``stage_recompute``)
    apply_float8      the plan's linears made torchao Float8Linear (``float8``), before every wrapper
    apply_async_tp    async TP: symmetric memory for the TP group, inductor's micro-pipeline TP pass (``compiled``)
    apply_compile     torch.compile of each block's forward, its recompute inside (beside cp, and on pipeline
                      stages: outside, eager), hooks outside (``compiled``)
    sync_batch_norm   SyncBatchNorm over dp (GlooSyncBatchNorm on CPUs)
    apply_fsdp        FSDP2 ``fully_shard`` per block then the root (ZeRO-1, 2: reshard_after_forward
                      False, ZeRO-3: True), or per stage module; HSDP; the plan's precision policy
    apply_replicate   FSDP2's replicate: ZeRO-0 where parameters are DTensors or stages (tp or pp)
                      (both leave 0-d parameters, which FSDP2 cannot take, whole on every rank and
                      average their gradients over dp once per step: ``_keep_scalars_whole``)
    init_weights      this rank's shards made on its device, filled with one process's initial weights
                      (every step before it acts on the meta device: ``runtime.init_replay``)
    apply_ddp         DistributedDataParallel (bucketed all-reduce overlapped with backward)
    build_optimizer   AdamW, or a recipe's optimizer (``runtime.recipe``); ZeRO-1: ZeroRedundancyOptimizer
                      over dp; pipelines: one per stage
    build_schedule    torch's GPipe, 1F1B, interleaved 1F1B, interleaved zero bubble, ZBV, DualPipeV
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable.replicate_with_fsdp import replicate  # torch's own; pipelining uses it
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from autoshard.errors import AutoshardError
from autoshard.ir.decisions import LOSS_PARALLEL, precision_policy
from autoshard.ir.steps import RESULTS, RUN_INPUTS, WHOLE_MESH, Step
from autoshard.runtime import checkpoint, init_replay
from autoshard.runtime import expert_parallel as ep_runtime
from autoshard.runtime import model as model_utils
from autoshard.runtime import recipe as training_recipe
from autoshard.runtime.checkpoint import StageOptimizers
from autoshard.runtime.compiled import apply_async_tp, compile_stage_blocks
from autoshard.runtime.compiled import apply_compile as compile_blocks
from autoshard.runtime.context_parallel import use_cp_attention
from autoshard.runtime.expert_parallel import apply_ep
from autoshard.runtime.float8 import apply_float8, compute_float8_scales_after_step
from autoshard.runtime.model import get_block
from autoshard.runtime.recipe import Recipe
from autoshard.runtime.selective import selective_kwargs
from autoshard.runtime.stage_recompute import apply_recompute_to_stage
from autoshard.runtime.tensor_parallel import apply_tensor_parallel
from autoshard.runtime.tensor_parallel_stages import shard_dims, shard_for_tracing

if TYPE_CHECKING:
    from autoshard.runtime import pipeline_parallel as pp

# ``pipeline_parallel`` and ZeroRedundancyOptimizer are imported by the steps that use them: every emitted
# program imports this module, and they bring torch's pipelining (with torch._dynamo) and
# torch.distributed.optim's functional optimizers, seconds of CPU per rank a program may not need.


def _pipeline_parallel():
    from autoshard.runtime import pipeline_parallel

    return pipeline_parallel


def _is_stages(model) -> bool:
    """``model`` is a pipeline's ``PipelineStages`` (there is none before ``pipeline_parallel`` is imported)."""
    module = sys.modules.get("autoshard.runtime.pipeline_parallel")
    return module is not None and isinstance(model, module.PipelineStages)


def apply_steps(model: nn.Module, steps: tuple[Step, ...], mesh: DeviceMesh, **run_inputs: Any) -> dict[str, Any]:
    """Run ``steps`` on ``model`` in order; returns {"model" (or the stages), "optimizer", "schedule"}.

    ``run_inputs`` are the values of the run each op may need (``ir.steps.RUN_INPUTS``: device, recipe,
    example_microbatch, loss_fn). Each op's function is ``APPLIERS[op]``, the function the emitted program
    imports under the op's name."""
    results: dict[str, Any] = {"model": model}
    for step in steps:
        function: Callable = APPLIERS[step.op]
        args = [results["model"]] + (
            [] if step.mesh_dim is None else [mesh if step.mesh_dim == WHOLE_MESH else mesh[step.mesh_dim]]
        )
        inputs = {name: run_inputs[name] for name in RUN_INPUTS.get(step.op, ())}
        results[RESULTS.get(step.op, "model")] = function(*args, **step.kwargs, **inputs)
    return results


def apply_tp(
    model: nn.Module, tp_mesh: DeviceMesh, styles: dict[str, str], before_split: bool = False, float8: str = "off"
) -> nn.Module:
    """Shard the modules named in ``styles`` over ``tp_mesh`` (in place): DTensor styles, or, before a
    pipeline split, each module replaced by its local shard with traceable collectives. ``float8`` tensorwise:
    torchao's float8 styles on the Float8Linear modules (``runtime.tensor_parallel``)."""
    if before_split:
        shard_for_tracing(model, tp_mesh.get_group(), styles)
        return model
    return apply_tensor_parallel(model, tp_mesh, styles, float8=float8 == "tensorwise")


def split_pipeline(
    model: nn.Module,
    mesh: DeviceMesh,
    split_points: tuple[str, ...],
    virtual_stages: int,
    tp_styles: dict[str, str],
    example_microbatch: tuple,
    device: torch.device,
    placement: str = "loop",
    sequence_axis: str | None = None,
    tokens_per_sample: int = 1,
) -> pp.PipelineStages:
    """This rank's stages of ``model`` cut before each of ``split_points`` (mesh dims pp, dp, tp), placed
    "loop" (rank r: r, r + pp, ...) or "v" (rank r: r and 2·pp − 1 − r). With a ``sequence_axis`` (context
    parallelism) the stages are traced on this rank's chunk of the micro-batch's ``tokens_per_sample`` tokens and
    ``pipeline_step`` runs them the same way (``pipeline_parallel.SequenceShard``)."""
    tp = tp_styles and mesh["tp"].size() > 1
    sequence = _pipeline_parallel().SequenceShard(mesh, sequence_axis, tokens_per_sample) if sequence_axis else None
    stages = _pipeline_parallel().build_pipeline_stages(
        model,
        sequence.cut(example_microbatch, None)[0] if sequence else example_microbatch,
        list(split_points),
        mesh.get_local_rank("pp"),
        mesh["pp"].size(),
        virtual_stages,
        device,
        mesh.get_group("pp"),
        tp_shard_dims=shard_dims(model, tp_styles) if tp else None,
        tp_group=mesh.get_group("tp") if tp else None,
        placement=placement,
        sequence=sequence,
        vocabulary_mesh=mesh["tp"] if tp and any(s.startswith(LOSS_PARALLEL) for s in tp_styles.values()) else None,
    )
    init_replay.carry(model, stages, stages.modules)
    return stages


def apply_ac(model, modes: dict[str, str]):
    """Recompute each block in ``modes`` (path -> "selective" | "full"), in place; returns the model.
    On pipeline stages, each stage recomputes the blocks it holds."""
    if _is_stages(model):
        for module in model.modules:
            apply_recompute_to_stage(module, modes)
        return model
    return apply_recompute(model, list(modes), modes)


def apply_compile(model, blocks: tuple[str, ...] | list[str] = (), recompute_outside: bool = False):
    """torch.compile of each block's forward, in place (``runtime.compiled``); returns the model. On pipeline
    stages, each stage compiles the blocks it holds (their recompute, if any, eager around them)."""
    if _is_stages(model):
        for module in model.modules:
            compile_stage_blocks(module, blocks)
        return model
    return compile_blocks(model, blocks, recompute_outside)


def apply_recompute(model: nn.Module, blocks: list[str], mode: str | dict[str, str]) -> nn.Module:
    """Wrap each block in ``checkpoint_wrapper`` (in place); ``mode`` is none, selective or full, or a
    mode per block path."""
    modes = mode if isinstance(mode, dict) else {path: mode for path in blocks}
    for path in blocks:
        if modes.get(path, "none") == "none":
            continue
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        block = get_block(model, path)
        wrapped = checkpoint_wrapper(
            block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **selective_kwargs(modes[path])
        )
        parent.register_module(child, _hoist_input_hooks(block, wrapped))
    return model


def _hoist_input_hooks(block: nn.Module, wrapper: nn.Module) -> nn.Module:
    """``wrapper`` (the block's ``checkpoint_wrapper``), given the block's forward pre-hooks (tensor parallelism's
    input layouts on the block: ``ScatterSequenceInput`` on the first block under sequence parallelism), which
    then run before the checkpoint, not inside it: the checkpoint saves the input as the block computes on it
    (this rank's slice, not the whole sequence), and a recompute wrapper compiled whole (``runtime.compiled``)
    traces the same code for every block, so dynamo compiles one graph for all of them (the first block's
    slicing inside its graph made a second one). torch has no public call to move a hook: each is re-registered on
    the wrapper, with its keyword flag, and removed from the block. Returns ``wrapper``."""
    for handle_id, hook in list(block._forward_pre_hooks.items()):
        wrapper.register_forward_pre_hook(hook, with_kwargs=handle_id in block._forward_pre_hooks_with_kwargs)
        del block._forward_pre_hooks[handle_id]
        block._forward_pre_hooks_with_kwargs.pop(handle_id, None)
    return wrapper


def sync_batch_norm(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """BatchNorm over all dp ranks' samples; the model unchanged without BatchNorm."""
    return model_utils.convert_sync_batch_norm(model, dp_mesh.get_group(), on_cpu=dp_mesh.device_type == "cpu")


def apply_fsdp(
    model,
    dp_mesh: DeviceMesh,
    blocks: tuple[str, ...] | list[str] = (),
    reshard_after_forward: bool = True,
    precision: str = "fp32",
    replicas: int = 1,
    sync_every_microbatch: bool = True,
    ep: int = 1,
    offload: bool = False,
):
    """FSDP2 with each block a unit, then the root (embeddings, head); on pipeline stages, each stage
    module a unit (torchtitan's way; the schedule drives the post-backward reduce-scatter).
    Weights are gathered in the precision's param dtype and gradients reduced in its reduce dtype.
    ``replicas`` > 1 is HSDP: the dp ranks are ``replicas`` x shard (shard inside a node, the mesh
    being laid out with dp's neighbours on one node), FSDP2 shards over the shard dim and all-reduces
    over the other. ``sync_every_microbatch`` False (ZeRO-1) sums gradients whole over a step's
    micro-batches and reduce-scatters them on the last (``grad_sync``). ``ep`` > 1: experts modules
    sharded by ``apply_ep`` are units of their own first, over the dp/ep ranks holding the same experts
    (``expert_parallel.expert_units``); on stages (dp = ep) FSDP leaves them out. 0-d parameters stay
    whole on every rank (``_keep_scalars_whole``). ``offload``: every unit with FSDP2's ``CPUOffloadPolicy``
    (``offload_policy``): its parameter and gradient shards in host memory, copied to the device before each
    all-gather and back after each reduce-scatter, so the optimizer steps them on the CPU."""
    policy = mixed_precision(precision)
    offload_policy = offload_policy_for(dp_mesh) if offload else OffloadPolicy()
    mesh = (
        dp_mesh
        if replicas == 1
        else dp_mesh._unflatten(0, (replicas, dp_mesh.size() // replicas), ("dp_replicate", "dp_shard"))
    )
    units = model.modules if _is_stages(model) else [*_blocks_sharing_nothing(model, blocks), model]
    ignored = _experts_apart(
        model,
        dp_mesh,
        ep,
        lambda unit, unit_mesh: fully_shard(
            unit, mesh=unit_mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy
        ),
    )
    ignored = _keep_scalars_whole(model, dp_mesh, ignored)
    for unit in units:
        fully_shard(
            unit,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=policy,
            offload_policy=offload_policy,
            ignored_params=ignored,
        )
    if not sync_every_microbatch and not _is_stages(model):
        _ACCUMULATING.add(model)
    return model


def offload_policy_for(dp_mesh: DeviceMesh) -> CPUOffloadPolicy:
    """FSDP2's ``CPUOffloadPolicy``, its host shards pinned (page-locked: the copies run asynchronously beside the
    compute) where the mesh is on an accelerator; on CPU ranks (``autoshard verify``) the host is the device, and
    pinning needs an accelerator, so they are not. On GPUs the process group must take CPU tensors too (the
    offloaded gradients' norm, ``runtime.recipe.clip_grad_norm``): one line otherwise."""
    if dp_mesh.device_type != "cpu" and "cpu:" not in dist.get_backend_config():
        raise AutoshardError(
            "host offload on GPUs needs a process group that also runs collectives on CPU tensors (the gradients' "
            "norm is taken on the host): init_process_group('cuda:nccl,cpu:gloo'), as "
            "runtime.init_distributed(host_collectives=True) does"
        )
    return CPUOffloadPolicy(pin_memory=dp_mesh.device_type != "cpu")


def apply_replicate(
    model, dp_mesh: DeviceMesh, blocks: tuple[str, ...] | list[str] = (), precision: str = "fp32", ep: int = 1
):
    """ZeRO-0 with tp, pp or ep: FSDP2's ``replicate`` (DDP's all-reduce on FSDP2's machinery, which takes
    DTensor parameters and is driven by ``torch.distributed.pipelining``'s stages), each block a unit then
    the root, or each stage module; gradients summed over the micro-batches, all-reduced on the last.
    ``ep`` > 1: experts modules are units of their own first, as in ``apply_fsdp``. 0-d parameters stay
    out of FSDP2 (``_keep_scalars_whole``)."""
    policy = mixed_precision(precision)
    ignored = _experts_apart(
        model, dp_mesh, ep, lambda unit, unit_mesh: replicate(unit, mesh=unit_mesh, mp_policy=policy)
    )
    ignored = _keep_scalars_whole(model, dp_mesh, ignored)
    if _is_stages(model):
        for module in model.modules:
            replicate(module, mesh=dp_mesh, mp_policy=policy, ignored_params=ignored)
        return model
    for block in _blocks_sharing_nothing(model, blocks):
        replicate(block, mesh=dp_mesh, mp_policy=policy, ignored_params=ignored)
    replicate(model, mesh=dp_mesh, mp_policy=policy, ignored_params=ignored)
    _ACCUMULATING.add(model)
    return model


def _blocks_sharing_nothing(model, blocks: tuple[str, ...] | list[str]) -> list[nn.Module]:
    """The blocks that hold no parameter another block holds too, each an FSDP2 unit of its own; the others (Zamba's
    one transformer block, a child of every hybrid layer) are left to the root's unit: FSDP2 refuses a parameter in
    two units ("is shared with a parameter already managed by another FSDP group")."""
    modules = [get_block(model, path) for path in blocks]
    owners: dict[int, int] = {}
    for module in modules:
        for param in module.parameters():
            owners[id(param)] = owners.get(id(param), 0) + 1
    return [m for m in modules if all(owners[id(p)] == 1 for p in m.parameters())]


def _experts_apart(model, dp_mesh: DeviceMesh, ep: int, wrap: Callable) -> set[nn.Parameter] | None:
    """Expert shards are synchronised only over the ranks holding the same experts (``expert_parallel``):
    SPMD, ``wrap(module, mesh)`` makes each experts module a unit over those ranks; on pipeline stages
    returns the shards for the dp wrapper to ignore (None without any), their gradients averaged over
    those ranks after the schedule."""
    if _is_stages(model):
        shards = ep_runtime.pipeline_expert_params(model.modules, dp_mesh, ep)
        if shards:  # averaged over their replicas after each schedule step (pipeline_parallel.sync_expert_grads)
            ids = {id(p) for p in shards}  # in module order: the same on every replica, for one flat all-reduce
            ordered = tuple(p for m in model.modules for p in m.parameters() if id(p) in ids)
            model.expert_replicas = (ordered, ep_runtime.expert_replica_group(dp_mesh, ep))
        return shards or None
    for module, unit_mesh in ep_runtime.expert_units(model, dp_mesh, ep):
        wrap(module, unit_mesh)
    return None


def _keep_scalars_whole(model, dp_mesh: DeviceMesh, ignored: set[nn.Parameter] | None) -> set[nn.Parameter] | None:
    """FSDP2 (``fully_shard`` and ``replicate``) refuses 0-d parameters (CLIP's ``logit_scale``): it needs a
    dim to shard. They are left out of it (``ignored``, returned with them added), whole on every dp rank
    as DDP keeps every parameter, and their gradients averaged over ``dp_mesh`` once per step, as FSDP2
    averages the rest: on the last micro-batch's backward (``ScalarGrads``, gated by ``grad_sync``), or on
    pipeline stages after the schedule (``pipeline_parallel.sync_replicated_grads``). The optimizer steps
    them alike on every rank, and checkpoints hold them as the plain tensors they are."""
    modules = model.modules if _is_stages(model) else [model]
    apart = {id(p) for p in ignored or ()}
    scalars = {id(p): p for m in modules for p in m.parameters() if p.dim() == 0 and id(p) not in apart}
    if not scalars:
        return ignored
    ordered = tuple(scalars.values())  # module order: the same on every dp rank
    group = dp_mesh.get_group() if dp_mesh.size() > 1 else None
    if _is_stages(model):
        model.dp_replicated = (ordered, group)
    elif group is not None:
        _SCALAR_GRADS[model] = ScalarGrads(ordered, group)
    return set(ignored or ()) | set(ordered)


class ScalarGrads:
    """Averages the gradients of parameters kept whole beside FSDP2 over the dp group, as each backward
    accumulates them, unless ``grad_sync`` says this micro-batch is not a step's last (``sync`` False):
    summed locally until then, so each step all-reduces them once."""

    def __init__(self, params: tuple[nn.Parameter, ...], group: dist.ProcessGroup):
        self.group, self.sync = group, True
        for param in params:
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._average)

    def _average(self, param: nn.Parameter) -> None:
        if not self.sync or param.grad is None:
            return
        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.group)
        grad /= dist.get_world_size(self.group)


# FSDP2-wrapped models -> their whole 0-d parameters' gradient averaging (``_keep_scalars_whole``); weak.
_SCALAR_GRADS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# FSDP2 roots whose gradients are summed whole until a step's last micro-batch (ZeRO-0 ``replicate`` and
# ZeRO-1); weak, so a model's lifetime is its own.
_ACCUMULATING: weakref.WeakSet = weakref.WeakSet()


def init_weights(model, mesh: DeviceMesh, device: torch.device):
    """Make this rank's shards on ``device`` and fill them with the weights one process builds from the same
    seed (``runtime.init_replay``: the model file's initialisation recorded on the meta device and replayed,
    each rank copying out only the parts it holds); returns the model. A model that is not on the meta device
    (built whole, as the Python API's caller builds it) is left as it is."""
    if not init_replay.is_pending(model):
        return model
    modules = model.modules if _is_stages(model) else [model]
    valued = init_replay.valued_state(modules, model_utils.strip_wrapper_names)  # a split's constants keep theirs
    for module in modules:
        init_replay.to_empty(module, device)
    if init_replay.on_fake_tensors(modules):  # a setup run on fake tensors (no values to fill): nothing to read
        init_replay.forget(model)
        return model
    state, restore = checkpoint.model_state(model, mesh)
    init_replay.materialize(model, modules, state, restore, model_utils.strip_wrapper_names, valued)
    return model


def apply_ddp(
    model: nn.Module,
    dp_mesh: DeviceMesh | None = None,
    bucket_cap_mb: float = 25.0,
    device: torch.device | None = None,
    unread: tuple[str, ...] = (),
) -> nn.Module:
    """DDP over ``dp_mesh``; ``unread``: modules (or parameter names) whose parameters the forward never reads
    (``ir.graph.unread_params``), left out of DDP's buckets, whose reducer would otherwise wait for their
    gradients and stop the next step ("Expected to have finished reduction in the prior iteration"): untouched, as
    one process leaves them, and never sent."""
    ep_runtime.refuse_expert_shards(model, "DDP")  # it would average different experts; apply_replicate does not
    if unread:
        DDP._set_params_and_buffers_to_ignore_for_model(model, _parameters_under(model, unread))
    device_ids = [device.index] if device is not None and device.type == "cuda" else None
    # DDP's construction checks every rank's parameter shapes and broadcasts rank 0's values (``init_sync``):
    # fake tensors (a setup run for its memory only, ``autoshard.dryrun``) have no values to check or send
    init_sync = not init_replay.on_fake_tensors([model])
    return DDP(
        model,
        device_ids=device_ids,
        bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=True,
        process_group=dp_mesh.get_group() if dp_mesh is not None else None,
        init_sync=init_sync,
    )


def _parameters_under(model: nn.Module, paths: tuple[str, ...]) -> list[str]:
    """The names of ``model``'s parameters that are ``paths`` or lie under one of them."""
    return [name for name, _ in model.named_parameters() if any(name == p or name.startswith(p + ".") for p in paths)]


def build_optimizer(
    model,
    dp_mesh: DeviceMesh | None = None,
    zero_stage: int = 0,
    lr: float = 1e-3,
    recipe: Recipe | None = None,
    float8_scales: bool = False,
):
    """AdamW at ``lr`` with torch's settings (``recipe`` None: what programs without a recipe train with), or
    ``recipe``'s optimizer, settings and weight-decay groups at its own lr, fused on CUDA (``runtime.recipe``).
    ZeRO-1 over DDP shards its state with ZeroRedundancyOptimizer (FSDP2 shards it for ZeRO-1 with tp or pp, and
    for 2 and 3); pipeline stages get one optimizer each (``checkpoint.StageOptimizers``). ``float8_scales``: the
    float8 weights' scales computed after each step, for FSDP2's float8 all-gather (``float8``)."""
    optimizer = _build_optimizer(model, dp_mesh, zero_stage, lr, recipe)
    return compute_float8_scales_after_step(optimizer, model) if float8_scales else optimizer


def _build_optimizer(model, dp_mesh: DeviceMesh | None, zero_stage: int, lr: float, recipe: Recipe | None):
    zero_redundancy = zero_stage == 1 and isinstance(model, DDP) and dp_mesh is not None and dp_mesh.size() > 1
    if recipe is None:
        if _is_stages(model):
            return StageOptimizers(model.modules, torch.optim.AdamW, lr=lr)
        if zero_redundancy:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=torch.optim.AdamW, lr=lr, process_group=dp_mesh.get_group()
            )
        return torch.optim.AdamW(model.parameters(), lr=lr)
    device_type = _device_type(model)
    if zero_redundancy:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(
            training_recipe.recipe_params(model, recipe),
            optimizer_class=training_recipe.OPTIMIZERS[recipe.optimizer],
            process_group=dp_mesh.get_group(),
            **recipe.optimizer_kwargs(),
            **training_recipe.optimizer_kernel(recipe.optimizer, model.parameters(), device_type),
        )
    return training_recipe.build_optimizer(model, recipe, device_type)


def _device_type(model) -> str:
    """The device type of the model's (or its stages') parameters: "cpu" without any."""
    modules = model.modules if _is_stages(model) else [model]
    param = next((p for m in modules for p in m.parameters()), None)
    return "cpu" if param is None else param.device.type


def build_schedule(stages: pp.PipelineStages, schedule: str, num_microbatches: int, loss_fn: Callable):
    return _pipeline_parallel().make_torch_schedule(stages, num_microbatches, loss_fn, schedule)


# Each apply step's function, by its op (``ir.steps.OPS``; tests/test_golden_programs.py checks the two agree).
def cast_params(model: nn.Module, precision: str) -> nn.Module:
    """The model's floating parameters and buffers cast to the precision's cast dtype (``--precision bf16-pure``
    on fp32 parameters), in place, first of all steps: on the meta device, so ``init_weights`` then rounds each
    shard of one process's fp32 initial weights to it; returns the model."""
    dtype = precision_policy(precision).cast_dtype
    return model.to(getattr(torch, dtype)) if dtype is not None else model


APPLIERS: dict[str, Callable] = {
    "apply_float8": apply_float8,
    "cast_params": cast_params,
    "use_cp_attention": use_cp_attention,
    "apply_tp": apply_tp,
    "apply_ep": apply_ep,
    "split_pipeline": split_pipeline,
    "apply_ac": apply_ac,
    "apply_async_tp": apply_async_tp,
    "apply_compile": apply_compile,
    "sync_batch_norm": sync_batch_norm,
    "apply_fsdp": apply_fsdp,
    "apply_replicate": apply_replicate,
    "init_weights": init_weights,
    "apply_ddp": apply_ddp,
    "build_optimizer": build_optimizer,
    "build_schedule": build_schedule,
}


def grad_sync(model: nn.Module, enabled: bool):
    """Gradient synchronisation on this micro-batch or not (the last one: ``enabled``). DDP skips its
    all-reduce on the others (``no_sync``); FSDP2 under ZeRO-0 (``replicate``) and ZeRO-1 keeps weights
    gathered and gradients whole until the last (``set_requires_gradient_sync``,
    ``set_reshard_after_backward``); ZeRO-2/3 reduce-scatter every micro-batch so gradients stay sharded.
    0-d parameters kept whole beside FSDP2 (``ScalarGrads``) average theirs on the last only, in every stage."""
    if isinstance(model, DDP) and not enabled:
        return model.no_sync()
    scalars = _SCALAR_GRADS.get(model)
    if scalars is not None:
        return _scalar_sync(model, scalars, enabled)
    if model in _ACCUMULATING:
        return _fsdp_sync(model, enabled)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _scalar_sync(model, scalars: ScalarGrads, enabled: bool):
    """The 0-d parameters kept whole beside FSDP2 average their gradients on a step's last micro-batch only."""
    scalars.sync = enabled
    try:
        with _fsdp_sync(model, enabled) if model in _ACCUMULATING else contextlib.nullcontext():
            yield
    finally:
        scalars.sync = True


@contextlib.contextmanager
def _fsdp_sync(model: FSDPModule, enabled: bool):
    model.set_requires_gradient_sync(enabled)
    model.set_reshard_after_backward(enabled)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)


def autocast(precision: str, device: torch.device):
    """The forward's autocast under the plan's precision (``ir.decisions.PRECISIONS``); none in fp32."""
    dtype = precision_policy(precision).autocast_dtype
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, dtype))


def cast_inputs(inputs: tuple, precision: str) -> tuple:
    """A micro-batch's floating inputs in the precision's cast dtype (bf16-pure: the weights are bf16, so is what
    they multiply); the inputs as they are otherwise."""
    dtype = precision_policy(precision).cast_dtype
    if dtype is None:
        return inputs
    return tuple(t.to(getattr(torch, dtype)) if torch.is_tensor(t) and t.is_floating_point() else t for t in inputs)


def grad_scaler(precision: str, model, device: torch.device):
    """The loss scaler of an fp16 plan (``PrecisionPolicy.grad_scaler``): torch's ``GradScaler``, or FSDP2's
    ``ShardedGradScaler`` where gradients are DTensors (FSDP2, TP), which agrees on an inf gradient over every rank;
    a torch without it is refused in one line. Every other precision gets a disabled ``GradScaler``, which passes
    the loss through and steps the optimizer as it is, so one loop serves every precision."""
    if not precision_policy(precision).grad_scaler:
        return torch.amp.GradScaler(device.type, enabled=False)
    if any(isinstance(p, DTensor) for p in model.parameters()):
        try:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        except ImportError as exc:
            raise AutoshardError(
                f"precision {precision} with sharded (DTensor) parameters needs "
                f"torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler, which torch "
                f"{torch.__version__} lacks; plan with --precision bf16 or --zero 0 --tp 1"
            ) from exc
        return ShardedGradScaler(device=device.type)
    return torch.amp.GradScaler(device.type)


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """FSDP2's policy for the plan's precision."""
    policy = precision_policy(precision)
    return MixedPrecisionPolicy(
        param_dtype=getattr(torch, policy.param_dtype) if policy.param_dtype else None,
        reduce_dtype=getattr(torch, policy.reduce_dtype) if policy.reduce_dtype else None,
    )
