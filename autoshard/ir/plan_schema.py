"""The schema of ``plan.json``: every field a reader or the code generator uses, checked on load.

Version 2 (``ir.plan_format``) holds the fields below in sections (``decisions``, ``layout``,
``predicted``, ``review``, ``provenance``); version 1 holds them in one flat object. A message
names a field by its path in the file's own version: ``decisions.zero_stage``, ``layout.stages[0]``
in version 2, ``zero_stage``, ``stages[0]`` in version 1.

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
    choices        zero_stage, recompute, schedule, TP styles, one of the known values
                   runtime (absent: "autoshard")
    cluster        cluster                                     ``Cluster.from_dict`` (its own checks)
    ranks          mesh dp·tp·pp <= the cluster's devices; stage ranks in 0 .. dp·tp·pp − 1
    prose          alternatives[].why_not, reasons, notes      strings

The decisions section is checked by its record: each field of ``ir.decisions.Decisions`` that the
plan writes, by the rule of its ``in_plan`` metadata (a count, a choice, a flag, a number > 0, the mesh,
recompute_blocks), required where it has no default or says so.

In version 2 every section is a mapping and an unknown key at the top or in ``decisions``,
``layout``, ``review`` or ``provenance`` is refused (a key edited into the wrong place would
otherwise change nothing), as is one in a mesh or in ``predicted.memory``; in a version 1 file an
unknown top-level key is ignored, as it always was.

Every number is bounded so that no reader overflows (``float(10**400)``) or meets Python's
limit on converting integers of 4,300+ digits to text: the JSON is read with ``parse_int=
bounded_json_int``, which keeps an integer of more than ``MAX_JSON_DIGITS`` digits as a
``HugeNumber`` that no check accepts, so the field holding it is named.
"""

from __future__ import annotations

import math
import re
import reprlib
from dataclasses import MISSING, fields
from typing import Any

from autoshard.errors import AutoshardError
from autoshard.ir.decisions import FLOAT8_CHOICES, FLOAT8_OFF, OFFLOAD_CHOICES, OFFLOAD_NONE, TP_STYLES, Decisions
from autoshard.ir.plan_format import (
    PLAN_RECOMPUTE,
    PLAN_RUNTIMES,
    RECOMPUTE_MODES,
    SCHEDULES,
    SECTION_OF,
    SECTIONS,
    TOP_KEYS,
)
from autoshard.ir.topology import Cluster

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
_MISSING = object()


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
    """Raise ``AutoshardError`` naming the first field of ``d`` (version 1 or 2) that a plan cannot have
    (module doc)."""
    f = _Fields(d)
    _check_model(_mapping(d, "model"))
    cluster = Cluster.from_dict(_mapping(d, "cluster"), where="plan field 'cluster'")
    _name(cluster.name, "cluster.name")
    _count(f.get("global_batch"), f.path("global_batch"))
    world = _check_decisions(f)
    if world > cluster.world_size:
        raise AutoshardError(
            f"plan field '{f.path('mesh')}' needs {world} ranks but the plan's cluster has "
            f"{cluster.world_size} devices; {FIX}"
        )
    _check_stages(f.get_list("stages"), world, f.path("stages"))
    for key, value in f.get_mapping("tensor_parallel").items():
        _path(key, f.path("tensor_parallel"))
        _choice(value, f"{f.path('tensor_parallel')}.{key}", tuple(TP_STYLES))
    _check_predicted(f.get_mapping("predicted"), f.path("predicted"))
    for i, alt in enumerate(f.get_list("alternatives")):
        _check_alternative(alt, f"{f.path('alternatives')}[{i}]", PLAN_RECOMPUTE, SCHEDULES)
    _check_optional(f)


class _Fields:
    """A plan document's fields by their flat name, each read from its section (version 2) or from the top
    (version 1, or a field such as ``global_batch`` that has no section), and named by its path there."""

    def __init__(self, d: dict[str, Any]):
        self._at: dict[str, tuple[dict[str, Any], str]] = {}  # flat key -> (the mapping holding it, its path)
        if d.get("version") != 1:
            _check_sections(d)
        for key, section in SECTION_OF.items():
            self._at[key] = (d, "") if d.get("version") == 1 else (d[section], section)
        self._top = d

    def _where(self, key: str) -> tuple[dict[str, Any], str]:
        return self._at.get(key, (self._top, ""))

    def path(self, key: str) -> str:
        section = self._where(key)[1]
        return f"{section}.{key}" if section else key

    def get(self, key: str, default: Any = _MISSING) -> Any:
        mapping, section = self._where(key)
        return _get(mapping, key, default, where=section)

    def get_mapping(self, key: str, default: Any = _MISSING) -> dict[str, Any]:
        mapping, section = self._where(key)
        return _mapping(mapping, key, default, where=section)

    def get_list(self, key: str, default: Any = _MISSING) -> list[Any]:
        mapping, section = self._where(key)
        return _list(mapping, key, default, where=section)


