"""CP proof: context parallelism is accepted only where each rank's program computes its share.

A cp plan (``runtime.context_parallel``) gives rank r s/cp tokens of every sample (contiguous, or a head-tail
pair of chunks: any subset of the tokens in any order is proven alike, below) and runs the model's own Python
code on them; ``ContextParallelMode`` makes attention a ring over the cp
ranks and shifts every ``torch.arange`` of the local length to the rank's global positions. That is the
one-process computation only if every other op works token by token: a cumsum or a mean over the
sequence, a pooler that takes token 0, a label shift ``x[:, :-1]``, a conv over the tokens or a slice of a
precomputed position table would each train silently wrong. ``passes.planning.context_parallel.cp_refusal`` reads
the captured graph; this pass runs the model's code on a rank's share and reads what it computes.

0. **The attention switch** (``attention_switch_refusal``): a transformers part must take the ring's attention
   key (built with "sdpa", its code reading transformers' ``AttentionInterface``); the cp program switches it
   first, and under that key transformers builds no mask at all (so the positions of head-tail chunks, which
   jump, are not read as packed sequences). The proof below runs on the "sdpa" model: step 5 is what makes
   dropping the mask exact.
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

6. **The program a cp rank runs** (``stage_mask_refusal``, once some degree passes 1-5): a transformers model is
   exported under the ring's attention key (what a cp rank runs, eagerly or as a pipeline's traced stages) and
   every attention checked for ``attn_mask=None, is_causal=True``; a model that still passes a mask there is
   refused for every degree. ``cp_proofs["pipeline"] = ""`` records it for
   ``passes.planning.context_parallel.pipeline_cp_refusal``.

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

import re
import sys
from typing import Any

import torch
import torch.fx

from autoshard.cost.compute import SDPA_TARGET
from autoshard.ir.graph import OpGraph
from autoshard.ir.names import op_name
from autoshard.modelfile import ModelFile
from autoshard.passes.capturing.capture import build_on_meta, quiet_export, target_name
from autoshard.passes.capturing.cp_local import (
    Local,
    StaticSizes,
    SymbolicSizes,
    bound_args,
    is_sdpa,
    show_shape,
    tensors,
    walk,
    where,
)
from autoshard.passes.capturing.cp_mixing import mixing
from autoshard.passes.capturing.fold import fold_model
from autoshard.passes.layouts.context_parallel import CP_MAX, CP_SEARCH_MIN_TOKENS, DEFERRED
from autoshard.runtime.context_parallel import cp_attention_refusal, use_cp_attention

ALL = "*"  # the cp_proofs key of every degree without its own entry


MIN_LOCAL = 2  # the shortest local length proven (export specializes lengths 0 and 1)


NO_SEQUENCE = "the model has no sequence dimension to split"


NO_ATTENTION = "the model has no scaled-dot-product attention for a ring to split"


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
    why = attention_switch_refusal(model_file)
    if why:
        return {ALL: why}
    proofs = local_proofs(model_file, graph)
    if "" in proofs.values():  # some degree's rank computes its share: then one process must mask causally
        why = mask_refusal(model_file, graph) or stage_mask_refusal(model_file, graph)
        if why:
            return {ALL: why}
        proofs[PIPELINE] = ""
    return proofs


PIPELINE = "pipeline"  # the cp_proofs key of cp inside pipeline stages (step 6): "" where their traced attention
# takes no mask


def stage_mask_refusal(model_file: ModelFile, graph: OpGraph) -> str:
    """Step 6: why the program a cp rank runs would not call attention as the ring does, or "". Steps 1-5 prove
    the model's "sdpa" program, which builds a mask while traced (transformers always does); a cp rank runs it
    under the ring's attention key (``use_cp_attention``, applied first, before a pipeline's split too), which
    builds none, and a pipeline stage is a traced graph that calls attention as the trace saw it. So that
    program is exported statically at s/2 tokens of one sample, under the key, and every attention must take no
    mask and be causal (step 5 proved the causal mask the one process's): then the eager SPMD program and the
    traced stages alike attend as the ring does. A model whose own attention passes a mask, or one whose code
    branches on its attention key into something else, is refused for every degree (the runtime would refuse the
    mask mid-run). Where the capture shows no mask, nothing to prove."""
    masked = [n for n in graph.nodes if n.target.startswith(SDPA_TARGET) and n.attrs.get("attn_mask", "") is not None]
    if not masked:
        return ""
    why = (
        f"attention {masked[0].name} takes an explicit mask when traced (pipeline stages are traced graphs), "
        f"which the ring cannot split"
    )
    if "transformers" not in sys.modules:
        return why
    s = graph.tokens_per_sample
    try:
        program = export_local(model_file, graph, s // 2, symbolic=False, batch=1, cp_attention=True)
    except Exception as exc:
        return f"{why}; traced under the ring's attention key it fails ({_why_not(exc)})"
    for sdpa in walk(program.graph_module):
        args = bound_args(sdpa) if is_sdpa(sdpa) else {}
        if args and (args.get("attn_mask") is not None or not args.get("is_causal")):
            return f"{where(sdpa)} takes a mask or is not causal when traced under the ring's attention key"
    return ""


def attention_switch_refusal(model_file: ModelFile) -> str | None:
    """Step 0: a transformers model (or a model file holding one) must take the ring's attention key
    (``runtime.context_parallel.use_cp_attention``, which a cp program applies first); why not, or None. Only
    where transformers is loaded: a model file without it has nothing to switch."""
    if "transformers" not in sys.modules:
        return None
    return cp_attention_refusal(build_on_meta(model_file))


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


def export_local(
    model_file: ModelFile,
    graph: OpGraph,
    length: int,
    symbolic: bool,
    batch: int | None = None,
    cp_attention: bool = False,
):
    """The model's program on ``length`` of the s tokens (symbolic: any length 2 .. s/2, hint ``length``), on
    the captured batch or ``batch`` samples; ``cp_attention``: under the ring's attention key, as a cp program
    runs it (``runtime.context_parallel.use_cp_attention``)."""
    model = build_on_meta(model_file)
    if cp_attention:
        use_cp_attention(model)
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


def refusal(graph: OpGraph, local: Local, tokens: str) -> str | None:
    """Steps 2-4 on one local program; None when it computes every rank's share."""
    why = compare_with_capture(graph, local, tokens)
    if why:
        return why
    why = mask_from_inputs(local)
    if why:
        return why
    for node in local.nodes:
        if node.op != "call_function" or node in local.exempt or not tensors(node):
            continue
        if node in local.bad:
            return f"{where(node)} {local.bad[node]}"
        why = mixing(node, local)
        if why:
            return f"{where(node)} {why}"
    return None


def compare_with_capture(graph: OpGraph, local: Local, tokens: str) -> str | None:
    """Step 2: the same ops as the captured graph, in order, with the captured shapes at t = s."""
    captured = [n for n in graph.nodes if n.dtype]
    ours = local.top()
    sizes, s = local.sizes, graph.tokens_per_sample
    for i, node in enumerate(captured):
        if i >= len(ours) or target_name(ours[i].target) != node.target:
            found = where(ours[i]) if i < len(ours) else "nothing"
            return (
                f"the model's code takes another path on {tokens} tokens: {found} where the captured "
                f"graph has {op_name(node.target)} in {node.module_path or 'the root'}"
            )
        mine = tensors(ours[i])[0]
        if isinstance(sizes, SymbolicSizes) and ours[i] not in local.exempt:
            at_s = tuple(sizes.at_s(d) for d in mine.shape)
            if at_s != tuple(node.shape):
                return (
                    f"{where(ours[i])} gives shape {show_shape(ours[i], local)} on t tokens, which is not the "
                    f"captured {list(node.shape)} at t = {s} (the model's code takes another path)"
                )
    if len(ours) > len(captured):
        return f"the model's code takes another path on {tokens} tokens: {where(ours[len(captured)])}"
    return None


def mask_from_inputs(local: Local) -> str | None:
    """An attention mask computed from a model input (a padding mask): the ring cannot take it."""
    signature = local.program.graph_signature
    inputs = set(signature.user_inputs)
    for node in local.program.graph.nodes:
        if not is_sdpa(node) or not isinstance(bound_args(node).get("attn_mask"), torch.fx.Node):
            continue
        seen, todo = set(), [bound_args(node)["attn_mask"]]
        while todo:
            x = todo.pop()
            if x in seen:
                continue
            seen.add(x)
            if x.op == "placeholder" and x.name in inputs:
                return (
                    f"{where(node)} takes a mask computed from the model input {x.name} (a padding mask?), "
                    f"which the ring cannot split along the sequence"
                )
            todo += [a for a in x.all_input_nodes if tensors(a)]  # data, not sizes read (sym_size)
    return None


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
        mask = bound_args(sdpa).get("attn_mask") if is_sdpa(sdpa) else None
        if isinstance(mask, torch.fx.Node):
            why = _mask_value(mask, s)
            if isinstance(why, str):
                return f"{where(sdpa)}: {why}"
            why = _not_causal(why, s)
            if why:
                return (
                    f"{where(sdpa)} masks its {s} tokens other than causally ({why}), while "
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
        big = [t for t in tensors(node) if t.numel() > MASK_BUDGET]
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
