"""The tensor- and context-parallel layout models, beneath capturing and planning: capturing's TP and CP proofs
check the layouts these models would choose on the model's own code, planning's search chooses among the proven
ones (``passes.planning.tp_layout`` hands them to the cost tables).

    rules              the layouts R, S, P (Q, G, H), ``Rule``, shard dims s(v), segments, the rules on shards
    sequence           sequence parallelism: sequence dims q(v), the sequence-parallel rules, module gathers
    allowed            the rules an op may take at tp (less what the TP proof refused), divisibility
    segment_model      the CP-SAT segment model: op choice, layouts, edge transitions, objective, ``solve_segment``
    boundary           the sequence-parallel boundary: crossing classes, scatter candidates, ``sp_boundary``
    styles             ``choose_tp_styles``: styles per module, and the reasons a module stays replicated
    context_parallel   the CP constants (``CP_MAX``, ``CP_SEARCH_MIN_TOKENS``), ``DEFERRED`` and ``proof_deferred``
"""
