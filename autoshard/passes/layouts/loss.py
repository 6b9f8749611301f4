"""Loss parallelism: the output projection's logits left sharded on the vocabulary and the cross-entropy computed
on the shards (torch's ``loss_parallel``; Megatron-LM's vocab-parallel cross-entropy).

**Where it applies** (``output_projection``): the model's output (the last op of its graph, the value the loss
reads) is the output of a linear with a weight of V rows, reached only through elementwise ops that read nothing
but the value before them (logit scaling, soft-capping ``c·tanh(z/c)``, a cast): each of them on a vocabulary
shard is its own slice of the whole. ``passes.capturing.tp_proof`` (``prove_loss_parallel``) adds what the graph
cannot show: the loss is the model file's default cross-entropy on integer targets.

**The layout** (``loss_parallel_layout``): from a TP layout that splits the projection's weight on the vocabulary
and gathers its output (``colwise-gather``, or ``colwise-gather-seq-input-dim{d}`` with sequence parallelism),
the same weight split with the output left a vocabulary shard (``colwise-loss-parallel``). Per micro-batch of
T tokens (captured batch, the layout's link), with logits of L = T·V elements of e bytes:

    gather-whole:   all_gather(L·e)                                    (the logits whole on every rank)
    loss parallel:  3 · all_reduce(T · 4)                             (max, Σ exp, the target logit; fp32)

and a rank keeps L/tp of the logits and of the loss's log-softmax in place of L (``cost.memory.output_bytes``).
"""

from __future__ import annotations

from dataclasses import replace

from autoshard.cost.comm import all_gather_s, allreduce_s
from autoshard.ir.decisions import LOSS_PARALLEL, SegmentCost, TPChoice
from autoshard.ir.graph import OpGraph, OpNode
from autoshard.ir.names import op_name
from autoshard.passes.layouts.rules import ELEMENTWISE_OPS, LINEAR_OPS, consumer_map

# ops that act on each logit alone (with constants): on a vocabulary shard each gives its own slice of the whole
PASSING_OPS = {"to", "_to_copy", "alias", "clone", "contiguous"}  # a cast or a copy
LOGIT_ELEMENTWISE_OPS = (ELEMENTWISE_OPS - {"masked_fill", "where"}) | PASSING_OPS
LOSS_ALLREDUCES = 3  # per token: the max logit, Σ exp, the target logit
LOSS_STAT_BYTES = 4  # each an fp32 number per token
GATHERED_PREFIX = "colwise-gather"


def output_projection(graph: OpGraph) -> tuple[str, str]:
    """(the output projection's linear node, "") where the model's output is its logits after elementwise ops
    only (module doc), else ("", why not)."""
    if not graph.nodes:
        return "", "the model has no ops"
    node, readers = graph.nodes[-1], consumer_map(graph)
    while op_name(node.target) not in LINEAR_OPS:
        if op_name(node.target) not in LOGIT_ELEMENTWISE_OPS:
            return "", f"the model's output comes from {_where(node)}, not from a linear through elementwise ops"
        if len(node.inputs) != 1 or node.inputs[0] in graph.placeholder_params:
            return "", f"{_where(node)} after the output projection reads another tensor beside its logits"
        producer = graph._by_name().get(node.inputs[0])
        if producer is None:
            return "", "the model's output is not computed from a linear"
        if readers.get(producer.name, []) != [node.name]:
            return "", f"{_where(producer)} is read by other ops than the next elementwise one"
        node = producer
    weight = [p for p in node.param_inputs if p.endswith("weight")]
    if len(weight) != 1 or len(graph.param(weight[0]).shape) != 2:
        return "", f"the output projection {_where(node)} has no 2-D weight"
    vocab = graph.param(weight[0]).shape[0]
    if node.shape[-1:] != (vocab,) or graph.nodes[-1].shape[-1:] != (vocab,):
        return "", f"the model's output is not the projection's {vocab} logits per token"
    return node.name, ""


def _where(node: OpNode) -> str:
    return f"{op_name(node.target)} ({node.module_path or 'the model'})"


def loss_parallel_layout(graph: OpGraph, choice: TPChoice, link) -> tuple[TPChoice | None, str]:
    """(``choice`` with the output projection's gathered output left a vocabulary shard, its collectives
    repriced on ``link`` (module doc), "") or (None, why not)."""
    name, why = output_projection(graph)
    if not name:
        return None, why
    node = graph.node(name)
    style = choice.styles.get(node.module_path, "replicate")
    if not style.startswith(GATHERED_PREFIX):
        return None, f"the TP layout keeps the output projection {node.module_path} {style}, not column-parallel"
    rest = [s for s in choice.segments if s.path == ""]
    if len(rest) != 1:
        return None, f"the output projection {node.module_path} is priced inside a block"
    tokens = node.output_numel // node.shape[-1]
    gather_s = all_gather_s(graph.value_bytes(name), choice.tp, link)
    reduce_s = LOSS_ALLREDUCES * allreduce_s(tokens * LOSS_STAT_BYTES, choice.tp, link)
    segment = rest[0]
    priced = SegmentCost(
        "",
        segment.repeats,
        segment.compute_s,
        max(segment.comm_s - gather_s + reduce_s, 0.0),
        max(segment.comm_bytes - graph.value_bytes(name), 0) + LOSS_ALLREDUCES * tokens * LOSS_STAT_BYTES,
    )
    sharded = LOSS_PARALLEL + style[len(GATHERED_PREFIX) :]
    reason = (
        f"loss parallelism: its {node.shape[-1]} logits per token stay sharded on the vocabulary and the "
        f"cross-entropy runs on the shards ({LOSS_ALLREDUCES} all-reduces of one fp32 number per token in place "
        f"of the all-gather of the logits)"
    )
    return (
        replace(
            choice,
            styles={**choice.styles, node.module_path: sharded},
            reasons={**choice.reasons, node.module_path: reason},
            segments=[priced if s is segment else s for s in choice.segments],
        ),
        "",
    )
