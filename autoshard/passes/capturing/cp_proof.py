"""CP proof: context parallelism is accepted only where each rank's program computes its share.

A cp plan (``runtime.context_parallel``) gives rank r the tokens [r·s/cp, (r+1)·s/cp) of every sample
and runs the model's own Python code on them; ``ContextParallelMode`` makes attention a ring over the cp
ranks and shifts every ``torch.arange`` of the local length to the rank's global positions. That is the
one-process computation only if every other op works token by token: a cumsum or a mean over the
sequence, a pooler that takes token 0, a label shift ``x[:, :-1]``, a conv over the tokens or a slice of a
precomputed position table would each train silently wrong. ``passes.planning.context_parallel.cp_refusal`` reads
the captured graph; this pass runs the model's code on a rank's share and reads what it computes.

1. **The local program** (``export_local``): the model built on meta as capture builds it (folded
   likewise), exported on the capture batch with dim 1 of every input of s tokens (``input_shapes``) cut
   to a *symbolic* length t with 2 <= t <= s/2, hint s/2 (``torch.export`` with a ``Dim``). Why one
   export stands for every cp: the rank of a cp plan runs the same code on t = s/cp tokens (the rank
   only enters through the arange shift and the ring), and an export with a symbolic t either is valid
   for every t in the range or fails: each Python branch on the length is a guard, and a guard that not
   every t in the range satisfies is a constraint violation. A static export at s/2 would not do: a model
   that computes its rotary angles when ``s`` exceeds its table and slices the table otherwise
   (benchmarks/llama3.py) is right at cp=2 and wrong at cp=4 of the same s.
   **Fallback per degree**: when the symbolic export fails (the path depends on the length, or an op
   has no symbolic rule), the model is exported at s (the reference) and at s/cp for every cp in
   2..``CP_MAX`` that divides s with s/cp >= 2, each compared with the reference (an export at exactly
   s/cp tokens is that degree's rank program); a sequence dim is then a dim whose size differs. Degrees
   not listed keep the symbolic export's reason. Cost: one symbolic export (~1.5x a static one), and
   1 + (divisors of s up to CP_MAX) static exports only for models whose path depends on the length.
2. **Compare** the top-level ops with the captured graph, node by node (same targets, same order): the
   first difference refuses ("the model's code takes another path on t tokens"). The *sequence dims* of
   a value are its dims whose size depends on t; each must be k·t for a whole k >= 1 (the tokens, or B·t
   where batch and sequence are merged), and the local shape at t = s must be the captured shape;
   anything else refuses ("has a dim that does not follow the sequence"). Ops inside the subgraph of a
   ``wrap_with_set_grad_enabled`` / ``wrap_with_autocast`` (Llama's rotary angles) are checked as well;
   the captured graph only has the wrapper.
3. **Mixing** (``mixing``): an op that mixes tokens along a sequence dim of one of its inputs is refused,
   except scaled-dot-product attention whose q, k and v carry the sequence on dim 2 and nowhere else
   (the ring). Allowed: pointwise ops (broadcast token by token), dropout, views that keep each token's
   elements together (B·t merges, head splits), transposes, expand, embedding and indexing *by* tokens,
   linear / matmul / einsum over non-sequence dims, norms and softmax over non-sequence dims, slices of
   the whole sequence, ``arange`` of exactly t elements with step 1 (the runtime shifts it), constant
   tensors of sequence sizes, per-token losses (reduction none). Everything else that touches a sequence
   dim is refused, unknown ops included; so is a tensor with two sequence dims (token pairs: a rank
   would see only the pairs of its own tokens), a slice of t rows out of a tensor that does not carry
   the sequence (a precomputed position table: every rank would take the first rank's rows), and an
   attention mask computed from a model input (a padding mask: the ring takes none).
4. **Mask-only exemption**: transformers builds an explicit causal mask when traced (aranges, a cumsum
   over position differences, index ops, a [B, 1, t, t] bool mask into SDPA's ``attn_mask``), while at
   run time it passes ``attn_mask=None, is_causal=True``; the runtime refuses every explicit mask, so
   what such a mask would contain is never computed. Nodes whose every use leads only into SDPA's
   ``attn_mask`` (transitively) are exempt from 2's dim rule and from 3.
5. **The one-process mask is causal** (``mask_refusal``, once some degree passes 1-4): what a rank's ring
   computes is causal attention over all s tokens, so the mask one process applies at s must be exactly
   that. transformers decides per length whether to build one: with a sliding window w (Mistral, Qwen2,
   Gemma 2/3, any ``layer_types`` with sliding attention) it passes ``is_causal`` alone while the tokens fit
   the window, so at s/cp <= w < s a rank skips the window one process applies (the plan trained unlike
   one process, silently), and at w < s/cp a rank passes the window's mask, which the runtime refuses
   mid-run. A window is one more comparison among the mask's ops, not a shape: each mask of a static
   export at s (one sample) is computed on the CPU from its own ops and compared with the causal mask
   element by element; any other mask refuses every degree, naming a query and key on which they differ.

What is proven: every op of the model's forward on a rank's t tokens is, op for op, the one-process op
restricted to those tokens, attention and the arange positions aside, which the runtime replaces, and
every attention of one process attends causally or as the call says (no mask). Not
proven here, and checked by ``cp_refusal`` per degree on the captured graph: that no *static* arange of
s/cp elements exists (the runtime would shift it too), attention dropout, and by the runtime as it runs:
no explicit mask, the ring's shapes. Random ops (dropout) draw per rank, as under data parallelism.

The result is ``OpGraph.cp_proofs``, which ``passes.planning.context_parallel.cp_refusal`` reads right after the
sequence's own conditions (s > 1, s mod cp = 0) and before its graph checks: {"*": reason}
from the symbolic export (every degree with s/cp >= 2), or {"*": why the symbolic export failed, str(cp):
reason, ...} per degree, or {"*": why the one-process mask is not causal} (step 5); "" is proven; models
without a sequence or without attention get {"*": that reason} without an export (the cheap skip). None: never
checked (hand-built graphs).

**Deferred.** The symbolic export is the costliest part of a capture (3-6 s of a small transformers
model's 8-18 s on 2 cores), and most plans never consider cp: the search offers it only from
``CP_SEARCH_MIN_TOKENS`` tokens per sample, or where ``--cp`` is pinned. Below that length the capture
records ``{"*": DEFERRED}`` (``prove_context_parallel(..., prove=False)``): every cp is refused with a
reason that names the fix, never assumed; a request that pins cp > 1 (``needs_proof``) runs the proof
on the graph it gets, cached or not (``passes.capturing.front.capture_front``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import sympy
import torch
import torch.fx

from autoshard.cost.compute import SDPA_TARGET
from autoshard.ir.graph import OpGraph
from autoshard.ir.names import op_name
from autoshard.modelfile import ModelFile
from autoshard.passes.capturing.capture import build_on_meta, module_of, quiet_export, target_name
from autoshard.passes.capturing.fold import fold_model
from autoshard.passes.layouts.context_parallel import CP_MAX, CP_SEARCH_MIN_TOKENS, DEFERRED

ALL = "*"  # the cp_proofs key of every degree without its own entry
MIN_LOCAL = 2  # the shortest local length proven (export specializes lengths 0 and 1)
NO_SEQUENCE = "the model has no sequence dimension to split"
NO_ATTENTION = "the model has no scaled-dot-product attention for a ring to split"
WRAPPERS = ("wrap_with_set_grad_enabled", "wrap_with_autocast")  # subgraphs checked op by op


def prove_context_parallel(model_file: ModelFile, graph: OpGraph, prove: bool | None = None) -> OpGraph:
    """``graph`` (captured, annotated, maybe folded) with ``cp_proofs`` (module doc). ``prove``: True runs the
    proof, False defers it, None (the default) runs it where the search would offer cp ("Deferred")."""
    if prove is None:
        prove = graph.tokens_per_sample >= CP_SEARCH_MIN_TOKENS
    graph.cp_proofs = cp_proofs(model_file, graph) if prove else {ALL: DEFERRED}
    return graph


def cp_proofs(model_file: ModelFile, graph: OpGraph) -> dict[str, str]:
    s = graph.tokens_per_sample
    if s <= 1:
        return {ALL: NO_SEQUENCE}
    if not any(n.target.startswith(SDPA_TARGET) for n in graph.nodes):
        return {ALL: NO_ATTENTION}
    if s // 2 < MIN_LOCAL:
        return {ALL: f"a sequence of {s} tokens is too short to split (a cp rank needs {MIN_LOCAL} or more)"}
    proofs = local_proofs(model_file, graph)
    if "" in proofs.values():  # some degree's rank computes its share: then one process must mask causally
        why = mask_refusal(model_file, graph)
        if why:
            return {ALL: why}
    return proofs


def local_proofs(model_file: ModelFile, graph: OpGraph) -> dict[str, str]:
    """Steps 1-4: the symbolic export, or one static export per degree."""
    s = graph.tokens_per_sample
    try:
        program = export_local(model_file, graph, s // 2, symbolic=True)
    except Exception as exc:  # the path depends on the length, or an op has no symbolic rule: per degree
        return per_degree(
            model_file,
            graph,
            f"the model's code on s/cp tokens could not be traced for every cp at once ({_why_not(exc)})",
        )
    return {ALL: refusal(graph, Local(program, SymbolicSizes(program, s)), "t") or ""}


def per_degree(model_file: ModelFile, graph: OpGraph, why: str) -> dict[str, str]:
    """Step 1's fallback: one static export per degree, compared with a static export at s."""
    s = graph.tokens_per_sample
    out = {ALL: f"{why}; cp={{cp}} was not checked on its own"}
    try:
        reference = export_local(model_file, graph, s, symbolic=False)
    except Exception as exc:
        return {ALL: f"{why}; the model's code fails on {s} tokens ({_why_not(exc)})"}
    for cp in range(2, CP_MAX + 1):
        if s % cp or s // cp < MIN_LOCAL:
            continue
        try:
            program = export_local(model_file, graph, s // cp, symbolic=False)
        except Exception as exc:
            out[str(cp)] = f"the model's code fails on the {s // cp} tokens of a cp={cp} rank ({_why_not(exc)})"
            continue
        local = Local(program, StaticSizes(reference, program, s, s // cp))
        out[str(cp)] = local.path_difference or refusal(graph, local, str(s // cp)) or ""
    return out


# ---------------------------------------------------------------------------- the local program


def export_local(model_file: ModelFile, graph: OpGraph, length: int, symbolic: bool, batch: int | None = None):
    """The model's program on ``length`` of the s tokens (symbolic: any length 2 .. s/2, hint ``length``), on
    the captured batch or ``batch`` samples."""
    model = build_on_meta(model_file)
    if graph.fold is not None:
        fold_model(model)
    s = graph.tokens_per_sample
    inputs = model_file.example_batch(batch or graph.batch_size)[0]
    cut = [t.dim() >= 2 and t.shape[1] == s for t in inputs]
    local = tuple((t[:, :length] if c else t).to("meta") for t, c in zip(inputs, cut))
    dims = None
    if symbolic:
        tokens = torch.export.Dim("tokens", min=MIN_LOCAL, max=s // 2)
        dims = tuple({1: tokens} if c else None for c in cut)
    with quiet_export():
        return torch.export.export(model, local, dynamic_shapes=dims, strict=False)


def _why_not(exc: BaseException) -> str:
    """The exception's first line; for a constraint violation, the guard (the length the code branches on)."""
    root = exc.__cause__ or exc
    text = str(root)
    guard = re.search(r"satisfy the generated guard (.+)", text)
    if guard:
        expr = re.sub(r"L\['[^']+'\]\.size\(\)\[1\]", "t", guard.group(1)).strip().rstrip(".")
        return f"it branches on the local length t: {expr}"
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return f"{type(root).__name__}: {lines[0][:200] if lines else ''}"


def _tensors(node: torch.fx.Node) -> list:
    return [t for t in torch.utils._pytree.tree_leaves(node.meta.get("val")) if isinstance(t, torch.Tensor)]


def walk(gm: torch.fx.GraphModule) -> Iterator[torch.fx.Node]:
    """Placeholders and calls in execution order, the subgraph of a wrapper before the wrapper."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and _wrapped(gm, node) is not None:
            yield from walk(_wrapped(gm, node))
        if node.op in ("placeholder", "call_function"):
            yield node


def _wrapped(gm: torch.fx.GraphModule, node: torch.fx.Node) -> torch.fx.GraphModule | None:
    if not target_name(node.target).endswith(WRAPPERS):
        return None
    sub = next((a for a in node.args if isinstance(a, torch.fx.Node) and a.op == "get_attr"), None)
    return getattr(gm, sub.target) if sub is not None else None


class SymbolicSizes:
    """Sequence dims of the symbolic export: the dims whose size has the symbol t."""

    def __init__(self, program, s: int):
        self.tokens, self.s = None, s
        for node in program.graph.nodes:
            for t in _tensors(node) if node.op == "placeholder" else ():
                for size in t.shape:
                    if isinstance(size, torch.SymInt) and size.node.expr.free_symbols:
                        self.tokens = next(iter(size.node.expr.free_symbols))

    def dims(self, node: torch.fx.Node) -> tuple[tuple[int, ...], str | None]:
        """(sequence dims of the first tensor output, why a dim does not follow the sequence or None)."""
        first, bad = None, None
        for t in _tensors(node):
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
        self.difference = _first_difference(list(walk(program.graph_module)), list(walk(reference.graph_module)))

    def dims(self, node: torch.fx.Node) -> tuple[tuple[int, ...], str | None]:
        first, bad = None, None
        ref = self.ref.get(node)
        for t, r in zip(_tensors(node), _tensors(ref) if ref is not None else ()):
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


def _first_difference(local: list, reference: list) -> torch.fx.Node | None:
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
                f"the model's code takes another path on {sizes.n} tokens than on {sizes.s}: {_where(diff)}"
            )

    def top(self) -> list[torch.fx.Node]:
        """Top-level calls with a tensor output, as the captured graph lists them."""
        return [n for n in self.program.graph.nodes if n.op == "call_function" and _tensors(n)]


# ---------------------------------------------------------------------------- refusal


def refusal(graph: OpGraph, local: Local, tokens: str) -> str | None:
    """Steps 2-4 on one local program; None when it computes every rank's share."""
    why = compare_with_capture(graph, local, tokens)
    if why:
        return why
    why = mask_from_inputs(local)
    if why:
        return why
    for node in local.nodes:
        if node.op != "call_function" or node in local.exempt or not _tensors(node):
            continue
        if node in local.bad:
            return f"{_where(node)} {local.bad[node]}"
        why = mixing(node, local)
        if why:
            return f"{_where(node)} {why}"
    return None


def compare_with_capture(graph: OpGraph, local: Local, tokens: str) -> str | None:
    """Step 2: the same ops as the captured graph, in order, with the captured shapes at t = s."""
    captured = [n for n in graph.nodes if n.dtype]
    ours = local.top()
    sizes, s = local.sizes, graph.tokens_per_sample
    for i, node in enumerate(captured):
        if i >= len(ours) or target_name(ours[i].target) != node.target:
            found = _where(ours[i]) if i < len(ours) else "nothing"
            return (
                f"the model's code takes another path on {tokens} tokens: {found} where the captured "
                f"graph has {op_name(node.target)} in {node.module_path or 'the root'}"
            )
        mine = _tensors(ours[i])[0]
        if isinstance(sizes, SymbolicSizes) and ours[i] not in local.exempt:
            at_s = tuple(sizes.at_s(d) for d in mine.shape)
            if at_s != tuple(node.shape):
                return (
                    f"{_where(ours[i])} gives shape {_show(ours[i], local)} on t tokens, which is not the "
                    f"captured {list(node.shape)} at t = {s} (the model's code takes another path)"
                )
    if len(ours) > len(captured):
        return f"the model's code takes another path on {tokens} tokens: {_where(ours[len(captured)])}"
    return None


def mask_only(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """Step 4: nodes whose every use (ignoring asserts, which return nothing) leads only into an SDPA's
    ``attn_mask``, transitively."""
    exempt: set[torch.fx.Node] = set()
    for node in reversed(gm.graph.nodes):
        if node.op != "call_function":
            continue
        uses = [u for u in node.users if u.op != "call_function" or _tensors(u) or _is_sdpa(u)]
        if uses and all(u in exempt or (_is_sdpa(u) and _mask_only_arg(u, node)) for u in uses):
            exempt.add(node)
    return exempt


def _is_sdpa(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and target_name(node.target).startswith(SDPA_TARGET)


def _mask_only_arg(sdpa: torch.fx.Node, node: torch.fx.Node) -> bool:
    args = _bound(sdpa)
    return args.get("attn_mask") is node and all(args.get(k) is not node for k in ("query", "key", "value"))


def mask_from_inputs(local: Local) -> str | None:
    """An attention mask computed from a model input (a padding mask): the ring cannot take it."""
    signature = local.program.graph_signature
    inputs = set(signature.user_inputs)
    for node in local.program.graph.nodes:
        if not _is_sdpa(node) or not isinstance(_bound(node).get("attn_mask"), torch.fx.Node):
            continue
        seen, todo = set(), [_bound(node)["attn_mask"]]
        while todo:
            x = todo.pop()
            if x in seen:
                continue
            seen.add(x)
            if x.op == "placeholder" and x.name in inputs:
                return (
                    f"{_where(node)} takes a mask computed from the model input {x.name} (a padding mask?), "
                    f"which the ring cannot split along the sequence"
                )
            todo += [a for a in x.all_input_nodes if _tensors(a)]  # data, not sizes read (sym_size)
    return None


# ---------------------------------------------------------------------------- the one-process mask

MASK_BUDGET = 1 << 30  # the most elements of one tensor of a mask evaluated (s = 32,768: 1 GiB of bools)
MASK_ROWS = 1024  # the query rows compared with the causal mask at a time


def mask_refusal(model_file: ModelFile, graph: OpGraph) -> str | None:
    """Step 5: the mask each attention of the one-process program applies to its s tokens is the causal one.

    A rank's code never builds its mask (the runtime refuses one), so the mask the captured graph feeds an
    attention is what one process applies and the ring does not: the ring attends causally over all s tokens.
    transformers decides per length whether to build it: with a sliding window w it passes ``is_causal``
    alone while the tokens fit the window, so a rank's s/cp <= w tokens skip the window that one process
    applies to s > w (Mistral, Qwen2, Gemma 2/3; ``_ignore_causal_mask_sdpa``). What the mask allows cannot
    be read off the ops (a window is one more comparison): each mask is computed on the program at s tokens
    (a static export of one sample; its ops have no model input but the positions it numbers) and compared
    with the causal mask, element by element. None where every one is causal, or where no attention of the
    captured graph takes a mask (no export). Beyond ``MASK_BUDGET`` elements a mask is not computed: refused."""
    if not any(n.target.startswith(SDPA_TARGET) and n.attrs.get("attn_mask", "") is not None for n in graph.nodes):
        return None
    s = graph.tokens_per_sample
    try:
        program = export_local(model_file, graph, s, symbolic=False, batch=1)
    except Exception as exc:
        return f"the model's attention masks could not be computed on its {s} tokens ({_why_not(exc)})"
    for sdpa in walk(program.graph_module):  # a wrapper's subgraph too
        mask = _bound(sdpa).get("attn_mask") if _is_sdpa(sdpa) else None
        if isinstance(mask, torch.fx.Node):
            why = _mask_value(mask, s)
            if isinstance(why, str):
                return f"{_where(sdpa)}: {why}"
            why = _not_causal(why, s)
            if why:
                return (
                    f"{_where(sdpa)} masks its {s} tokens other than causally ({why}), while "
                    f"a cp rank's code attends causally over them as a ring"
                )
    return None


def _mask_value(mask: torch.fx.Node, s: int) -> torch.Tensor | str:
    """The mask's value, computed on the CPU op by op from its ops alone, or why it cannot be."""
    needed, todo = set(), [mask]
    while todo:
        node = todo.pop()
        if node in needed:
            continue
        needed.add(node)
        if node.op != "call_function":
            return f"its mask reads {node.name}, whose value the plan does not have"
        big = [t for t in _tensors(node) if t.numel() > MASK_BUDGET]
        if big:
            return (
                f"its mask on {s} tokens has {big[0].numel()} elements, more than the {MASK_BUDGET} computed to "
                f"check that it is causal"
            )
        todo += node.all_input_nodes
    values: dict[torch.fx.Node, Any] = {}
    uses = {n: sum(u in needed for u in n.users) for n in needed}
    on_cpu = lambda a: torch.device("cpu") if isinstance(a, torch.device) else values.get(a, a)  # noqa: E731
    for node in (n for n in mask.graph.nodes if n in needed):
        args = torch.fx.node.map_aggregate(node.args, on_cpu)
        values[node] = node.target(*args, **torch.fx.node.map_aggregate(node.kwargs, on_cpu))
        for used in node.all_input_nodes:  # a value no later op reads is let go (masks of s^2 elements)
            uses[used] -= 1
            if not uses[used]:
                del values[used]
    return values[mask]


def _not_causal(mask: torch.Tensor, s: int) -> str | None:
    """Where a boolean (True: attends) or additive (0: attends; -inf, or the dtype's lowest value as older
    transformers adds, not: its exp is 0 where the row attends anywhere, as a causal row does) mask over
    [.., s, s] differs from the causal mask, or None."""
    if mask.dtype != torch.bool:
        masked = (mask == float("-inf")) | (mask == torch.finfo(mask.dtype).min)
        if not bool(((mask == 0) | masked).all()):
            return "it adds values other than 0 and -inf to the scores"
        mask = mask == 0
    if tuple(mask.shape[-2:]) != (s, s):
        return f"a mask of shape {list(mask.shape)}"
    keys = torch.arange(s)
    for start in range(0, s, MASK_ROWS):
        queries = torch.arange(start, min(start + MASK_ROWS, s))
        differs = mask[..., start : start + MASK_ROWS, :] != (keys <= queries[:, None])
        found = differs.reshape(-1, len(queries), s).any(0).nonzero()
        if len(found):
            return _said(start + int(found[0][0]), int(found[0][1]))
    return None


def _said(q: int, k: int) -> str:
    """A query and key pair on which the mask and the causal mask disagree, in words."""
    if k == q:
        return f"query {q} does not see its own key"
    if k < q:
        return f"query {q} does not see key {k}, an earlier token: a sliding window?"
    return f"query {q} sees key {k}, a later token"


def _where(node: torch.fx.Node) -> str:
    path, _ = module_of(node)
    return f"{op_name(target_name(node.target))} in {path or 'the root'}"


def _show(node: torch.fx.Node, local: Local) -> str:
    return "[" + ", ".join(local.sizes.show(d) for d in _tensors(node)[0].shape) + "]"


# ---------------------------------------------------------------------------- mixing


def _bound(node: torch.fx.Node) -> dict[str, Any]:
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


class Call:
    """One call as ``mixing`` reads it: its arguments, and the sequence dims of its tensor inputs."""

    def __init__(self, node: torch.fx.Node, local: Local):
        self.node, self.local, self.args = node, local, _bound(node)
        self.out = local.seq.get(node, ())
        self.out_rank = len(_tensors(node)[0].shape)
        self.inputs = [x for x in node.all_input_nodes if x.op != "get_attr" and _tensors(x)]

    def seq(self, x: Any) -> tuple[int, ...]:
        return self.local.seq.get(x, ()) if isinstance(x, torch.fx.Node) else ()

    def rank(self, x: Any) -> int:
        return _tensors(x)[0].dim() if isinstance(x, torch.fx.Node) and _tensors(x) else 0

    def any_seq(self) -> bool:
        return bool(self.out) or any(self.seq(x) for x in self.inputs)

    def dims(self, name: str, x: Any) -> set[int] | None:
        """The dims named by argument ``name`` of input ``x``, normalized; None for every dim."""
        value = self.args.get(name)
        n = max(self.rank(x), 1)
        if value is None or value == []:
            return None
        values = value if isinstance(value, (list, tuple)) else [value]
        return {int(v) % n for v in values}

    def shape(self, x: torch.fx.Node) -> str:
        return _show(x, self.local)


def mixing(node: torch.fx.Node, local: Local) -> str | None:
    """Why ``node`` mixes tokens along a sequence dim (module doc, step 3), or None."""
    call = Call(node, local)
    name = target_name(node.target)
    if not call.any_seq():
        return None
    if _is_sdpa(node):
        return _attention(call)
    if name.endswith(WRAPPERS) or name == "operator.getitem":
        return None  # the wrapped ops were checked one by one; getitem picks an output
    pairs = [x for x in [node, *call.inputs] if len(call.seq(x)) > 1]
    if pairs:
        return f"makes a tensor of token pairs {call.shape(pairs[0])}: a cp rank would pair only its own tokens"
    rule = RULES.get(op_name(name))
    if rule is None:
        return f"is not known to act token by token, and it reads or writes the sequence ({call.shape(node)})"
    try:
        return rule(call)
    except Exception as exc:  # arguments this rule did not expect: refused, not assumed
        return f"has arguments the proof cannot read ({type(exc).__name__}: {exc})"


def _first_input(call: Call) -> torch.fx.Node | None:
    return next((x for x in call.node.args if isinstance(x, torch.fx.Node)), None)


def _pointwise(call: Call) -> str | None:
    """Broadcast token by token: each input's sequence dim lands, right-aligned, on the output's."""
    for x in call.inputs:
        shift = call.out_rank - call.rank(x)
        if any(d + shift not in call.out for d in call.seq(x)):
            return f"broadcasts the sequence of {call.shape(x)} onto another dim of {call.shape(call.node)}"
    return _no_source(call)


def _no_source(call: Call) -> str | None:
    """A sequence dim out of inputs that have none is a table read by length (``rope_cos[:s]``), unless made
    of constants."""
    if call.out and not any(call.seq(x) for x in call.inputs):
        rows = call.local.sizes.at_s(_tensors(call.node)[0].shape[call.out[0]])
        return (
            f"slices {rows} rows out of a tensor that does not carry the sequence ({call.shape(call.node)} on "
            f"a cp rank; a precomputed position table?): every cp rank would take the first rank's rows"
        )
    return None


def _along(what: str, name: str = "dim", whole_if_none: bool = True) -> Callable[[Call], str | None]:
    """Ops that act along the dims named by argument ``name`` (all of them when it is None)."""

    def rule(call: Call) -> str | None:
        x = _first_input(call)
        dims = call.dims(name, x)
        hit = sorted(set(call.seq(x)) if dims is None and whole_if_none else set(call.seq(x)) & (dims or set()))
        if hit:
            return f"{what} (dim {hit[0]} of {call.shape(x)})"
        return _no_source(call)

    return rule


def _expand(call: Call) -> str | None:
    """A broadcast: the input's sequence dims stay, size-1 dims may grow to t (the same value per token)."""
    x = _first_input(call)
    shift = call.out_rank - call.rank(x)
    if any(d + shift not in call.out for d in call.seq(x)):
        return f"moves the sequence of {call.shape(x)} in {call.shape(call.node)}"
    return None


def _leading(call: Call) -> str | None:
    """view_as_real / view_as_complex: the last dim changes, the others keep their place."""
    x = _first_input(call)
    last = min(call.rank(x), call.out_rank) - 1
    if any(d >= last for d in call.seq(x)) or set(call.seq(x)) != set(call.out):
        return f"moves the sequence of {call.shape(x)} in {call.shape(call.node)}"
    return None


def _stack(call: Call) -> str | None:
    """Stacking inserts a dim at ``dim``; each input's sequence dim moves past it, and no token mixes."""
    tensors = [x for x in call.args.get("tensors", []) if isinstance(x, torch.fx.Node)]
    at = int(call.args.get("dim", 0)) % call.out_rank
    for x in tensors:
        if any((d if d < at else d + 1) not in call.out for d in call.seq(x)):
            return f"stacks {call.shape(x)} with its sequence on another dim"
    return None


def _constant(call: Call) -> str | None:
    return None  # the same value at every token: a rank's part of it is itself


def _layout(call: Call) -> str | None:
    """Transposes and the like move dims; the tokens stay whole."""
    return _no_source(call)


def _view(call: Call) -> str | None:
    """A view keeps each token's elements together when the elements after the sequence dim are the same
    number before and after (B·t merges, head splits); anything else moves the tokens."""
    x = _first_input(call)
    before, after = call.seq(x), call.out
    if not before:
        return _no_source(call)
    if len(after) != 1:
        return f"reshapes {call.shape(x)} to {call.shape(call.node)}, losing the sequence dim"
    inner_in = math.prod(int(d) for d in _tensors(x)[0].shape[before[0] + 1 :])
    inner_out = math.prod(int(d) for d in _tensors(call.node)[0].shape[after[0] + 1 :])
    if inner_in != inner_out:
        return f"reshapes {call.shape(x)} to {call.shape(call.node)}, which moves tokens into other dims"
    return None


def _slice(call: Call) -> str | None:
    """A slice of the whole sequence keeps it; any other slice along it takes some tokens."""
    x, dim = call.args["self"], int(call.args.get("dim", 0)) % max(call.rank(call.args["self"]), 1)
    if dim in call.seq(x):
        whole = str(_tensors(x)[0].shape[dim]) == str(_tensors(call.node)[0].shape[dim])
        if not (whole and call.args.get("start") in (None, 0) and call.args.get("step", 1) == 1):
            return f"takes some of the tokens (dim {dim} of {call.shape(x)} to {call.shape(call.node)})"
    return _no_source(call)


def _cat(call: Call) -> str | None:
    tensors = [x for x in call.args.get("tensors", []) if isinstance(x, torch.fx.Node)]
    dim = int(call.args.get("dim", 0))
    for x in tensors:
        if dim % max(call.rank(x), 1) in call.seq(x):
            return f"joins tensors along the sequence (dim {dim % call.rank(x)} of {call.shape(x)})"
    return _no_source(call)


def _index(call: Call) -> str | None:
    """``x[idx]``: indexing a sequence dim takes tokens; indexing a table *by* tokens is a lookup."""
    x, indices = call.args["self"], call.args.get("indices", [])
    for d, idx in enumerate(indices):
        if idx is not None and d in call.seq(x):
            return f"takes tokens by index (dim {d} of {call.shape(x)})"
    return None


def _gather(call: Call) -> str | None:
    x = call.args["self"]
    dims = call.dims("dim", x)
    hit = set(call.seq(x)) if dims is None else set(call.seq(x)) & dims
    if hit:
        return f"gathers along the sequence (dim {min(hit)} of {call.shape(x)})"
    return None


def _embedding(call: Call) -> str | None:
    if call.seq(call.args["weight"]):
        return "looks up rows of a tensor that carries the sequence"
    return None


def _contract(a_dims: Callable[[int], set[int]], b_dims: Callable[[int], set[int]], a: str, b: str):
    """Products: refused when a contracted dim (``a_dims`` of input ``a``, ``b_dims`` of ``b``) is a sequence dim."""

    def rule(call: Call) -> str | None:
        for arg, dims in ((a, a_dims), (b, b_dims)):
            x = call.args.get(arg)
            if isinstance(x, torch.fx.Node) and set(call.seq(x)) & dims(call.rank(x)):
                return f"contracts over the sequence (dims {sorted(dims(call.rank(x)))} of {call.shape(x)})"
        bias = [x for x in call.inputs if x is not call.args.get(a) and x is not call.args.get(b) and call.seq(x)]
        if bias:
            return _pointwise(call)
        return None

    return rule


def _linear(call: Call) -> str | None:
    x, w = call.args["input"], call.args["weight"]
    if call.seq(w) or (isinstance(call.args.get("bias"), torch.fx.Node) and call.seq(call.args["bias"])):
        return "multiplies by a weight that carries the sequence"
    if call.rank(x) - 1 in call.seq(x):
        return f"contracts over the sequence (the last dim of {call.shape(x)})"
    return None


def _einsum(call: Call) -> str | None:
    equation = str(call.args["equation"]).replace(" ", "")
    lhs, _, rhs = equation.partition("->")
    operands = [x for x in call.args.get("tensors", []) if isinstance(x, torch.fx.Node)]
    if "..." in equation or not rhs:
        return "is an einsum with an implicit output or ellipsis, not read here"
    for letters, x in zip(lhs.split(","), operands):
        for d in call.seq(x):
            if letters[d] not in rhs:
                return f"contracts over the sequence (index {letters[d]} of {call.shape(x)})"
    return None


def _norm_last(call: Call) -> str | None:
    """layer_norm / rms_norm over the last len(normalized_shape) dims."""
    x = call.args["input"]
    k = len(call.args.get("normalized_shape") or [])
    if any(d >= call.rank(x) - k for d in call.seq(x)):
        return f"normalizes over the sequence ({call.shape(x)} over its last {k} dims)"
    weight = [call.args.get(n) for n in ("weight", "bias")]
    if any(isinstance(w, torch.fx.Node) and call.seq(w) for w in weight):
        return "normalizes with a weight that carries the sequence"
    return None


def _batch_only(what: str) -> Callable[[Call], str | None]:
    """Ops that treat dim 0 as a batch and mix every other dim (conv, pooling, group norm)."""

    def rule(call: Call) -> str | None:
        for x in call.inputs:
            if any(d != 0 for d in call.seq(x)):
                return f"{what} ({call.shape(x)})"
        return None

    return rule


def _no_sequence(what: str) -> Callable[[Call], str | None]:
    return lambda call: f"{what} ({call.shape(_first_input(call) or call.node)})"


def _arange(call: Call) -> str | None:
    size = _tensors(call.node)[0].shape[0]
    tokens = call.local.sizes
    one_length = (isinstance(tokens, SymbolicSizes) and tokens.show(size) == "t") or (
        isinstance(tokens, StaticSizes) and size == tokens.n
    )
    if not one_length or call.args.get("step", 1) != 1:
        return (
            f"numbers {tokens.show(size)} elements with step {call.args.get('step', 1)}, which the runtime "
            f"does not shift to a rank's global positions (only step-1 aranges of the local length)"
        )
    return None


def _repeat(call: Call) -> str | None:
    x, repeats = call.args["self"], list(call.args.get("repeats") or [])
    shift = len(repeats) - call.rank(x)
    if any(int(repeats[d + shift]) != 1 for d in call.seq(x)):
        return f"repeats the sequence ({call.shape(x)} by {repeats})"
    return None


def _repeat_interleave(call: Call) -> str | None:
    x = call.args.get("self")
    dims = call.dims("dim", x)
    if dims is None or set(call.seq(x)) & dims:
        return f"repeats along the sequence ({call.shape(x)})"
    return None


def _pad(call: Call) -> str | None:
    x, pad = call.args["self"], list(call.args.get("pad") or [])
    n = call.rank(x)
    for d in call.seq(x):
        at = 2 * (n - 1 - d)
        if at < len(pad) and any(int(p) for p in pad[at : at + 2]):
            return f"pads the sequence ({call.shape(x)} by {pad})"
    return None


def _loss(call: Call) -> str | None:
    if int(call.args.get("reduction", 1)) != 0:
        return f"reduces a loss over the tokens ({call.shape(_first_input(call))}); a cp rank has only its own"
    x = _first_input(call)
    if 1 in call.seq(x) and call.rank(x) > 1:
        return f"takes the sequence for the classes ({call.shape(x)})"
    return None


def _attention(call: Call) -> str | None:
    """q, k, v with the sequence on dim 2 and nowhere else; the mask is the runtime's to refuse."""
    for arg in ("query", "key", "value"):
        x = call.args.get(arg)
        if call.seq(x) != (2,) or call.rank(x) != 4:
            return (
                f"attends with {arg} {call.shape(x)}: the ring splits q, k and v [batch, heads, t, head_dim] "
                f"along dim 2 only"
            )
    return None


POINTWISE = (
    "add sub rsub mul div true_divide floor_divide remainder fmod pow neg abs exp exp2 expm1 log log1p log2 "
    "log10 sqrt rsqrt reciprocal sign sgn sin cos tan tanh sinh cosh asin acos atan atan2 sigmoid logit relu "
    "relu6 leaky_relu gelu silu mish elu selu celu softplus softsign hardtanh hardswish hardsigmoid threshold "
    "erf erfc erfinv clamp clamp_min clamp_max clip minimum maximum fmin fmax where masked_fill lerp addcmul "
    "addcdiv eq ne lt le gt ge logical_and logical_or logical_not logical_xor bitwise_and bitwise_or "
    "bitwise_not bitwise_xor __and__ __or__ __xor__ __invert__ floor ceil round trunc frac isnan isinf "
    "isfinite nan_to_num square dropout native_dropout to _to_copy type_as clone contiguous detach alias "
    "lift_fresh_copy copy zeros_like ones_like full_like empty_like rand_like randn_like fill zero bernoulli "
    "polar"
).split()
LAYOUT = "transpose permute t movedim swapaxes swapdims unsqueeze squeeze".split()
VIEWS = "view _unsafe_view reshape flatten unflatten view_as".split()
CONSTANTS = (
    "full zeros ones empty empty_strided empty_permuted scalar_tensor rand randn randint new_zeros "
    "new_ones new_full new_empty"
).split()
_REDUCE = "reduces over the sequence"
_TAKE = "takes some of the tokens"
RULES: dict[str, Callable[[Call], str | None]] = {
    **{op: _pointwise for op in POINTWISE},
    **{op: _layout for op in LAYOUT},
    **{op: _view for op in VIEWS},
    **{op: _constant for op in CONSTANTS},
    "expand": _expand,
    "expand_as": _expand,
    "view_as_real": _leading,
    "view_as_complex": _leading,
    "stack": _stack,
    **{
        op: _along(_REDUCE)
        for op in (
            "sum nansum mean nanmean amax amin max min argmax argmin var std var_mean "
            "std_mean logsumexp prod norm linalg_vector_norm any all count_nonzero "
            "median nanmedian mode kthvalue"
        ).split()
    },
    **{
        op: _along("normalizes over the sequence", whole_if_none=False)
        for op in ("softmax _softmax log_softmax _log_softmax _safe_softmax").split()
    },
    **{
        op: _along("accumulates along the sequence", whole_if_none=False)
        for op in "cumsum cumprod cummax cummin logcumsumexp diff".split()
    },
    **{op: _along("orders along the sequence", whole_if_none=False) for op in "sort argsort topk".split()},
    **{
        op: _along(_TAKE, whole_if_none=False)
        for op in "select narrow index_select split split_with_sizes unsafe_split chunk unbind glu".split()
    },
    "flip": _along("reverses the sequence", name="dims"),
    "roll": _along("rolls the sequence", name="dims"),
    "unfold": _along("makes windows along the sequence", name="dimension"),
    "tril": _no_sequence("masks by position within the rank's tokens"),
    "triu": _no_sequence("masks by position within the rank's tokens"),
    "linspace": _no_sequence("spaces points over the local length"),
    "slice": _slice,
    "cat": _cat,
    "concat": _cat,
    "concatenate": _cat,
    "index": _index,
    "gather": _gather,
    "take_along_dim": _gather,
    "embedding": _embedding,
    "linear": _linear,
    "mm": _contract(lambda n: {1}, lambda n: {0}, "self", "mat2"),
    "addmm": _contract(lambda n: {1}, lambda n: {0}, "mat1", "mat2"),
    "bmm": _contract(lambda n: {2}, lambda n: {1}, "self", "mat2"),
    "baddbmm": _contract(lambda n: {2}, lambda n: {1}, "batch1", "batch2"),
    "matmul": _contract(lambda n: {n - 1}, lambda n: {max(n - 2, 0)}, "self", "other"),
    "mv": _contract(lambda n: {1}, lambda n: {0}, "self", "vec"),
    "dot": _contract(lambda n: {0}, lambda n: {0}, "self", "tensor"),
    "outer": _contract(lambda n: set(), lambda n: set(), "self", "vec2"),
    "einsum": _einsum,
    "layer_norm": _norm_last,
    "native_layer_norm": _norm_last,
    "rms_norm": _norm_last,
    "_fused_rms_norm": _norm_last,
    **{
        op: _batch_only("convolves or pools over the sequence")
        for op in (
            "convolution _convolution conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d "
            "max_pool1d max_pool2d max_pool3d max_pool2d_with_indices max_pool3d_with_indices avg_pool1d "
            "avg_pool2d avg_pool3d adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d "
            "adaptive_max_pool1d adaptive_max_pool2d _adaptive_avg_pool2d upsample_nearest1d "
            "upsample_linear1d upsample_nearest2d upsample_bilinear2d reflection_pad1d reflection_pad2d "
            "replication_pad1d replication_pad2d"
        ).split()
    },
    **{op: _batch_only("normalizes over the sequence") for op in "group_norm native_group_norm instance_norm".split()},
    **{
        op: _no_sequence("normalizes over the batch and the sequence")
        for op in (
            "batch_norm native_batch_norm _native_batch_norm_legit _native_batch_norm_legit_no_training "
            "_native_batch_norm_legit_functional"
        ).split()
    },
    "arange": _arange,
    "repeat": _repeat,
    "repeat_interleave": _repeat_interleave,
    "constant_pad_nd": _pad,
    **{
        op: _loss
        for op in (
            "cross_entropy_loss nll_loss nll_loss_nd nll_loss2d mse_loss l1_loss smooth_l1_loss "
            "huber_loss binary_cross_entropy binary_cross_entropy_with_logits kl_div"
        ).split()
    },
}