def _check_sections(d: dict[str, Any]) -> None:
    """Version 2's structure: known top-level keys only, every section present, a mapping of its own keys."""
    _unknown_keys(d, TOP_KEYS, "plan", "a version 2 plan holds " + ", ".join(TOP_KEYS))
    for section, keys in SECTIONS.items():
        _unknown_keys(_mapping(d, section), keys, f"plan field '{section}'", f"'{section}' holds " + ", ".join(keys))


def _unknown_keys(d: dict[str, Any], known: tuple[str, ...], what: str, holds: str) -> None:
    unknown = sorted(str(k) for k in d if k not in known)
    if not unknown:
        return
    key = unknown[0]
    if key in SECTION_OF or key in TOP_KEYS:  # a field of another section, or a version 1 key
        home = f"'{SECTION_OF[key]}'" if key in SECTION_OF else "the top of the plan"
        raise AutoshardError(
            f"{what} has an unknown key {_SHORT.repr(key)}, which belongs in {home} in version 2; "
            f"move it there or re-create the plan with `autoshard plan`"
        )
    raise AutoshardError(
        f"{what} has an unknown key {_SHORT.repr(key)} ({holds}); remove it or re-create the plan with `autoshard plan`"
    )


def _check_decisions(f: _Fields) -> int:
    """Every written field of ``Decisions`` by the rule of its ``in_plan`` metadata (``ir.decisions``), in its
    order; an optional one absent reads as its default. Returns the mesh's ranks."""
    world = 0
    for field in fields(Decisions):
        rule = field.metadata.get("plan")
        if rule is None:
            continue
        key, path = field.name, f.path(field.name)
        default = _MISSING if field.metadata["required"] or field.default is MISSING else field.default
        if rule == "mesh":
            world = _check_mesh(f.get_mapping(key), path)
        elif rule == "recompute_blocks":
            for block, mode in f.get_mapping(key, {}).items():
                _path(block, path)
                _choice(mode, f"{path}.{block}", RECOMPUTE_MODES)
        elif rule == "count":
            _count(f.get(key, default), path)
        elif rule == "choice":
            _choice(f.get(key, default), path, field.metadata["choices"])
        elif rule == "flag":
            _flag(f.get(key, default), path)
        elif rule == "positive":
            value = _number(f.get(key, default), path)
            if value <= 0:
                _fail(path, "a number > 0", value)
        else:
            raise AssertionError(f"Decisions.{key}: no check for the plan rule {rule!r}")
    return world


def _check_optional(f: _Fields) -> None:
    for key in ("blocks", "split_points", "experts", "float8_linears", "unread_params"):
        for i, path in enumerate(f.get_list(key, [])):
            _path(path, f"{f.path(key)}[{i}]")
    for key, reason in f.get_mapping("tensor_parallel_reasons", {}).items():
        _path(key, f.path("tensor_parallel_reasons"))
        _string(reason, f"{f.path('tensor_parallel_reasons')}.{key}")
    for i, name in enumerate(f.get_list("pinned", [])):
        _name(name, f"{f.path('pinned')}[{i}]")
    _choice(f.get("runtime", "autoshard"), f.path("runtime"), PLAN_RUNTIMES)
    for i, note in enumerate(f.get_list("notes", [])):
        _string(note, f"{f.path('notes')}[{i}]")
    for key, value in f.get_mapping("search", {}).items():
        if not isinstance(value, bool):
            _number(value, f"{f.path('search')}.{key}")


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
    if "seq_len" in m:  # written only for plans made with --seq-len
        _count(m["seq_len"], "model.seq_len")
    if "ops_estimated" in m:  # optional: plans from before it, and plans with none, lack it
        estimated = m["ops_estimated"]
        if not isinstance(estimated, dict):
            _fail("model.ops_estimated", "a mapping of count and ops", estimated)
        _count(_get(estimated, "count", where="model.ops_estimated"), "model.ops_estimated.count")
        for i, target in enumerate(_list(estimated, "ops", where="model.ops_estimated")):
            _string(target, f"model.ops_estimated.ops[{i}]")
    if "random_ops" in m:  # written only for models that draw random numbers
        _check_random_ops(m["random_ops"])


