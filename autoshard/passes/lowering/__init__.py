"""Lowering: a plan becomes the ordered apply steps (lower) and a readable program (codegen)."""
