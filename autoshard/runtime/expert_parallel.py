"""Expert parallelism (EP) for transformers' mixture-of-experts layers: each rank keeps E/ep experts.

Layout. The ep ranks are borrowed from the data-parallel ranks (torchtitan's way): the dp ranks are
laid out as (dp/ep) x ep, ep innermost, so an ep group is ep adjacent dp ranks (``expert_meshes``).
Every rank still trains on its own samples; only the experts are split. Expert rank r of ep keeps
experts r·L .. (r+1)·L − 1, L = E/ep, of every parameter of an experts module (transformers'
``use_experts_implementation`` classes: ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I],
biases [E, ...]); the router and shared experts stay dense (data parallel).

Forward of one experts module, T tokens, top-k routing, S = T·k (token, slot) pairs (``expert_ffn``)::

    sort the S pairs by expert id                       order, counts c[e] (this rank's pairs per expert)
    all_to_all_single(c)                                c_in[p, l]: rank p's pairs for my expert l
    all_to_all_single(x[order // k])  (uneven splits)   the R = Σ c_in tokens my experts run
    y_l = expert_l(x)  (the module's own forward, on the local parameters, top_k_index = l, weight 1)
    all_to_all_single(y) back, un-sort                  y[(t, j)] = expert_{index[t, j]}(x_t)   [S, H]

and the module's output is out[t] = Σ_j w[t, j] · y[(t, j)], in plain autograd (the router's
gradient), with transformers' own order of operations (``(y.view(T, k, H) * w[..., None]).sum(1)``).
Backward recomputes the routing and the expert forward (nothing of the dispatch is stored), sends
∂ℓ/∂y to the experts' ranks, takes the local gradients and sends the tokens' gradients back.

Gradient scale. Each rank's loss ℓ_d is a mean over its own samples, and one process's gradient is
g = (1/dp) Σ_d ∇ℓ_d. An expert shard's gradient sums the contributions of the tokens all ep ranks
sent it, Σ_{d ∈ ep group} ∇ℓ_d; the data-parallel wrapper then averages it over the dp/ep replicas
of that shard (the ranks with the same ep rank). With the op's scale s = 1/ep::

    s · (1/(dp/ep)) · Σ_{replicas} Σ_{d ∈ ep group} ∇ℓ_d = (1/ep)·(ep/dp) Σ_d ∇ℓ_d = g

So experts must be synchronised only over the dp/ep ranks holding the same shard: ``apply_fsdp`` /
``apply_replicate`` make each experts module its own FSDP2 unit on the "dp_mod_ep" mesh dimension.

Two representations of a shard:
    SPMD            a DTensor, Shard(0) over the "ep" mesh dimension: FSDP2 shards it further over
                    "dp_mod_ep" (its EP path), and ``get_model_state_dict`` / DCP see the full [E, ...]
    before a split  plain local tensors (``torch.export`` traces the patched forward for the pipeline
                    split; a DTensor would not trace): DCP state dicts (checkpoints, final weights)
                    see them as the DTensor of all E experts, Shard(0) over their ep group
                    (``checkpoint._expert_as_global``)
"""

from __future__ import annotations

import copy
import itertools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._C._distributed_c10d import _resolve_process_group
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from autoshard.errors import AutoshardError

EP_DIMS = ("dp_mod_ep", "ep")  # the dp mesh unflattened: replicas of a shard x ep (innermost)


@dataclass(frozen=True)
class ExpertShard:
    """What ``shard_experts`` did to one experts module."""

    ep: int  # ranks sharing the module's experts
    num_experts: int  # E, before sharding
    group: dist.ProcessGroup  # the ep group
    names: tuple[str, ...]  # the sharded parameters, dim 0 = expert

    @property
    def num_local(self) -> int:
        return self.num_experts // self.ep


# Modules holding expert shards; weak, so a model's lifetime is its own. A plain (before-split) shard
# carries its ExpertShard as an attribute: the pipeline's stages share the parameter objects, and a
# weak dictionary keyed by tensors would compare them with the elementwise ``==``.
_SHARDED_MODULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SHARD_ATTR = "_autoshard_expert_shard"


