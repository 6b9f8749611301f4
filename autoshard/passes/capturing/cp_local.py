"""The CP proof's local programs (``cp_proof``): the model exported on one cp rank's tokens, each value's
sequence dims read off a symbolic export (``SymbolicSizes``: the dims whose size has the symbol t) or a static one
at n tokens beside the reference at s (``StaticSizes``), and the nodes that only make an attention mask.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import sympy
import torch
import torch.fx

from autoshard.cost.compute import SDPA_TARGET
from autoshard.ir.names import op_name
from autoshard.passes.capturing.capture import module_of, target_name

WRAPPERS = ("wrap_with_set_grad_enabled", "wrap_with_autocast")  # subgraphs checked op by op


def tensors(node: torch.fx.Node) -> list:
    return [t for t in torch.utils._pytree.tree_leaves(node.meta.get("val")) if isinstance(t, torch.Tensor)]


def walk(gm: torch.fx.GraphModule) -> Iterator[torch.fx.Node]:
    """Placeholders and calls in execution order, the subgraph of a wrapper before the wrapper."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and wrapped(gm, node) is not None:
            yield from walk(wrapped(gm, node))
        if node.op in ("placeholder", "call_function"):
            yield node


def wrapped(gm: torch.fx.GraphModule, node: torch.fx.Node) -> torch.fx.GraphModule | None:
    if not target_name(node.target).endswith(WRAPPERS):
        return None
    sub = next((a for a in node.args if isinstance(a, torch.fx.Node) and a.op == "get_attr"), None)
    return getattr(gm, sub.target) if sub is not None else None


class SymbolicSizes:
    """Sequence dims of the symbolic export: the dims whose size has the symbol t."""

    def __init__(self, program, s: int):
        self.tokens, self.s = None, s
        for node in program.graph.nodes:
            for t in tensors(node) if node.op == "placeholder" else ():
                for size in t.shape:
                    if isinstance(size, torch.SymInt) and size.node.expr.free_symbols:
                        self.tokens = next(iter(size.node.expr.free_symbols))

    def dims(self, node: torch.fx.Node) -> tuple[tuple[int, ...], str | None]:
        """(sequence dims of the first tensor output, why a dim does not follow the sequence or None)."""
        first, bad = None, None
        for t in tensors(node):
            dims = []
            for d, size in enumerate(t.shape):
                expr = size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size)
                if not expr.free_symbols:
                    continue
                dims.append(d)
                k = sympy.simplify(expr / self.tokens)
                if bad is None and not (k.is_Integer and k >= 1):
                    bad = f"has a dim of {self.show(size)} where the sequence has t tokens"
            first = tuple(dims) if first is None else first
        return first or (), bad

    def show(self, size: Any) -> str:
        if isinstance(size, torch.SymInt):
            return str(size.node.expr.subs(self.tokens, sympy.Symbol("t")))
        return str(size)

    def at_s(self, size: Any) -> int:
        """The size in the one-process program (t = s)."""
        if isinstance(size, torch.SymInt):
            return int(size.node.expr.subs(self.tokens, self.s))
        return int(size)


class StaticSizes:
    """Sequence dims of a static export at n tokens: the dims whose size differs from the reference's at s."""

    def __init__(self, reference, program, s: int, n: int):
        self.s, self.n = s, n
        self.ref = dict(zip(walk(program.graph_module), walk(reference.graph_module)))
        self.difference = first_difference(list(walk(program.graph_module)), list(walk(reference.graph_module)))

    def dims(self, node: torch.fx.Node) -> tuple[tuple[int, ...], str | None]:
        first, bad = None, None
        ref = self.ref.get(node)
        for t, r in zip(tensors(node), tensors(ref) if ref is not None else ()):
            if t.dim() != r.dim():
                return (), f"gives a {t.dim()}-d tensor on {self.n} tokens, {r.dim()}-d on {self.s}"
            dims = [d for d in range(t.dim()) if t.shape[d] != r.shape[d]]
            for d in dims:
                if bad is None and (r.shape[d] % self.s or t.shape[d] != r.shape[d] // self.s * self.n):
                    bad = f"has a dim of {t.shape[d]} on {self.n} tokens and {r.shape[d]} on {self.s}"
            first = tuple(dims) if first is None else first
        return first or (), bad

    def show(self, size: Any) -> str:
        return str(size)

    def at_s(self, size: Any) -> int:
        """The size of a sequence dim in the one-process program (k·n -> k·s)."""
        return int(size) // self.n * self.s


def first_difference(local: list, reference: list) -> torch.fx.Node | None:
    for a, b in zip(local, reference):
        if a.op != b.op or target_name(a.target) != target_name(b.target):
            return a
    return (
        None if len(local) == len(reference) else (local[len(reference)] if len(local) > len(reference) else local[-1])
    )


class Local:
    """One local program with the sequence dims of every value (``sizes``: symbolic or static)."""

    def __init__(self, program, sizes):
        self.program, self.sizes = program, sizes
        self.nodes = list(walk(program.graph_module))
        self.seq: dict[torch.fx.Node, tuple[int, ...]] = {}
        self.bad: dict[torch.fx.Node, str] = {}
        for node in self.nodes:
            self.seq[node], why = sizes.dims(node)
            if why:
                self.bad[node] = why
        self.exempt = mask_only(program.graph_module)
        self.path_difference = None
        diff = getattr(sizes, "difference", None)
        if diff is not None:
            self.path_difference = (
                f"the model's code takes another path on {sizes.n} tokens than on {sizes.s}: {where(diff)}"
            )

    def top(self) -> list[torch.fx.Node]:
        """Top-level calls with a tensor output, as the captured graph lists them."""
        return [n for n in self.program.graph.nodes if n.op == "call_function" and tensors(n)]


def mask_only(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """Step 4: nodes whose every use (ignoring asserts, which return nothing) leads only into an SDPA's
    ``attn_mask``, transitively."""
    exempt: set[torch.fx.Node] = set()
    for node in reversed(gm.graph.nodes):
        if node.op != "call_function":
            continue
        uses = [u for u in node.users if u.op != "call_function" or tensors(u) or is_sdpa(u)]
        if uses and all(u in exempt or (is_sdpa(u) and mask_only_arg(u, node)) for u in uses):
            exempt.add(node)
    return exempt


def is_sdpa(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and target_name(node.target).startswith(SDPA_TARGET)


def mask_only_arg(sdpa: torch.fx.Node, node: torch.fx.Node) -> bool:
    args = bound_args(sdpa)
    return args.get("attn_mask") is node and all(args.get(k) is not node for k in ("query", "key", "value"))


def where(node: torch.fx.Node) -> str:
    path, _ = module_of(node)
    return f"{op_name(target_name(node.target))} in {path or 'the root'}"


def show_shape(node: torch.fx.Node, local: Local) -> str:
    return "[" + ", ".join(local.sizes.show(d) for d in tensors(node)[0].shape) + "]"


def bound_args(node: torch.fx.Node) -> dict[str, Any]:
    """The call's arguments by schema name (defaults filled in); aten ops only, {} otherwise."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return {}
    out = {}
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args) and not arg.kwarg_only:
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
    return out
