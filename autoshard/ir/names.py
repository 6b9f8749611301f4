"""Names in a captured graph: an op target's table key, the block a module path belongs to.

Plain string functions that the passes and the cost model both read a graph by::

    op_name("aten.add_.Tensor")  -> "add"      (in-place variants look up as their op)
    block_of("h.3.mlp.0")        -> "h.3"      (the outermost "<prefix>.<int>" prefix)
"""

from __future__ import annotations


def op_name(target: str) -> str:
    """The table key of a target: "aten.add_.Tensor" -> "add"; non-aten targets stay whole."""
    if not target.startswith("aten."):
        return target
    name = target.split(".")[1]
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def block_of(module_path: str) -> str | None:
    """The outermost "<prefix>.<int>" prefix of a module path: "h.3.mlp.0" -> "h.3"; None if none."""
    parts = module_path.split(".") if module_path else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return None
