"""Plan: the planner's decision, its predicted cost, and the alternatives it weighed.

A plan is a review artifact: ``plan.json`` is versioned, self-describing, deterministic
(same inputs give the same bytes) and JSON only, so loading one never runs code. Every
predicted figure is a sum of named parts (``Predicted``); alternatives carry the same
breakdown and the reason they lost.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from autoshard.errors import AutoshardError

PLAN_VERSION = 1
RECOMPUTE_MODES = ("none", "selective", "full")
PLAN_RECOMPUTE = (*RECOMPUTE_MODES, "mixed")  # mixed: each block's own mode in Plan.recompute_blocks
SCHEDULES = ("none", "gpipe", "1f1b", "interleaved-1f1b")


@dataclass(frozen=True)
class Mesh:
    """Parallel degrees; ``dp * tp * pp`` ranks in all, TP innermost (inside a node first)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self):
        for axis in ("dp", "tp", "pp"):
            if not isinstance(getattr(self, axis), int) or getattr(self, axis) < 1:
                raise AutoshardError(f"mesh {axis}={getattr(self, axis)!r} must be a positive integer")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def __str__(self) -> str:
        return f"dp={self.dp} tp={self.tp} pp={self.pp}"


@dataclass(frozen=True)
class Memory:
    """Predicted bytes per rank at the peak of a step, by part."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    transient_bytes: int  # unsharded FSDP units, communication buffers, recompute workspace
    peak_bytes: int  # sum of the above, plus allocator slack

    @classmethod
    def from_parts(cls, slack_fraction: float = 0.0, **parts: int) -> "Memory":
        total = sum(parts.values())
        return cls(**parts, peak_bytes=int(total * (1.0 + slack_fraction)))


@dataclass(frozen=True)
class Predicted:
    """Predicted step time by part (seconds) and what it buys."""

    step_time_s: float
    compute_s: float  # forward + backward + recompute + optimizer
    comm_exposed_s: float  # communication not hidden behind compute
    bubble_s: float  # pipeline idle time
    memory_peak_bytes_per_rank: int
    memory: Memory
    tokens_per_s: float
    samples_per_s: float
    mfu: float  # model FLOPs (no recompute) / (step time * devices * peak)
    comm_total_s: float = 0.0  # all communication, hidden or not


@dataclass(frozen=True)
class Stage:
    index: int
    modules: tuple[str, ...]
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Alternative:
    """A configuration the planner priced and did not choose, and why."""

    mesh: Mesh
    zero_stage: int
    microbatch_size: int
    recompute: str
    schedule: str
    predicted: Predicted | None  # None where it does not fit
    why_not: str


@dataclass(frozen=True)
class Plan:
    model: dict[str, Any]  # spec, hash, params, layers
    cluster: dict[str, Any]  # Cluster.to_dict()
    global_batch: int
    mesh: Mesh
    zero_stage: int
    microbatch_size: int
    num_microbatches: int
    schedule: str
    recompute: str
    stages: tuple[Stage, ...]
    tensor_parallel: dict[str, str]
    predicted: Predicted
    alternatives: tuple[Alternative, ...] = ()
    blocks: tuple[str, ...] = ()  # module paths of the repeated blocks (FSDP units, recompute units)
    virtual_stages: int = 1  # pipeline stages per pp rank (interleaved 1F1B when > 1)
    split_points: tuple[str, ...] = ()  # module paths where pipeline stages 1 .. pp·v−1 begin
    tensor_parallel_reasons: dict[str, str] = field(default_factory=dict)  # why a module stays replicated
    ddp_bucket_cap_mb: float = 25.0
    precision: str = "fp32"  # "bf16-mixed" on GPUs, "fp32" on CPU
    pinned: tuple[str, ...] = ()  # decisions the user fixed by hand
    notes: tuple[str, ...] = ()
    # Step time and memory as sympy expressions (strings) in B, s, dp, tp, pp, b, v with the plan's own
    # values under "symbols" (``cost.symbolic``); empty in plans made before it existed.
    symbolic: dict[str, Any] = field(default_factory=dict)
    # How the plan was found (passes.search.search_report): candidates, priced, optimal, gap.
    search: dict[str, Any] = field(default_factory=dict)
    recompute_blocks: dict[str, str] = field(default_factory=dict)  # recompute "mixed": block path -> its mode
    version: int = PLAN_VERSION

    def __post_init__(self):
        if self.zero_stage not in (0, 1, 2, 3):
            raise AutoshardError(f"zero_stage={self.zero_stage} must be 0, 1, 2 or 3")
        if self.recompute not in PLAN_RECOMPUTE:
            raise AutoshardError(f"recompute={self.recompute!r} must be one of {', '.join(PLAN_RECOMPUTE)}")
        if (self.recompute == "mixed") != bool(self.recompute_blocks) or \
                any(m not in RECOMPUTE_MODES for m in self.recompute_blocks.values()):
            raise AutoshardError(f"recompute={self.recompute!r} with recompute_blocks {self.recompute_blocks!r}: a "
                                 f"mixed plan gives every block one of {', '.join(RECOMPUTE_MODES)}, others none")
        if self.schedule not in SCHEDULES:
            raise AutoshardError(f"schedule={self.schedule!r} must be one of {', '.join(SCHEDULES)}")
        if self.mesh.pp > 1 and len(self.split_points) != self.mesh.pp * self.virtual_stages - 1:
            raise AutoshardError(f"pp={self.mesh.pp} x {self.virtual_stages} virtual stages needs "
                                 f"{self.mesh.pp * self.virtual_stages - 1} split points, got {len(self.split_points)}")
        if (self.mesh.pp > 1) != (self.schedule != "none"):
            raise AutoshardError(f"schedule {self.schedule!r} does not fit pp={self.mesh.pp}: pipelines need "
                                 f"gpipe, 1f1b or interleaved-1f1b, and pp=1 needs none")
        per_step = self.mesh.dp * self.microbatch_size * self.num_microbatches
        if per_step != self.global_batch:
            raise AutoshardError(
                f"dp {self.mesh.dp} x micro-batch {self.microbatch_size} x {self.num_microbatches} "
                f"micro-batches = {per_step}, not the global batch {self.global_batch}"
            )

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    def to_json(self) -> str:
        """Deterministic JSON: fixed key order, floats rounded to 6 significant digits."""
        return json.dumps(_rounded(_ordered(self)), indent=2) + "\n"

    def save(self, path: str | Path) -> None:
        """Write atomically: a crash never leaves a half-written plan."""
        write_text_atomic(Path(path), self.to_json())

    @classmethod
    def from_json(cls, text: str, source: str = "plan") -> "Plan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise AutoshardError(f"{source}: not valid JSON ({exc.msg} at line {exc.lineno}); re-create it with `autoshard plan`") from exc
        except RecursionError:
            raise AutoshardError(f"{source}: not a plan (JSON nested too deeply); re-create it with `autoshard plan`") from None
        if not isinstance(data, dict):
            raise AutoshardError(f"{source}: a plan is a JSON object; re-create it with `autoshard plan`")
        return cls.from_dict(data, source)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "plan") -> "Plan":
        from autoshard.ir.plan_schema import check_plan_dict

        version = data.get("version")
        if version != PLAN_VERSION or isinstance(version, bool) or not isinstance(version, int):
            raise AutoshardError(
                f"{source}: plan version {version!r}, this autoshard reads version {PLAN_VERSION}; re-plan with this version"
            )
        try:
            check_plan_dict(data)  # every field first (ir/plan_schema.py): a tampered file is one line, never code
            return _plan_from_dict(data)
        except AutoshardError as exc:
            raise AutoshardError(f"{source}: {exc}") from exc
        except (KeyError, TypeError, ValueError) as exc:
            raise AutoshardError(
                f"{source}: plan is corrupted ({type(exc).__name__}: {exc}); re-create it with `autoshard plan`"
            ) from exc


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    if not path.is_file():
        raise AutoshardError(f"plan file '{path}' not found; create one with `autoshard plan MODEL -o {path}`")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise AutoshardError(f"{path}: cannot read the plan ({exc}); re-create it with `autoshard plan`") from exc
    return Plan.from_json(text, source=str(path))


def write_text_atomic(path: Path, text: str) -> None:
    """Write via a temporary file in the same folder and rename over the target."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        tmp.replace(path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)  # nothing half-written stays behind
        raise AutoshardError(f"cannot write {path} ({exc.strerror or type(exc).__name__}); "
                             f"fix: choose a writable file in an existing folder") from exc


