"""Planning: the configurations (strategies), the tensor-parallel layouts of ``passes.layouts`` handed to the cost
tables (tp_layout), context parallelism, stage cuts and per-block recompute, searched jointly on the cost model
(search)."""
