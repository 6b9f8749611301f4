"""Context parallelism on the graph: which cp degrees the model can run, and why not the others.

A cp plan gives each rank s/cp tokens of every sample (a head-tail pair of chunks where s is a multiple of
2cp, else consecutive ones: ``ir.decisions.cp_load_balanced``) and runs the model's own code on
them (``runtime.context_parallel``): attention becomes a ring over the cp ranks, and every
``torch.arange`` of the local length s/cp becomes the rank's global positions (how the model's code
numbers its tokens for position embeddings, both examples/gpt.py's ``arange(0, t)`` and transformers'
``cache_position``). What must hold on the captured graph (sequence length s, ``cp_refusal``):

    a sequence           the model has tokens (``graph.tokens_per_sample`` = s > 1) and s mod cp = 0
    attention            at least one scaled-dot-product attention, every one over s queries and s keys
                         (self-attention along the sequence: what the ring splits), without attention
                         dropout (the ring's kernels run each block alone; GPT-2's attn_pdrop must be 0)
    positions            no ``arange`` of length s/cp (< s) in the graph: at run time the runtime would
                         take it for the local positions; an arange of length s is the positions
    no position tables   no slice of s rows out of a tensor the tokens do not flow into (a buffer of
                         precomputed rotary angles, ``rope_cos[:s]``): a cp rank's code would take rows
                         0 .. s/cp − 1, the first rank's positions (``table_slices``)
    inside a pipeline    (pp > 1, ``pipeline_cp_refusal``) every attention of the captured graph takes no
                         explicit mask: a pipeline's stages are traced graphs, which call attention with the
                         mask the model built while traced, and the ring takes none; or, where it does (a
                         transformers model under "sdpa"), the cp proof's step 6 shows that traced under the
                         ring's attention key (``runtime.context_parallel.use_cp_attention``) none does

What the runtime checks as it runs (the captured graph cannot show it): attention gets no explicit
mask (transformers builds its causal mask only when tracing; at run time it passes ``is_causal``), and
no attention dropout while training. That a rank passing ``is_causal`` computes what one process does is
the proof's (step 5): the mask one process applies at s tokens is computed and must be the causal one
(a sliding window shorter than s is refused: a rank's s/cp tokens fit the window, and its code skips it).
"""

from __future__ import annotations

from autoshard.cost.context_parallel import attention_nodes
from autoshard.ir.graph import OpGraph
from autoshard.passes.layouts.context_parallel import CP_MAX, CP_SEARCH_MIN_TOKENS

ARANGE_TARGET = "aten.arange"


def cp_refusal(graph: OpGraph, cp: int) -> str | None:
    """Why ``cp`` cannot split this model's sequences (module doc), or None. After the sequence's own
    conditions, the proof of ``passes.capturing.cp_proof`` (``graph.cp_proofs``: whether the model's code on a rank's
    s/cp tokens computes its share; a hand-built graph has none) decides before the graph checks."""
    if cp == 1:
        return None
    s = graph.tokens_per_sample
    if s <= 1:
        return "the model has no sequence dimension to split"
    if s % cp:
        return f"the sequence length {s} is not a multiple of cp={cp}"
    if graph.cp_proofs is not None:  # str(cp) -> reason, "*" for every degree without its own; "" = proven
        unproven = graph.cp_proofs.get(str(cp), graph.cp_proofs.get("*", "")).replace("{cp}", str(cp))
        if unproven:
            return unproven
        if s // cp < 2:
            return f"a cp={cp} rank would hold {s // cp} of the {s} tokens; the proof covers 2 or more"
    attentions = attention_nodes(graph)
    if not attentions:
        return "the model has no scaled-dot-product attention for a ring to split"
    cross = [n.name for _, n in attentions if len(n.shape) < 3 or n.shape[-2] != s]
    if cross:
        return f"attention {cross[0]} does not run over the {s} tokens of the sequence"
    dropping = [n for _, n in attentions if n.attrs.get("dropout_p")]
    if dropping:
        return (
            f"attention {dropping[0].name} drops out with p={dropping[0].attrs['dropout_p']}, which the ring's "
            f"kernels do not (set the model's attention dropout to 0)"
        )
    tables = table_slices(graph)
    if tables:
        return (
            f"{tables[0]} slices {s} rows out of a table the tokens do not flow into (precomputed positions?); "
            f"a cp rank would take the first rank's rows"
        )
    local = s // cp
    clash = [n.name for n in graph.nodes if n.target.startswith(ARANGE_TARGET) and n.shape == (local,)]
    if clash:
        return f"{clash[0]} is an arange of {local} elements, which a cp={cp} rank would take for its token positions"
    return None


def pipeline_cp_refusal(graph: OpGraph) -> str | None:
    """Why cp cannot run inside this model's pipeline stages (module doc, "inside a pipeline"), or None. The
    capture records an attention's ``attn_mask`` only when the call passes none (a mask is a tensor input).
    Where the captured graph's attention takes a mask, the cp proof's step 6 (``cp_proofs["pipeline"]``: the
    model traced as a cp pipeline traces it, under the ring's attention key) decides; without it, refused."""
    masked = [n.name for _, n in attention_nodes(graph) if n.attrs.get("attn_mask", "a tensor") is not None]
    proven = (graph.cp_proofs or {}).get("pipeline")
    if masked and proven is not None:
        return proven or None
    if masked:
        return (
            f"attention {masked[0]} takes an explicit mask when traced (transformers builds its causal mask "
            f"whenever torch.export traces it, and pipeline stages are traced graphs), which the ring cannot split"
        )
    return None


SLICE_TARGETS = ("aten.slice", "aten.narrow")


def table_slices(graph: OpGraph) -> list[str]:
    """Slices of s rows (s the sequence length) out of values no model input and no arange of length s flows
    into (module doc, "no position tables")."""
    s, token_derived = graph.tokens_per_sample, set(graph.input_names)
    found = []
    for node in graph.nodes:
        if any(i in token_derived for i in node.inputs) or (
            node.target.startswith(ARANGE_TARGET) and node.shape == (s,)
        ):
            token_derived.add(node.name)
        elif (
            node.target.startswith(SLICE_TARGETS)
            and node.shape
            and node.shape[node.attrs.get("dim", 0) % len(node.shape)] == s
        ):
            found.append(node.name)
    return found


def searched_cp_degrees(graph: OpGraph, ranks: int) -> list[int]:
    """cp > 1 the search offers on ``ranks`` ranks (dp·cp): each divisor up to CP_MAX the model can run,
    for sequences of at least CP_SEARCH_MIN_TOKENS tokens."""
    if graph.tokens_per_sample < CP_SEARCH_MIN_TOKENS:
        return []
    return [c for c in range(2, min(ranks, CP_MAX) + 1) if ranks % c == 0 and cp_refusal(graph, c) is None]
