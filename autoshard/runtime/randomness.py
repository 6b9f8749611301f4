"""Random ops at a value every rank and the one-process reference share: what ``autoshard verify`` runs.

Each rank of a parallel program draws its own random numbers (its own dropout masks, its own
stochastic-depth coins, its own ``torch.rand`` masks and noise), so no parallel program can agree
with one process while the model is random, and a comparison of the two would judge real
differences against a noise inflated by the randomness itself. ``verify`` therefore runs both sides
with every random op fixed at one value, found by op, not by module or attribute names:

* every aten op torch tags ``nondeterministic_seeded`` (``bernoulli``, ``rand``, ``randn``, ``randint``,
  ``uniform_``, ``normal_``, ``randperm``, ``multinomial``, ...) and ``random_``, which torch leaves
  untagged, is seen where it is dispatched (``ExpectedRandomness``, a ``TorchDispatchMode``: below
  autograd, inside every function that calls it, in traced pipeline stages and on DTensors alike) and
  returns its **expectation**: ``bernoulli(p)`` → p, ``rand`` → 0.5, ``uniform_(a, b)`` → (a + b) / 2,
  ``randn`` / ``normal_(μ, σ)`` → μ, ``exponential_(λ)`` → 1/λ, ``cauchy_`` → its median,
  ``log_normal_(μ, σ)`` → exp(μ + σ²/2), ``poisson(r)`` → r, ``binomial(n, p)`` → n·p, ``_standard_gamma(α)`` → α,
  ``_sample_dirichlet(α)`` → α / Σα; where the result
  must be an integer, its nearest integer (``randint(a, b)`` → ⌊(a + b − 1)/2⌋, a bool ``bernoulli`` →
  p ≥ 1/2, ``geometric_(p)`` → round(1/p)); where it is an order, a fixed one (``randperm(n)`` → 0..n−1,
  ``multinomial`` → the most likely classes). Autograd is above this mode and sees the value as any
  other input: dropout on CPU (``bernoulli_(1 − p)``, ``div_``, ``mul``) becomes x·(1−p)/(1−p) = x, with
  the identity's gradient.
* ops whose randomness lives inside a kernel that autograd differentiates with its own saved state
  (``native_dropout``, a fused attention kernel's ``dropout_p``, ``rrelu_with_noise`` while training, a
  cuDNN RNN's dropout) cannot be given a value below autograd: their backward would still scale by
  1/(1−p). They are fixed above autograd instead (``FixedFunctions``, a ``TorchFunctionMode``: dropout
  calls return their input, ``scaled_dot_product_attention`` runs with ``dropout_p=0``, ``rrelu`` is the
  leaky ReLU of its mean slope, as in evaluation); one that still reaches the kernel with its
  randomness on raises ``RandomOpNotFixed`` naming it.

Both modes stay on for the rest of the process (``fix_randomness``): the process exists to run this
model. The data every rank draws from ``example_batch`` under a seed per step, and the pipeline split's
trace, run with the modes paused (``drawing_freely``).
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autoshard.errors import AutoshardError
from autoshard.ir.names import RANDOM_OPS, RANDOM_SWITCHES

# Each random op of ``ir.names.RANDOM_OPS`` by its op name (in-place forms folded): a value, an order, or a switch.
EXPECTED = {  # op -> the expectation of its result, from its arguments by schema name (module doc)
    "bernoulli": lambda a: a.get("p", a["self"]),
    "uniform": lambda a: (a.get("from", 0.0) + a.get("to", 1.0)) / 2,
    "rand": lambda a: 0.5,
    "rand_like": lambda a: 0.5,
    "normal": lambda a: a.get("mean", 0.0),
    "normal_functional": lambda a: a.get("mean", 0.0),
    "randn": lambda a: 0.0,
    "randn_like": lambda a: 0.0,
    "randint": lambda a: (a.get("low", 0) + a["high"] - 1) // 2,
    "randint_like": lambda a: (a.get("low", 0) + a["high"] - 1) // 2,
    "random": lambda a: (a.get("from", 0) + a["to"] - 1) // 2 if "to" in a else _unbounded(),
    "exponential": lambda a: 1.0 / a.get("lambd", 1.0),
    "geometric": lambda a: round(1.0 / a["p"]),
    "cauchy": lambda a: a.get("median", 0.0),
    "log_normal": lambda a: math.exp(a.get("mean", 1.0) + a.get("std", 2.0) ** 2 / 2),
    "poisson": lambda a: a["self"],
    "binomial": lambda a: a["count"] * a["prob"],
    "_standard_gamma": lambda a: a["self"],
    "_sample_dirichlet": lambda a: a["self"] / a["self"].sum(-1, keepdim=True),
}
ORDERS = {  # op -> a fixed result where the op returns indices
    "randperm": lambda a, out: torch.arange(out.numel(), dtype=out.dtype, device=out.device),
    "multinomial": lambda a, out: _most_likely(a["self"], out.shape[-1], a.get("replacement", False)),
}


class RandomOpNotFixed(AutoshardError):
    """A random op verify cannot give a shared value (module doc)."""


def base_name(packet: str) -> str:
    """An overload packet's op name, in-place form folded ("bernoulli_" -> "bernoulli"), as ``ir.names.op_name``."""
    return packet[:-1] if packet.endswith("_") and not packet.endswith("__") else packet


