"""The schema of ``plan.json``: every field a reader or the code generator uses, checked on load.

A plan is a review artifact and the input of the code generator: its names and numbers are
written into the emitted program and into ``inspect``'s tables. A plan read from disk is
therefore checked field by field before it becomes a ``Plan``, so that a damaged or tampered
file is one ``AutoshardError`` naming the field, never a crash in ``inspect`` / ``compile`` and
never code in the emitted program:

    module paths   blocks, split_points, stages[].modules,     dotted names, each part of
                   tensor_parallel keys, reasons keys          letters, digits, _ and -
    names          model.spec, cluster.name, precision,        one printable line without
                   pinned[]                                    quotes, backslashes or brackets
    fingerprint    model.hash                                  hexadecimal
    counts         global_batch, microbatch_size, ...          integers (never booleans), 1 .. 2^40
    sizes          model.params, predicted.memory.*_bytes      integers 0 .. 2^60 (1 EiB)
    times, rates   predicted.*_s, *_per_s, mfu                 finite numbers 0 .. 1e30
    search         search.*                                    numbers of at most 1e30 in size
    choices        zero_stage, recompute, schedule, TP styles  one of the known values
    cluster        cluster                                     ``Cluster.from_dict`` (its own checks)
    ranks          mesh dp·tp·pp <= the cluster's devices; stage ranks in 0 .. dp·tp·pp − 1
    prose          alternatives[].why_not, reasons, notes      strings

Unknown keys are ignored, so a reader skips fields that a newer writer of the same version adds.
Every number is bounded so that no reader overflows (``float(10**400)``) or meets Python's
limit on converting integers of 4,300+ digits to text: the JSON is read with ``parse_int=
bounded_json_int``, which keeps an integer of more than ``MAX_JSON_DIGITS`` digits as a
``HugeNumber`` that no check accepts, so the field holding it is named.
"""

from __future__ import annotations

import math
import re
import reprlib
from typing import Any

from autoshard.errors import AutoshardError
from autoshard.ir.decisions import TP_STYLES

_PATH = re.compile(r"[\w\-]+(\.[\w\-]+)*")
_HEX = re.compile(r"[0-9a-f]{1,64}")
_UNSAFE_NAME_CHARS = set("\"'\\[]{}`")
_SHORT = reprlib.Repr()  # a value in a message: short, whatever the file holds
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict = 2, 50, 50, 4, 4
FIX = "re-create it with `autoshard plan` (the file was edited or damaged)"
MAX_COUNT = 2**40
MAX_SIZE = 2**60
MAX_AMOUNT = 1e30
MAX_JSON_DIGITS = 30


class HugeNumber:
    """An integer of the plan's JSON with more than ``MAX_JSON_DIGITS`` digits, kept unconverted."""

    def __init__(self, digits: int):
        self.digits = digits

    def __repr__(self) -> str:
        return f"<a number of {self.digits} digits>"


def bounded_json_int(text: str) -> int | HugeNumber:
    """``json.loads``' ``parse_int``: int(text), or a ``HugeNumber`` beyond ``MAX_JSON_DIGITS`` digits."""
    digits = len(text.lstrip("-"))
    return int(text) if digits <= MAX_JSON_DIGITS else HugeNumber(digits)


def check_plan_dict(d: dict[str, Any]) -> None:
    """Raise ``AutoshardError`` naming the first field of ``d`` that a plan cannot have (module doc)."""
    from autoshard.ir.plan import PLAN_RECOMPUTE, RECOMPUTE_MODES, SCHEDULES
    from autoshard.ir.topology import Cluster

    _check_model(_mapping(d, "model"))
    cluster = Cluster.from_dict(_mapping(d, "cluster"), where="plan field 'cluster'")
    _name(cluster.name, "cluster.name")
    for key in ("global_batch", "microbatch_size", "num_microbatches"):
        _count(_get(d, key), key)
    _choice(_get(d, "zero_stage"), "zero_stage", (0, 1, 2, 3))
    _choice(_get(d, "recompute"), "recompute", PLAN_RECOMPUTE)
    for key, mode in _mapping(d, "recompute_blocks", {}).items():
        _path(key, "recompute_blocks")
        _choice(mode, f"recompute_blocks.{key}", RECOMPUTE_MODES)
    _choice(_get(d, "schedule"), "schedule", SCHEDULES)
    world = _check_mesh(_mapping(d, "mesh"), "mesh")
    if world > cluster.world_size:
        raise AutoshardError(f"plan field 'mesh' needs {world} ranks but the plan's cluster has "
                             f"{cluster.world_size} devices; {FIX}")
    _check_stages(_list(d, "stages"), world)
    for key, value in _mapping(d, "tensor_parallel").items():
        _path(key, "tensor_parallel")
        _choice(value, f"tensor_parallel.{key}", tuple(TP_STYLES))
    _check_predicted(_mapping(d, "predicted"), "predicted")
    for i, alt in enumerate(_list(d, "alternatives")):
        _check_alternative(alt, f"alternatives[{i}]", PLAN_RECOMPUTE, SCHEDULES)
    _check_optional(d)