def _check_random_ops(drawn: Any) -> None:
    """``model.random_ops``: op target -> the module paths calling it (``passes.capturing.annotate.random_ops``)."""
    if not isinstance(drawn, dict):
        _fail("model.random_ops", "a mapping of op targets to module paths", drawn)
    for target, modules in drawn.items():
        _string(target, "model.random_ops")
        if not isinstance(modules, list) or not modules:
            _fail(f"model.random_ops.{target}", "a list of module paths", modules)
        for i, module in enumerate(modules):
            _string(module, f"model.random_ops.{target}[{i}]")


def _check_mesh(mesh: dict[str, Any], where: str) -> int:
    unknown = sorted(str(k) for k in mesh if k not in ("dp", "tp", "pp", "cp"))
    if unknown:
        raise AutoshardError(
            f"plan field '{where}' has an unknown key {_SHORT.repr(unknown[0])}; a mesh has only "
            f"dp, tp, pp and cp; remove it or re-create the plan with `autoshard plan`"
        )
    world = 1
    for axis in ("dp", "tp", "pp"):
        world *= _count(_get(mesh, axis, where=where), f"{where}.{axis}")
    if "cp" in mesh:  # written only when > 1
        world *= _count(_get(mesh, "cp", where=where), f"{where}.cp")
    return world


def _check_stages(stages: list[Any], world: int, field: str) -> None:
    for i, stage in enumerate(stages):
        where = f"{field}[{i}]"
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
_MEMORY_PARTS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "transient_bytes", "peak_bytes")


def _check_predicted(p: dict[str, Any], where: str) -> None:
    for key in _PREDICTED_SECONDS + _PREDICTED_RATES:
        _amount(_get(p, key, where=where), f"{where}.{key}")
    if "comm_total_s" in p:
        _amount(p["comm_total_s"], f"{where}.comm_total_s")
    _size(_get(p, "memory_peak_bytes_per_rank", where=where), f"{where}.memory_peak_bytes_per_rank")
    _check_memory(_mapping(p, "memory", where=where), f"{where}.memory")
    if "host_memory_bytes_per_node" in p:
        _size(p["host_memory_bytes_per_node"], f"{where}.host_memory_bytes_per_node")
    if "pp_rank_memory" in p:
        for i, memory in enumerate(_list(p, "pp_rank_memory", where=where)):
            if not isinstance(memory, dict):
                _fail(f"{where}.pp_rank_memory[{i}]", "a mapping of memory parts", memory)
            _check_memory(memory, f"{where}.pp_rank_memory[{i}]")


def _check_memory(memory: dict[str, Any], where: str) -> None:
    unknown = sorted(str(k) for k in memory if k not in _MEMORY_PARTS)
    if unknown:
        raise AutoshardError(
            f"plan field '{where}' has an unknown key {_SHORT.repr(unknown[0])}; "
            f"re-create the plan with `autoshard plan`"
        )
    for key in _MEMORY_PARTS:
        _size(_get(memory, key, where=where), f"{where}.{key}")


def _check_alternative(a: Any, where: str, recompute_modes: tuple[str, ...], schedules: tuple[str, ...]) -> None:
    if not isinstance(a, dict):
        _fail(where, "a mapping", a)
    _check_mesh(_mapping(a, "mesh", where=where), f"{where}.mesh")
    _choice(_get(a, "zero_stage", where=where), f"{where}.zero_stage", (0, 1, 2, 3))
    _count(_get(a, "microbatch_size", where=where), f"{where}.microbatch_size")
    _choice(_get(a, "recompute", where=where), f"{where}.recompute", recompute_modes)
    _choice(_get(a, "schedule", where=where), f"{where}.schedule", schedules)
    _string(_get(a, "why_not", where=where), f"{where}.why_not")
    _choice(a.get("float8", FLOAT8_OFF), f"{where}.float8", FLOAT8_CHOICES)
    _choice(a.get("offload", OFFLOAD_NONE), f"{where}.offload", OFFLOAD_CHOICES)
    if a.get("predicted") is not None:
        _check_predicted(_mapping(a, "predicted", where=where), f"{where}.predicted")


# ---------------------------------------------------------------------------- one field


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


def _flag(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        _fail(field, "true or false", value)
    return value


def _string(value: Any, field: str) -> str:
    if not isinstance(value, str):
        _fail(field, "a string", value)
    return value


def _name(value: Any, field: str) -> str:
    """One printable line with no character that would end a string in the emitted program."""
    if not isinstance(value, str) or not value or not value.isprintable() or _UNSAFE_NAME_CHARS.intersection(value):
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
