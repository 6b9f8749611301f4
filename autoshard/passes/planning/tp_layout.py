"""The TP layout of a search point: solved once per (tp, micro-batch size per rank), handed to the cost tables.

The cost model prices decisions with a layout handed to it and never solves one
(``cost.tables.CostTables.add_tp_layout``). This pass solves the layout model
(``passes.layouts.styles.choose_tp_styles``) at the captured batch on the link that makes the
answer exact for micro-batch b (``CostTables.tp_solve_link``), the first time a point of that
(tp, b) is priced, and hands it over; later points of the same (tp, b) reuse it.
"""

from __future__ import annotations

from autoshard.cost.tables import CostTables
from autoshard.ir.decisions import Decisions, TPChoice
from autoshard.passes.layouts.loss import loss_parallel_layout
from autoshard.passes.layouts.styles import choose_tp_styles


def hand_tp_layout(tables: CostTables, decisions: Decisions) -> TPChoice | None:
    """The layout ``decisions`` are priced with, in ``tables`` from now on; None without TP. With
    ``sequence_parallel`` the layout model may put the regions between the parallel linears on 1/tp of
    the tokens; the choice says whether it did (a model where it cannot keeps them whole). With ``loss_parallel``
    the same layout with the output projection's logits left on vocabulary shards (``passes.layouts.loss``), or the
    layout without it where it does not apply (the search then drops the point: ``choice.loss_parallel`` False)."""
    tp, b = decisions.mesh.tp, decisions.microbatch_size / decisions.mesh.cp  # a cp rank: b/cp samples' tokens
    sp, lp = decisions.sequence_parallel, decisions.loss_parallel
    if tp == 1:
        return None
    if not tables.has_tp_layout(tp, b, sp):
        link = tables.tp_solve_link(tp, b)
        choice = choose_tp_styles(tables.graph, tp, link, tables.cluster.device, sequence_parallel=sp)
        tables.add_tp_layout(choice, b, sp, False)
    if lp and not tables.has_tp_layout(tp, b, sp, lp):
        gathered = tables.tp_cost(tp, b, sp).choice
        choice, _ = loss_parallel_layout(tables.graph, gathered, tables.tp_solve_link(tp, b))
        tables.add_tp_layout(choice or gathered, b, sp, lp)
    return tables.tp_cost(tp, b, sp, lp).choice