def _check_optional(d: dict[str, Any]) -> None:
    for key in ("blocks", "split_points"):
        for i, path in enumerate(_list(d, key, [])):
            _path(path, f"{key}[{i}]")
    for key, reason in _mapping(d, "tensor_parallel_reasons", {}).items():
        _path(key, "tensor_parallel_reasons")
        _string(reason, f"tensor_parallel_reasons.{key}")
    _count(_get(d, "virtual_stages", 1), "virtual_stages")
    bucket = _number(_get(d, "ddp_bucket_cap_mb", 25.0), "ddp_bucket_cap_mb")
    if bucket <= 0:
        _fail("ddp_bucket_cap_mb", "a number > 0", bucket)
    _name(_get(d, "precision", "fp32"), "precision")
    for i, name in enumerate(_list(d, "pinned", [])):
        _name(name, f"pinned[{i}]")
    for i, note in enumerate(_list(d, "notes", [])):
        _string(note, f"notes[{i}]")
    for key, value in _mapping(d, "search", {}).items():
        if not isinstance(value, bool):
            _number(value, f"search.{key}")


def _check_model(m: dict[str, Any]) -> None:
    spec = _name(_get(m, "spec", where="model"), "model.spec")
    if ":" not in spec:
        _fail("model.spec", "path/to/file.py:factory", spec)
    digest = _get(m, "hash", where="model")
    if not isinstance(digest, str) or not _HEX.fullmatch(digest):
        _fail("model.hash", "a hexadecimal fingerprint", digest)
    _size(_get(m, "params", where="model"), "model.params")
    _size(_get(m, "layers", where="model"), "model.layers")
    if "tokens_per_sample" in m:
        _count(m["tokens_per_sample"], "model.tokens_per_sample")
    if "ops_estimated" in m:  # optional: plans from before it, and plans with none, lack it
        estimated = m["ops_estimated"]
        if not isinstance(estimated, dict):
            _fail("model.ops_estimated", "a mapping of count and ops", estimated)
        _count(_get(estimated, "count", where="model.ops_estimated"), "model.ops_estimated.count")
        for i, target in enumerate(_list(estimated, "ops", where="model.ops_estimated")):
            _string(target, f"model.ops_estimated.ops[{i}]")


def _check_mesh(mesh: dict[str, Any], where: str) -> int:
    world = 1
    for axis in ("dp", "tp", "pp"):
        world *= _count(_get(mesh, axis, where=where), f"{where}.{axis}")
    return world


def _check_stages(stages: list[Any], world: int) -> None:
    for i, stage in enumerate(stages):
        where = f"stages[{i}]"
        if not isinstance(stage, dict):
            _fail(where, "a mapping of index, modules, ranks", stage)
        _size(_get(stage, "index", where=where), f"{where}.index")
        for j, path in enumerate(_list(stage, "modules", where=where)):
            _path(path, f"{where}.modules[{j}]")
        for j, rank in enumerate(_list(stage, "ranks", where=where)):
            if _size(rank, f"{where}.ranks[{j}]") >= world:
                _fail(f"{where}.ranks[{j}]", f"a rank below the mesh's {world}", rank)


_PREDICTED_SECONDS = ("step_time_s", "compute_s", "comm_exposed_s", "bubble_s")
_PREDICTED_RATES = ("tokens_per_s", "samples_per_s", "mfu")
_MEMORY_PARTS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "transient_bytes",
                 "peak_bytes")


