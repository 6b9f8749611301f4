"""What a model's own dtype casts do when a graph captured in fp32 trains with 16-bit activations.

The graph is captured in the dtype the model is built in (fp32), where ``x.to(torch.float32)`` and
``y.to(input_dtype)`` change nothing: the capture records them as casts to fp32 of fp32 values, and the
cost model read them as views. A program that trains under bf16 autocast or on bf16 parameters runs the
activations in 16 bits (``cost.memory`` ``Precision.activation_bytes``), and there the same casts copy.
transformers' norms are the common case (LlamaRMSNorm and its copies)::

    h  = x.to(fp32)               x 16-bit: an fp32 copy, 4 B per element   pow and mul keep it
    h2 = h * rsqrt(mean(h²) + ε)  fp32 (computed from fp32)
    h3 = h2.to(input_dtype)       captured as a cast to fp32 of fp32: the cast back, a 16-bit copy
    y  = w * h3                   keeps h3 (2 B per element)

so a rank keeps 6 B per element of a norm's input where views would price 2.

The capture cannot tell a no-op cast's output from its input: ``x.to(torch.float32)`` of an fp32 ``x``
returns ``x`` itself, so every later use of ``x`` (the residual add after the norm) reads the cast's node.
An op's output is therefore upcast only where every floating activation it reads is (type promotion would
make it fp32 where any is; here a 16-bit reader says the upcast input stands for the original ``x``). The
rules, in graph order, over the values an explicit upcast made (``upcast``):

    cast to fp32 of a 16-bit activation       an fp32 copy; the value is upcast
    cast to fp32 of an upcast value           the model's cast back to its input's dtype: a 16-bit copy
    cast to fp32 of integers (positions)      upcast
    an op with dtype=float32 (softmax, sum)   its output upcast (``softmax(w, dtype=torch.float32)``)
    any other op                              upcast where every floating activation it reads is: the
                                              norm's statistics and product, rotary tables made from fp32
                                              positions; 16-bit where any is 16-bit (a matmul's output,
                                              the residual add)

A cast of a parameter or buffer is state, not an activation, and is left as it is. The capture cannot tell
``.to(torch.float32)`` from ``.to(t.dtype)`` of an fp32 ``t``: the rule above reads a cast of an upcast value as
the cast back, which is what norms and ``softmax(..., dtype=torch.float32).to(q.dtype)`` write. Values computed
only from 16-bit activations stay 16-bit, as before (the fp32 residual stream of DDP under autocast is not
modelled here). A graph captured in 16 bits (a model built in bf16) holds its real casts and needs none of this.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.cost.autocast import FLOATING
from autoshard.ir.graph import OpGraph
from autoshard.ir.names import op_name

EXPLICIT_CASTS = frozenset({"to", "_to_copy", "type_as"})  # the CAST_OPS that take a dtype
FP32 = "float32"


@dataclass(frozen=True)
class SixteenBitCasts:
    """Of a graph captured in fp32 and run with 16-bit activations: ``upcast`` the values that run in fp32
    (4 B per element where the others take 2), ``copies`` the casts that copy at run time (not views)."""

    upcast: frozenset[str] = frozenset()
    copies: frozenset[str] = frozenset()


def sixteen_bit_casts(graph: OpGraph) -> SixteenBitCasts:
    """``SixteenBitCasts`` of ``graph`` by the module doc's rules; computed once per graph."""
    return graph.derived(("sixteen_bit_casts",), lambda: _walk(graph))


def _walk(graph: OpGraph) -> SixteenBitCasts:
    upcast: set[str] = set()
    copies: set[str] = set()
    state = set(graph.placeholder_params)  # parameters, buffers and what is computed from them alone
    for node in graph.nodes:
        acts = [i for i in node.inputs if i not in state]  # the model's inputs among them
        if not acts and node.inputs:
            state.add(node.name)
        if node.dtype != FP32 or not acts:
            continue
        floating = [i for i in acts if _dtype(graph, i) in FLOATING]
        if op_name(node.target) in EXPLICIT_CASTS and _casts_to_fp32(graph, node):
            if not floating:
                upcast.add(node.name)  # ids or positions made floating: fp32 in any precision
            elif floating[0] in upcast:
                copies.add(node.name)  # the cast back
            else:
                copies.add(node.name)
                upcast.add(node.name)
        elif node.attrs.get("dtype") == FP32 or (floating and all(i in upcast for i in floating)):
            upcast.add(node.name)
    return SixteenBitCasts(frozenset(upcast), frozenset(copies))


def _dtype(graph: OpGraph, name: str) -> str:
    try:
        return graph.value_meta(name)[1]
    except KeyError:  # an input captured without metadata
        return ""


def _casts_to_fp32(graph: OpGraph, node) -> bool:
    """Whether ``node`` is an explicit cast to fp32 (``to(dtype=float32)``, ``type_as`` an fp32 tensor)."""
    if op_name(node.target) == "type_as":
        return len(node.inputs) > 1 and _dtype(graph, node.inputs[1]) == FP32
    return node.attrs.get("dtype") == FP32