def fixable(name: str) -> bool:
    """Whether a random op (``ir.names.op_name``) gets a value here: an expectation, a fixed order, or (a kernel
    switched by an argument) its randomness off above autograd."""
    return name in EXPECTED or name in ORDERS or name in RANDOM_SWITCHES


_paused = 0


@contextlib.contextmanager
def drawing_freely():
    """Random ops draw as usual inside (the data of a step, a trace of the model)."""
    global _paused
    _paused += 1
    try:
        yield
    finally:
        _paused -= 1


class ExpectedRandomness(TorchDispatchMode):
    """Every random aten op returns its expectation (module doc); others run as they are. Higher-order ops pass
    through to the ops they call (a compiled block's recomputation replays its ops with ``run_with_rng_state``,
    which this mode then sees op by op: ``runtime.compiled``)."""

    supports_higher_order_operators = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _paused or isinstance(func, torch._ops.HigherOrderOperator) or not _is_random(func):
            return func(*args, **kwargs)
        name = base_name(func.overloadpacket.__name__)
        bound = _bind(func, args, kwargs)
        if name in RANDOM_SWITCHES or name not in EXPECTED and name not in ORDERS:
            return _switched(func, name, args, kwargs, bound)
        out = func(*args, **kwargs)  # the op's own result: shape, dtype, device (and DTensor layout) as it gives them
        result = out[0] if isinstance(out, (tuple, list)) else out
        if name in ORDERS:
            result.copy_(ORDERS[name](bound, result))
        else:
            _fill(result, EXPECTED[name](bound))
        return out


def _is_random(func, cache: dict = {}) -> bool:  # noqa: B006 (a per-process memo)
    known = cache.get(func)
    if known is None:
        known = cache[func] = (
            torch.Tag.nondeterministic_seeded in func.tags or base_name(func.overloadpacket.__name__) in RANDOM_OPS
        )
    return known


def _bind(func, args: tuple, kwargs: dict) -> dict:
    """The op's arguments by schema name (defaults included)."""
    bound = {}
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return {k: v for k, v in bound.items() if v is not None}


def _fill(result: torch.Tensor, value) -> None:
    """``result`` holds ``value`` (a number or a tensor broadcast to it), rounded where its dtype is integral."""
    integral = not (result.is_floating_point() or result.is_complex())
    if torch.is_tensor(value):
        value = value.detach()
        if integral:
            value = value.round() if value.is_floating_point() else value
        result.copy_(value.expand_as(result) if value.shape != result.shape else value)
        return
    if result.dtype == torch.bool:
        value = value >= 0.5
    elif integral:
        value = round(value)
    result.fill_(value)


def _unbounded():
    raise RandomOpNotFixed(
        "the random op aten.random_ without bounds draws from the whole range of its dtype, which "
        "has no expectation to fix it at; give it bounds (random_(from, to)) or use torch.randint"
    )


def _most_likely(probs: torch.Tensor, samples: int, replacement: bool) -> torch.Tensor:
    if replacement:
        return probs.argmax(-1, keepdim=True).expand(*probs.shape[:-1], samples)
    return probs.topk(samples, dim=-1).indices


def _switched(func, name: str, args: tuple, kwargs: dict, bound: dict):
    """A kernel whose randomness autograd differentiates (or one with no rule here): run it when its
    randomness is off, refuse otherwise."""
    switch = RANDOM_SWITCHES.get(name)
    on = bound.get("train", bound.get("training", True)) is not False and (switch is None or bool(bound.get(switch)))
    if name == "_fused_dropout":
        on = bound.get("p", 0.0) < 1.0  # its p is the probability of keeping
    if on:
        what = f"{switch}={bound.get(switch)}" if switch else "its own random draw"
        raise RandomOpNotFixed(
            f"the random op aten.{name} ({what}) draws inside a kernel autograd differentiates, "
            f"so it cannot run at a value every rank shares; call it through "
            f"torch.nn.functional (dropout, scaled_dot_product_attention, rrelu) or set its "
            f"rate to 0"
        )
    return func(*args, **kwargs)