def _plan_from_dict(d: dict[str, Any]) -> Plan:
    return Plan(
        model=dict(_require_keys(d["model"], ("spec", "hash", "params", "layers"), "model")),
        cluster=dict(d["cluster"]),
        global_batch=_int(d["global_batch"]),
        mesh=Mesh(**d["mesh"]),
        zero_stage=_int(d["zero_stage"]),
        microbatch_size=_int(d["microbatch_size"]),
        num_microbatches=_int(d["num_microbatches"]),
        schedule=d["schedule"],
        recompute=d["recompute"],
        stages=tuple(Stage(s["index"], tuple(s["modules"]), tuple(s["ranks"])) for s in d["stages"]),
        tensor_parallel=dict(d["tensor_parallel"]),
        predicted=_predicted(d["predicted"]),
        alternatives=tuple(_alternative(a) for a in d["alternatives"]),
        blocks=tuple(d.get("blocks", ())),
        virtual_stages=_int(d.get("virtual_stages", 1)),
        split_points=tuple(d.get("split_points", ())),
        tensor_parallel_reasons=dict(d.get("tensor_parallel_reasons", {})),
        ddp_bucket_cap_mb=float(d.get("ddp_bucket_cap_mb", 25.0)),
        precision=d.get("precision", "fp32"),
        pinned=tuple(d.get("pinned", ())),
        notes=tuple(d.get("notes", ())),
        symbolic=_symbolic(d.get("symbolic", {})),
        search=_search(d.get("search", {})),
        recompute_blocks=dict(d.get("recompute_blocks", {})),
        version=d["version"],
    )