def _check_predicted(p: dict[str, Any], where: str) -> None:
    for key in _PREDICTED_SECONDS + _PREDICTED_RATES:
        _amount(_get(p, key, where=where), f"{where}.{key}")
    if "comm_total_s" in p:
        _amount(p["comm_total_s"], f"{where}.comm_total_s")
    _size(_get(p, "memory_peak_bytes_per_rank", where=where), f"{where}.memory_peak_bytes_per_rank")
    memory = _mapping(p, "memory", where=where)
    for key in _MEMORY_PARTS:
        _size(_get(memory, key, where=f"{where}.memory"), f"{where}.memory.{key}")


def _check_alternative(a: Any, where: str, recompute_modes: tuple[str, ...], schedules: tuple[str, ...]) -> None:
    if not isinstance(a, dict):
        _fail(where, "a mapping", a)
    _check_mesh(_mapping(a, "mesh", where=where), f"{where}.mesh")
    _choice(_get(a, "zero_stage", where=where), f"{where}.zero_stage", (0, 1, 2, 3))
    _count(_get(a, "microbatch_size", where=where), f"{where}.microbatch_size")
    _choice(_get(a, "recompute", where=where), f"{where}.recompute", recompute_modes)
    _choice(_get(a, "schedule", where=where), f"{where}.schedule", schedules)
    _string(_get(a, "why_not", where=where), f"{where}.why_not")
    if a.get("predicted") is not None:
        _check_predicted(_mapping(a, "predicted", where=where), f"{where}.predicted")


# ---------------------------------------------------------------------------- one field

_MISSING = object()


def _get(d: dict[str, Any], key: str, default: Any = _MISSING, where: str = "") -> Any:
    if key in d:
        return d[key]
    if default is _MISSING:
        raise AutoshardError(f"plan field '{where + '.' if where else ''}{key}' is missing; {FIX}")
    return default


def _mapping(d: dict[str, Any], key: str, default: Any = _MISSING, where: str = "") -> dict[str, Any]:
    value = _get(d, key, default, where)
    if not isinstance(value, dict):
        _fail(f"{where + '.' if where else ''}{key}", "a mapping", value)
    return value


def _list(d: dict[str, Any], key: str, default: Any = _MISSING, where: str = "") -> list[Any]:
    value = _get(d, key, default, where)
    if not isinstance(value, list):
        _fail(f"{where + '.' if where else ''}{key}", "a list", value)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(value: Any, field: str) -> int:
    if not _is_int(value) or value < 1:
        _fail(field, "an integer >= 1", value)
    if value > MAX_COUNT:
        _fail(field, "an integer of at most 2^40", value)
    return value


def _size(value: Any, field: str) -> int:
    if not _is_int(value) or value < 0:
        _fail(field, "an integer >= 0", value)
    if value > MAX_SIZE:
        _fail(field, "an integer of at most 2^60", value)
    return value


def _number(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        _fail(field, "a finite number", value)
    if abs(value) > MAX_AMOUNT:
        _fail(field, "a number of at most 1e30 in size", value)
    return float(value)


def _amount(value: Any, field: str) -> float:
    if _number(value, field) < 0:
        _fail(field, "a number >= 0", value)
    return value


def _choice(value: Any, field: str, choices: tuple) -> Any:
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value not in choices:
        _fail(field, "one of " + ", ".join(map(str, choices)), value)
    return value


def _string(value: Any, field: str) -> str:
    if not isinstance(value, str):
        _fail(field, "a string", value)
    return value


def _name(value: Any, field: str) -> str:
    """One printable line with no character that would end a string in the emitted program."""
    if (not isinstance(value, str) or not value or not value.isprintable()
            or _UNSAFE_NAME_CHARS.intersection(value)):
        _fail(field, "a printable name without quotes, backslashes or brackets", value)
    return value


def _path(value: Any, field: str) -> str:
    if not isinstance(value, str) or not _PATH.fullmatch(value):
        _fail(field, "a module path like h.0.attn", value)
    return value


def _fail(field: str, what: str, value: Any) -> None:
    if isinstance(value, int) and value.bit_length() > 200:  # repr of 4,300+ digits raises
        shown = f"<a number of {int(value.bit_length() * math.log10(2)) + 1} digits>"
    else:
        shown = _SHORT.repr(value)
    raise AutoshardError(f"plan field '{field}' must be {what}, got {shown}; {FIX}")
