"""Planning: the configurations (strategies), the tensor-parallel layouts, context parallelism, stage
cuts and per-block recompute, searched jointly on the cost model (search)."""