def _search(d: Any) -> dict[str, Any]:
    if not isinstance(d, dict) or not all(isinstance(v, (int, float, bool)) for v in d.values()):
        raise TypeError("search must be an object of numbers")
    return dict(d)


def _symbolic(d: Any) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise TypeError(f"symbolic must be an object, got {type(d).__name__}")
    return dict(d)


def _predicted(d: dict[str, Any] | None) -> Predicted | None:
    if d is None:
        return None
    known = {f.name for f in fields(Predicted)}
    values = {k: v for k, v in d.items() if k in known}
    values["memory"] = Memory(**d["memory"])
    return Predicted(**values)


def _alternative(d: dict[str, Any]) -> Alternative:
    return Alternative(
        mesh=Mesh(**d["mesh"]),
        zero_stage=d["zero_stage"],
        microbatch_size=d["microbatch_size"],
        recompute=d["recompute"],
        schedule=d["schedule"],
        predicted=_predicted(d.get("predicted")),
        why_not=d["why_not"],
    )


def _require_keys(d: dict[str, Any], keys: tuple[str, ...], where: str) -> dict[str, Any]:
    missing = [k for k in keys if k not in d]
    if missing:
        raise KeyError(f"{where}.{missing[0]}")
    return d


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"expected an integer, got {v!r}")
    return v


def _ordered(obj: Any) -> Any:
    """Dataclasses to dicts in field order (DESIGN.md's key order), tuples to lists."""
    if hasattr(obj, "__dataclass_fields__"):
        out = {f.name: _ordered(getattr(obj, f.name)) for f in fields(obj)}
        if isinstance(obj, Plan):  # version first, as readers look for it first
            out = {"version": out.pop("version"), **out}
        return out
    if isinstance(obj, dict):
        return {k: _ordered(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_ordered(v) for v in obj]
    return obj


def _rounded(obj: Any) -> Any:
    if isinstance(obj, float):
        return float(f"{obj:.6g}") if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rounded(v) for v in obj]
    return obj