# Dropout as functions: nn.Dropout* call the torch.nn.functional forms, which FixedFunctions sees.
_DROPOUT_FUNCTIONS = {
    torch.nn.functional.dropout,
    torch.nn.functional.dropout1d,
    torch.nn.functional.dropout2d,
    torch.nn.functional.dropout3d,
    torch.nn.functional.alpha_dropout,
    torch.nn.functional.feature_alpha_dropout,
    torch.dropout,
    torch.alpha_dropout,
    torch.feature_dropout,
    torch.feature_alpha_dropout,
    torch.ops.aten.dropout.default,
    torch.ops.aten.feature_dropout.default,
    torch.ops.aten.alpha_dropout.default,
    torch.ops.aten.feature_alpha_dropout.default,
}
_RRELU_FUNCTIONS = {torch.nn.functional.rrelu, torch.rrelu, torch.ops.aten.rrelu.default}
_SDPA_FUNCTIONS = {
    torch.nn.functional.scaled_dot_product_attention,
    torch.ops.aten.scaled_dot_product_attention.default,
}
SDPA_DROPOUT_ARG = 4  # scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, ...)


class FixedFunctions(torch.overrides.TorchFunctionMode):
    """Above autograd: every dropout call returns its input, ``native_dropout`` its input and a mask of
    ones, attention runs with ``dropout_p=0`` and ``rrelu`` is the leaky ReLU of its mean slope.

    A TorchFunctionMode sees each call of a torch function wherever the model makes it: an
    ``nn.Dropout`` module, ``F.dropout(x, 0.1, self.training)`` written inline, the ``dropout_p`` that
    transformers' attention passes to ``scaled_dot_product_attention``, and the aten calls of a traced
    pipeline stage. It does not see calls made inside a torch function it let through
    (``multi_head_attention_forward`` drops out inside): those reach ``ExpectedRandomness``, which
    gives the CPU's dropout its expectation and refuses a fused kernel's.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _paused:
            return func(*args, **kwargs)
        if func in _DROPOUT_FUNCTIONS:
            return args[0] if args else kwargs["input"]
        if func is torch.native_dropout or func is torch.ops.aten.native_dropout.default:
            x = args[0] if args else kwargs["input"]
            return x, torch.ones_like(x, dtype=torch.bool)
        if func in _RRELU_FUNCTIONS:
            return _mean_slope_rrelu(*args, **kwargs)
        if func in _SDPA_FUNCTIONS:
            if len(args) > SDPA_DROPOUT_ARG:
                args = (*args[:SDPA_DROPOUT_ARG], 0.0, *args[SDPA_DROPOUT_ARG + 1 :])
            if "dropout_p" in kwargs:
                kwargs["dropout_p"] = 0.0
        return func(*args, **kwargs)


def fix_graph_functions(graph: torch.fx.GraphModule) -> int:
    """``FixedFunctions`` applied to a graph dynamo traced (torch functions as its nodes), in place, in it and in every
    graph nested in it: each dropout call replaced by its input, attention's ``dropout_p`` set to 0. Dynamo traces
    the function mode into the graph it compiles, but not into the body of a higher-order op it traces as a graph
    of its own (a checkpoint's: ``tag_activation_checkpoint``), where the calls stay as the model wrote them
    (``runtime.compiled``). Returns how many calls it fixed."""
    fixed = 0
    for module in nested_graphs(graph):
        changed = sum(_fix_call(node) for node in list(module.graph.nodes) if node.op == "call_function")
        if changed:
            module.recompile()
        fixed += changed
    return fixed


def nested_graphs(graph: torch.fx.GraphModule) -> list[torch.fx.GraphModule]:
    """``graph`` and every graph nested in it (higher-order ops' bodies: a checkpoint's)."""
    return [module for module in graph.modules() if isinstance(module, torch.fx.GraphModule)]


def _fix_call(node: torch.fx.Node) -> bool:
    """One node as ``FixedFunctions`` would run its call (dropout its input, attention without dropout); whether it
    changed it."""
    if node.target in _DROPOUT_FUNCTIONS:
        node.replace_all_uses_with(node.args[0] if node.args else node.kwargs["input"])
        node.graph.erase_node(node)
        return True
    if node.target in _SDPA_FUNCTIONS:
        if node.kwargs.get("dropout_p"):
            node.kwargs = {**node.kwargs, "dropout_p": 0.0}
            return True
        if len(node.args) > SDPA_DROPOUT_ARG and node.args[SDPA_DROPOUT_ARG]:
            node.args = (*node.args[:SDPA_DROPOUT_ARG], 0.0, *node.args[SDPA_DROPOUT_ARG + 1 :])
            return True
    return False


def _mean_slope_rrelu(input, lower=1.0 / 8, upper=1.0 / 3, training=False, inplace=False, **_):
    return torch.nn.functional.leaky_relu(input, (lower + upper) / 2, inplace=inplace)


def fix_randomness() -> None:
    """Both modes on for the rest of this process (once): every random op at its fixed value (module doc)."""
    stack = torch.overrides._get_current_function_mode_stack()
    if not any(isinstance(m, FixedFunctions) for m in stack):
        FixedFunctions().__enter__()  # left on: the process exists to run this model
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    if not any(isinstance(m, ExpectedRandomness) for m in _get_current_dispatch_mode_stack()):
        ExpectedRandomness().__enter__()


@contextlib.contextmanager
def fixed_randomness():
    """Both modes for the length of a block (the one-process reference)."""
    with FixedFunctions(), ExpectedRandomness():
        yield