@dataclass(frozen=True)
class _Experts:
    """What ``expert_ffn`` runs for one module: its class's forward on a parameter-less copy of it."""

    forward: Callable
    template: nn.Module
    names: tuple[str, ...]


# key (an op argument) -> the module's code; strong: the traced stages call the op after the model is gone
_REGISTRY: dict[str, _Experts] = {}
_KEYS = itertools.count()


# ---------------------------------------------------------------------------- meshes


_MESHES: dict[tuple[DeviceMesh, int, dist.ProcessGroup], DeviceMesh] = {}


def expert_meshes(dp_mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """The dp mesh as ("dp_mod_ep", "ep"), ep innermost: ``mesh["ep"]`` shares experts, ``mesh["dp_mod_ep"]``
    holds the replicas of one shard. Made once per (dp mesh, ep) in a process group world: every caller gets
    the same groups, so FSDP2 sees the two dimensions as parts of one mesh. A mesh equals another of the same
    layout whichever rank made it, so the key holds the world too: a process that runs several worlds in
    turn (``autoshard dryrun``'s ranks) gets each world's own groups."""
    if ep < 1 or dp_mesh.size() % ep:
        raise AutoshardError(f"expert parallelism ep={ep} must divide the data-parallel degree {dp_mesh.size()}")
    key = (dp_mesh, ep, dist.group.WORLD)
    if key not in _MESHES:
        _MESHES[key] = dp_mesh._unflatten(0, (dp_mesh.size() // ep, ep), EP_DIMS)
    return _MESHES[key]


# ---------------------------------------------------------------------------- sharding


def find_experts(model: nn.Module) -> list[str]:
    """Paths of the experts modules: an integer ``num_experts`` = E and own parameters all [E, ...], one at
    least 3-D (the router's [E, H] weight alone is not an experts module)."""
    found = []
    for path, module in model.named_modules():
        total, params = getattr(module, "num_experts", None), list(module.parameters(recurse=False))
        if (
            isinstance(total, int)
            and params
            and len(params) == len(list(module.parameters()))
            and all(p.dim() >= 1 and p.shape[0] == total for p in params)
            and any(p.dim() >= 3 for p in params)
        ):
            found.append(path)
    return found


def apply_ep(
    model: nn.Module, dp_mesh: DeviceMesh, experts: Sequence[str], ep: int, before_split: bool = False
) -> nn.Module:
    """The apply step: shard ``experts`` over the "ep" dimension of ``expert_meshes(dp_mesh, ep)``."""
    return shard_experts(model, expert_meshes(dp_mesh, ep)["ep"], experts, before_split)


def shard_experts(
    model: nn.Module, ep_mesh: DeviceMesh, experts: Sequence[str], before_split: bool = False
) -> nn.Module:
    """Keep this rank's E/ep experts of each module in ``experts`` (paths), in place; returns the model.

    Each keeps rank r's slice [r·L, (r+1)·L) of every parameter (dim 0 = expert), as a DTensor Shard(0)
    over ``ep_mesh`` (1-D), or, ``before_split`` (a pipeline split follows), as a plain local tensor;
    its ``num_experts`` becomes L and its forward dispatches tokens to the experts' ranks (module doc)."""
    for path in experts:
        _shard_module(model.get_submodule(path), path, ep_mesh, before_split)
    return model


def _shard_module(module: nn.Module, path: str, ep_mesh: DeviceMesh, before_split: bool) -> None:
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    shard = ExpertShard(ep, _num_experts(module, path, ep), ep_mesh.get_group(), _expert_names(module, path))
    module.num_experts = shard.num_local  # the local expert ids 0 .. L − 1 the op hands the forward
    key = f"{path}#{next(_KEYS)}"
    _REGISTRY[key] = _Experts(type(module).forward, _template(module), shard.names)
    for name in shard.names:
        local = getattr(module, name).detach()[rank * shard.num_local : (rank + 1) * shard.num_local].clone()
        if not before_split:
            local = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
        param = nn.Parameter(local)
        setattr(module, name, param)
        if before_split:
            setattr(param, _SHARD_ATTR, shard)
    module.forward = _dispatching_forward(module, key, shard)
    _SHARDED_MODULES[module] = shard


def _num_experts(module: nn.Module, path: str, ep: int) -> int:
    total = getattr(module, "num_experts", None)
    if not isinstance(total, int):
        raise AutoshardError(
            f"{path} has no integer num_experts: it is not a transformers experts module; "
            f"name the module holding the [experts, ...] weights"
        )
    if module in _SHARDED_MODULES:
        raise AutoshardError(f"{path} is already expert-parallel; shard each experts module once")
    if total % ep:
        raise AutoshardError(f"{path} has {total} experts, which ep={ep} does not divide; choose ep dividing {total}")
    return total


def _expert_names(module: nn.Module, path: str) -> tuple[str, ...]:
    """The module's own parameters, each [E, ...]; refused when any parameter is something else (it would
    need a gradient the op does not give)."""
    names = tuple(name for name, _ in module.named_parameters(recurse=False))
    others = [
        f"{name} {tuple(p.shape)}"
        for name, p in module.named_parameters()
        if "." in name or p.dim() == 0 or p.shape[0] != module.num_experts
    ]
    if others or not names:
        raise AutoshardError(
            f"{path}: expert parallelism shards modules whose parameters are all [experts, ...]; "
            f"it also holds {', '.join(others) or 'no parameters'}"
        )
    return names


def _template(module: nn.Module) -> nn.Module:
    """A shallow copy without parameters: the attributes the module's forward reads (config, act_fn, ...)."""
    template = copy.copy(module)
    template._parameters = {}
    return template


def _dispatching_forward(module: nn.Module, key: str, shard: ExpertShard) -> Callable:
    """The module's forward with its experts on their ranks (module doc); the routing weights are applied
    here, in autograd, as transformers does."""
    group_name, grad_scale = shard.group.group_name, 1.0 / shard.ep

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        num_tokens, top_k = top_k_index.shape
        params = [_local(getattr(module, name)) for name in shard.names]
        expert_out = torch.ops.autoshard.expert_ffn(hidden_states, top_k_index, params, key, group_name, grad_scale)
        weighted = expert_out.view(num_tokens, top_k, -1) * top_k_weights.unsqueeze(-1)
        return weighted.sum(dim=1).to(hidden_states.dtype)

    return forward


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


# ---------------------------------------------------------------------------- what the dp wrappers ask


def sharded_experts(model: nn.Module) -> dict[nn.Module, ExpertShard]:
    """The experts modules of ``model`` that ``shard_experts`` sharded."""
    return {module: _SHARDED_MODULES[module] for module in model.modules() if module in _SHARDED_MODULES}


def expert_params(module: nn.Module) -> set[nn.Parameter]:
    """The plain expert shards (sharded before a pipeline split) among ``module``'s parameters."""
    return {param for param in module.parameters() if hasattr(param, _SHARD_ATTR)}


def expert_ep(model: nn.Module | Sequence[nn.Module]) -> int:
    """The ep of the expert shards in ``model`` (modules, or a pipeline's stage modules); 1 without any."""
    modules = [model] if isinstance(model, nn.Module) else list(model)
    shards = {s.ep for m in modules for s in sharded_experts(m).values()}
    shards |= {getattr(p, _SHARD_ATTR).ep for m in modules for p in expert_params(m)}
    assert len(shards) <= 1, f"expert shards over several ep sizes: {sorted(shards)}"
    return shards.pop() if shards else 1


def expert_units(model: nn.Module, dp_mesh: DeviceMesh, ep: int) -> list[tuple[nn.Module, DeviceMesh]]:
    """SPMD: each experts module with the mesh its dp wrapper must use, the replicas of its shard
    ("dp_mod_ep" of ``expert_meshes``; size 1 when dp = ep); [] without expert parallelism."""
    _check_ep(ep, expert_ep(model), dp_mesh)
    units = list(sharded_experts(model))
    return [(module, expert_meshes(dp_mesh, ep)["dp_mod_ep"]) for module in units]


def pipeline_expert_params(modules: Sequence[nn.Module], dp_mesh: DeviceMesh, ep: int) -> set[nn.Parameter]:
    """Pipeline stages: the plain expert shards, which the dp wrapper must leave alone (``ignored_params``);
    ``pipeline_parallel.sync_expert_grads`` averages them over the dp / ep ranks holding the same ones
    (``expert_replica_group``)."""
    _check_ep(ep, expert_ep(modules), dp_mesh)
    return set().union(*(expert_params(module) for module in modules))


def expert_replica_group(dp_mesh: DeviceMesh, ep: int) -> dist.ProcessGroup | None:
    """The group of the dp / ep ranks holding the same experts ("dp_mod_ep"); None when ep = 1."""
    return expert_meshes(dp_mesh, ep).get_group("dp_mod_ep") if ep > 1 else None


def refuse_expert_shards(model: nn.Module, wrapper: str) -> None:
    """For dp wrappers that synchronise every parameter over all dp ranks."""
    ep = expert_ep(model)
    if ep > 1:
        raise AutoshardError(
            f"{wrapper} would average the different experts the ranks hold (ep={ep}); "
            f"wrap with apply_fsdp or apply_replicate and ep={ep}"
        )


def _check_ep(ep: int, sharded_ep: int, dp_mesh: DeviceMesh) -> None:
    """The dp wrapper's ep must be the model's: with experts sharded, a wrapper over all dp ranks would
    average different experts together."""
    if ep != sharded_ep:
        raise AutoshardError(
            f"the model's experts are sharded over ep={sharded_ep}, but the data-parallel "
            f"wrapper was given ep={ep}; pass ep={sharded_ep}"
        )
    if dp_mesh.size() % ep:
        raise AutoshardError(f"expert parallelism ep={ep} must divide the data-parallel degree {dp_mesh.size()}")


def expert_shard_of(param: torch.Tensor) -> ExpertShard | None:
    """The ``ExpertShard`` a plain expert shard belongs to; None for any other tensor."""
    return getattr(param, _SHARD_ATTR, None)


# ---------------------------------------------------------------------------- the dispatch op


@dataclass(frozen=True)
class _Route:
    """Where this rank's S (token, slot) pairs go, and what it receives (``_route``)."""

    order: torch.Tensor  # [S]: the pairs sorted by expert (stable)
    token: torch.Tensor  # [S]: each sorted pair's token, order // k
    send_splits: list[int]  # pairs to each ep rank
    recv_splits: list[int]  # pairs from each ep rank
    local_ids: torch.Tensor  # [R]: the local expert of each received pair


def _route(top_k_index: torch.Tensor, num_local: int, group: dist.ProcessGroup) -> _Route:
    """Expert e lives on ep rank e // L; the per-expert counts are exchanged (one even all-to-all), so
    each rank knows the uneven splits of the token exchange and which local expert each token wants."""
    ep = dist.get_world_size(group)
    expert_ids = top_k_index.reshape(-1)
    order = torch.argsort(expert_ids, stable=True)
    if is_fake(expert_ids):
        return _balanced_route(order, top_k_index.shape[-1], num_local, ep, dist.get_rank(group))
    counts = torch.bincount(expert_ids, minlength=num_local * ep)
    counts_in = torch.empty_like(counts)
    dist.all_to_all_single(counts_in, counts, group=group)
    local_ids = torch.arange(num_local, device=counts.device).repeat(ep).repeat_interleave(counts_in)
    return _Route(
        order,
        order // top_k_index.shape[-1],
        counts.view(ep, num_local).sum(1).tolist(),
        counts_in.view(ep, num_local).sum(1).tolist(),
        local_ids,
    )


def _balanced_route(order: torch.Tensor, k: int, num_local: int, ep: int, rank: int) -> _Route:
    """The route on fake tensors (a run for its memory, ``autoshard.dryrun``), whose routing has no values to
    count: the balanced split, every rank sending an equal share of its S pairs to each ep rank (the first
    S mod ep one more) and receiving as much from each, spread evenly over its local experts. That is the
    mean load; the cost model prices the time of the most loaded rank (``cost.moe``), whose buffers hold more."""
    pairs = order.numel()
    send = [pairs // ep + (r < pairs % ep) for r in range(ep)]
    received = send[rank] * ep
    local_ids = torch.arange(received, device=order.device) * num_local // max(received, 1)
    return _Route(order, order // k, send, [send[rank]] * ep, local_ids)


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """all_to_all_single with uneven splits along dim 0."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)
    return out


def _run_experts(key: str, params: list[torch.Tensor], tokens: torch.Tensor, local_ids: torch.Tensor):
    """The module's own forward (e.g. transformers' grouped_mm) on ``tokens``, each to its local expert with
    weight 1, reading ``params`` in place of its parameters."""
    experts = _REGISTRY[key]
    module = copy.copy(experts.template)
    module.__dict__.update(zip(experts.names, params))
    ones = torch.ones(tokens.shape[0], 1, dtype=tokens.dtype, device=tokens.device)
    return experts.forward(module, tokens, local_ids.unsqueeze(1), ones)


def _dispatch(hidden, top_k_index, params, group_name):
    group = _resolve_process_group(group_name)
    route = _route(top_k_index, params[0].shape[0], group)
    received = _exchange(hidden[route.token], route.recv_splits, route.send_splits, group)
    return route, received, group


@torch.library.custom_op("autoshard::expert_ffn", mutates_args=())
def expert_ffn(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    params: list[torch.Tensor],
    key: str,
    group_name: str,
    grad_scale: float,
) -> torch.Tensor:
    """y[(t, j)] = expert_{top_k_index[t, j]}(hidden[t]), [T·k, H], the experts spread over the ep group."""
    route, received, group = _dispatch(hidden, top_k_index, params, group_name)
    out = _run_experts(key, params, received, route.local_ids) if received.shape[0] else received
    back = _exchange(out.to(hidden.dtype), route.send_splits, route.recv_splits, group)
    result = torch.empty_like(back)
    result[route.order] = back
    return result


@expert_ffn.register_fake
def _(hidden, top_k_index, params, key, group_name, grad_scale):
    return hidden.new_empty((top_k_index.numel(), hidden.shape[-1]))


def _setup_context(ctx, inputs, output):
    hidden, top_k_index, params, ctx.key, ctx.group_name, ctx.grad_scale = inputs
    ctx.save_for_backward(hidden, top_k_index, *params)
    device = hidden.device.type  # the forward's autocast, for the recompute (as torch.utils.checkpoint does)
    ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))


def _backward(ctx, grad_out):
    """The dispatch again, ∂ℓ/∂y to the experts' ranks, the local expert forward again under autograd,
    the tokens' gradients back and summed per token; the local parameters' gradients times grad_scale."""
    hidden, top_k_index, *params = ctx.saved_tensors
    route, received, group = _dispatch(hidden, top_k_index, params, ctx.group_name)
    grad_received = _exchange(grad_out[route.order], route.recv_splits, route.send_splits, group)
    device, dtype, enabled = ctx.autocast
    with torch.autocast(device, dtype=dtype, enabled=enabled):
        grad_tokens, grad_params = _expert_grads(ctx.key, params, received, route.local_ids, grad_received)
    grad_sorted = _exchange(grad_tokens, route.send_splits, route.recv_splits, group)
    grad_hidden = torch.zeros_like(hidden).index_add_(0, route.token, grad_sorted.to(hidden.dtype))
    return grad_hidden, None, [g * ctx.grad_scale for g in grad_params], None, None, None


def _expert_grads(key, params, received, local_ids, grad_received):
    if not received.shape[0]:  # no token came to this rank's experts
        return torch.zeros_like(received), [torch.zeros_like(p) for p in params]
    with torch.enable_grad():
        tokens = received.detach().requires_grad_()
        leaves = [p.detach().requires_grad_() for p in params]
        out = _run_experts(key, leaves, tokens, local_ids)
        grads = torch.autograd.grad(out, [tokens, *leaves], grad_received.to(out.dtype), allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, [tokens, *leaves])]
    return grads[0], grads[1:]


expert_ffn.register_autograd(_backward, setup_context=_setup_context)
