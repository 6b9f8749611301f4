"""Context parallelism's constants that capture's CP proof and planning's search share.

The search offers cp only for sequences of ``CP_SEARCH_MIN_TOKENS`` tokens or more (or where ``--cp`` is
pinned) and up to ``CP_MAX``; the CP proof (``passes.capturing.cp_proof``) runs where the search would offer
cp, and elsewhere records ``DEFERRED`` (``proof_deferred``), which ``passes.planning.context_parallel.cp_refusal``
then gives for every cp.
"""

from __future__ import annotations

from autoshard.ir.graph import OpGraph

CP_SEARCH_MIN_TOKENS = 16_384  # shorter sequences search cp only when pinned (one sample's activations fit
#                               a device with TP, SP and recompute below this; cp then only adds the ring)
CP_MAX = 64  # the largest cp the search offers (torchtitan's and Llama 3's long-context runs use 8 to 32)
# cp_proofs of a capture that left the proof for later (passes.capturing.cp_proof, "Deferred"): every cp refused
DEFERRED = (
    f"the context-parallel proof runs where the search offers cp (sequences of {CP_SEARCH_MIN_TOKENS:,} "
    f"tokens or more) or --cp is pinned; fix: pin --cp N"
)


def proof_deferred(graph: OpGraph) -> bool:
    """The capture left the context-parallel proof for later (``DEFERRED``)."""
    return graph.cp_proofs == {"*": DEFERRED}
