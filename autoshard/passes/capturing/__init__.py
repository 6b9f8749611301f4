"""Capture and proofs: a model file becomes an annotated OpGraph (capture, annotate, fold, blocks,
experts), with what the model's own code proves about it (batch coupling, the TP and CP proofs)."""
