"""Plan: the planner's decision, its predicted cost, and the alternatives it weighed.

A plan is a review artifact: ``plan.json`` is versioned, self-describing, deterministic
(same inputs give the same bytes) and JSON only, so loading one never runs code. Every
predicted figure is a sum of named parts (``Predicted``); alternatives carry the same
breakdown and the reason they lost.

``Plan`` is flat (``plan.mesh``, ``plan.zero_stage``, ...); its JSON groups the fields into
decisions, layout, predicted, review and provenance (``ir.plan_format``, version 2). Plans of
version 1 (one flat object) are read as the same ``Plan`` and saved as version 2.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import stat
import tempfile
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, IO

from autoshard.errors import AutoshardError
from autoshard.ir.decisions import Decisions, Mesh, tp_style
from autoshard.ir.plan_format import (
    PLAN_RECOMPUTE,
    PLAN_RUNTIMES,
    PLAN_VERSION,
    READ_VERSIONS,
    RECOMPUTE_MODES,
    SCHEDULES,
    flatten,
    sectioned,
)
from autoshard.ir.plan_schema import bounded_json_int, check_plan_dict


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
class PlanLayout:
    """Where the decisions land on the model (``plan.json``'s ``layout`` section): the FSDP / recompute
    units, each module's tensor-parallel style, and the pipeline's cuts and stages: ``Plan.layout``."""

    blocks: tuple[str, ...]
    tensor_parallel: dict[str, str]
    split_points: tuple[str, ...]
    stages: tuple[Stage, ...]
    experts: tuple[str, ...] = ()  # the expert groups an ep > 1 plan splits


@dataclass(frozen=True)
class Plan:
    """The plan, field by field. ``plan.json`` groups the fields into sections (``ir.plan_format``);
    ``decisions`` (``ir.decisions.Decisions``, the search's record) and ``layout`` give two of them as
    one record each."""

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
    virtual_stages: int = 1  # pipeline stages per pp rank (interleaved and V schedules: 2)
    split_points: tuple[str, ...] = ()  # module paths where pipeline stages 1 .. pp·v−1 begin
    tensor_parallel_reasons: dict[str, str] = field(default_factory=dict)  # why a module stays replicated
    ddp_bucket_cap_mb: float = 25.0
    precision: str = "fp32"  # a name of ir.decisions.PRECISIONS: "bf16-autocast" on GPUs, "fp32" on CPU
    pinned: tuple[str, ...] = ()  # decisions the user fixed by hand
    runtime: str = "autoshard"  # what the prediction priced (ir.plan_format); the program is autoshard's
    notes: tuple[str, ...] = ()
    # Step time and memory as sympy expressions (strings) in B, s, dp, tp, pp, b, v with the plan's own
    # values under "symbols" (``cost.symbolic``); empty in plans made before it existed.
    symbolic: dict[str, Any] = field(default_factory=dict)
    # How the plan was found (passes.search.search_report): candidates, priced, optimal, gap.
    search: dict[str, Any] = field(default_factory=dict)
    recompute_blocks: dict[str, str] = field(default_factory=dict)  # recompute "mixed": block path -> its mode
    dp_replicate: int = 1  # HSDP: FSDP2 shards over dp / dp_replicate ranks and replicates across the rest
    ep: int = 1  # expert parallelism: each expert group split over ep of the dp ranks (Decisions.ep)
    experts: tuple[str, ...] = ()  # the expert groups (passes.experts) the ep axis shards, when ep > 1
    version: int = PLAN_VERSION  # the format it is written in: a plan read from an older version has this one

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
        if self.runtime not in PLAN_RUNTIMES:
            raise AutoshardError(f"runtime={self.runtime!r} must be one of {', '.join(PLAN_RUNTIMES)}")
        if self.mesh.pp > 1 and len(self.split_points) != self.mesh.pp * self.virtual_stages - 1:
            raise AutoshardError(f"pp={self.mesh.pp} x {self.virtual_stages} virtual stages needs "
                                 f"{self.mesh.pp * self.virtual_stages - 1} split points, got {len(self.split_points)}")
        if (self.mesh.pp > 1) != (self.schedule != "none"):
            raise AutoshardError(f"schedule {self.schedule!r} does not fit pp={self.mesh.pp}: pipelines need "
                                 f"one of {', '.join(SCHEDULES[1:])}, and pp=1 needs none")
        if self.dp_replicate < 1 or self.mesh.dp % self.dp_replicate or \
                (self.dp_replicate > 1 and (self.zero_stage < 2 or self.mesh.pp > 1)):
            raise AutoshardError(f"dp_replicate={self.dp_replicate} must divide dp={self.mesh.dp}, and HSDP "
                                 f"(dp_replicate > 1) needs ZeRO-2 or 3 without pipeline stages")
        if self.ep < 1 or self.mesh.dp % self.ep or (self.ep > 1 and not self.experts):
            raise AutoshardError(f"ep={self.ep} must divide dp={self.mesh.dp}, and ep > 1 needs the expert groups "
                                 f"it shards (layout.experts)")
        per_step = self.mesh.dp * self.microbatch_size * self.num_microbatches
        if per_step != self.global_batch:
            raise AutoshardError(
                f"dp {self.mesh.dp} x micro-batch {self.microbatch_size} x {self.num_microbatches} "
                f"micro-batches = {per_step}, not the global batch {self.global_batch}"
            )

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def sequence_parallel(self) -> bool:
        """Its TP layout shards the regions between the parallel linears along the sequence (a style of
        ``ir.decisions``' sequence-parallel table)."""
        return any(tp_style(style).sequence_parallel for style in self.tensor_parallel.values())

    @property
    def decisions(self) -> Decisions:
        """The decision fields as one record, the search's own type (a mixed plan's per-block modes in
        ``blocks`` order)."""
        modes = tuple(self.recompute_blocks.get(b, "none") for b in self.blocks) if self.recompute == "mixed" else ()
        return Decisions(mesh=self.mesh, zero_stage=self.zero_stage, microbatch_size=self.microbatch_size,
                         num_microbatches=self.num_microbatches, recompute=self.recompute, schedule=self.schedule,
                         virtual_stages=self.virtual_stages, ddp_bucket_cap_mb=self.ddp_bucket_cap_mb,
                         recompute_blocks=modes, precision=self.precision, dp_replicate=self.dp_replicate,
                         ep=self.ep, sequence_parallel=self.sequence_parallel)

    @property
    def layout(self) -> PlanLayout:
        """The layout fields as one record (a copy: changing it leaves the plan as it is)."""
        return PlanLayout(**{f.name: _copied(getattr(self, f.name)) for f in fields(PlanLayout)})

    def to_json(self) -> str:
        """Deterministic JSON of version ``PLAN_VERSION``: fixed sections and key order (``ir.plan_format``),
        floats rounded to 6 significant digits."""
        flat = {f.name: _ordered(getattr(self, f.name)) for f in fields(self) if f.name != "version"}
        return json.dumps(_rounded(sectioned(flat)), indent=2) + "\n"

    def save(self, path: str | Path) -> None:
        """Write atomically: a crash never leaves a half-written plan."""
        write_text_atomic(Path(path), self.to_json())

    @classmethod
    def from_json(cls, text: str, source: str = "plan") -> "Plan":
        try:
            data = json.loads(text, parse_int=bounded_json_int)  # ints of 30+ digits: named by the schema
        except json.JSONDecodeError as exc:
            raise AutoshardError(f"{source}: not valid JSON ({exc.msg} at line {exc.lineno}); re-create it with `autoshard plan`") from exc
        except RecursionError:
            raise AutoshardError(f"{source}: not a plan (JSON nested too deeply); re-create it with `autoshard plan`") from None
        if not isinstance(data, dict):
            raise AutoshardError(f"{source}: a plan is a JSON object; re-create it with `autoshard plan`")
        return cls.from_dict(data, source)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "plan") -> "Plan":
        """The plan of a version 2 document, or of a version 1 (flat) one: the same ``Plan``, which
        ``to_json`` then writes as version 2."""
        version = data.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version not in READ_VERSIONS:
            raise AutoshardError(
                f"{source}: plan version {version!r}, this autoshard reads versions "
                f"{' and '.join(map(str, READ_VERSIONS))}; re-plan with this version"
            )
        try:
            check_plan_dict(data)  # every field first (ir/plan_schema.py): a tampered file is one line, never code
            return _plan_from_dict(data if version == 1 else flatten(data))
        except AutoshardError as exc:
            raise AutoshardError(f"{source}: {exc}") from exc
        except (KeyError, TypeError, ValueError) as exc:
            raise AutoshardError(
                f"{source}: plan is corrupted ({type(exc).__name__}: {exc}); re-create it with `autoshard plan`"
            ) from exc


MAX_PLAN_BYTES = 64 * 2**20  # a plan of a 2^18-device cluster with every alternative is a few MiB


def load_plan(path: str | Path) -> Plan:
    """The plan in a regular file of at most ``MAX_PLAN_BYTES`` (a device or a pipe is refused unread)."""
    path = Path(path)
    if path.exists() and not path.is_file():
        raise AutoshardError(f"plan file '{path}' is not a regular file (a folder, device or pipe); name a plan "
                             f"file that `autoshard plan -o` wrote")
    if not path.is_file():
        raise AutoshardError(f"plan file '{path}' not found; create one with `autoshard plan MODEL -o {path}`")
    if path.stat().st_size > MAX_PLAN_BYTES:
        raise AutoshardError(f"plan file '{path}' is {path.stat().st_size / 2**20:.0f} MiB, more than a plan can be "
                             f"({MAX_PLAN_BYTES // 2**20} MiB); re-create it with `autoshard plan`")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise AutoshardError(f"{path}: cannot read the plan ({exc}); re-create it with `autoshard plan`") from exc
    return Plan.from_json(text, source=str(path))


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (``write_atomic``)."""
    write_atomic(path, text.encode())


def write_atomic(path: str | Path, data: bytes | Callable[[IO[bytes]], None]) -> None:
    """Write ``data`` (bytes, or a function writing to a binary file) to ``path`` atomically.

    The temporary file is created by ``tempfile.mkstemp`` in the target's folder: a fresh, unique
    name opened with O_EXCL, so no other file (a symlink planted at a predictable name) is ever
    followed or truncated; ``os.replace`` then puts it in place in one step. A crash or an error
    leaves the target as it was and no temporary behind."""
    write_files_atomic({Path(path): data})


def write_files_atomic(outputs: dict[Path, bytes | Callable[[IO[bytes]], None]]) -> None:
    """Write several files all or nothing: every temporary is written first, then each renamed over its
    target; a rename that fails puts back the files already replaced (``_undo``) and removes the ones it
    created. Replaced files are kept as hard links until every rename has succeeded."""
    temps: dict[Path, str] = {}
    done: list[tuple[Path, str | None, bool]] = []  # target, backup of what it was, whether it existed
    try:
        for path, data in outputs.items():
            if path.is_dir():
                raise IsADirectoryError(21, "Is a directory")
            path.parent.mkdir(parents=True, exist_ok=True)
            temps[path] = _write_temporary(path, data)
        for path, tmp in temps.items():
            existed = os.path.lexists(path)
            backup = _backup(path) if len(outputs) > 1 and existed else None
            try:
                os.replace(tmp, path)
            except BaseException:
                _remove([backup] if backup else [])
                raise
            done.append((path, backup, existed))
    except OSError as exc:
        _undo(done)
        _remove(temps.values())
        failed = next((p for p in outputs if p not in {d[0] for d in done}), next(iter(outputs)))
        raise AutoshardError(f"cannot write {failed} ({exc.strerror or type(exc).__name__}); "
                             f"fix: choose a writable file in an existing folder") from exc
    except BaseException:
        _undo(done)
        _remove(temps.values())
        raise
    _remove(b for _, b, _ in done if b is not None)


def _write_temporary(path: Path, data: bytes | Callable[[IO[bytes]], None]) -> str:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
        os.chmod(tmp, _mode_for(path))  # mkstemp makes it 0600
    except BaseException:
        _remove([tmp])
        raise
    return tmp


def _backup(path: Path) -> str | None:
    """A hard link to what ``path`` is now (a unique name), so a later failure can put it back."""
    if not path.is_file() or path.is_symlink():
        return None
    for _ in range(100):
        name = str(path.with_name(f".{path.name}.{os.urandom(6).hex()}.bak"))
        try:
            os.link(path, name)  # fails if the name exists: never follows or replaces anything
            return name
        except FileExistsError:
            continue
        except OSError:
            return None  # no hard links here: an undo then keeps the new file
    return None


def _undo(done: list[tuple[Path, str | None, bool]]) -> None:
    """Put back what was replaced; remove what was created; a file without a backup keeps its new, whole
    content (never deleted: it was the user's)."""
    for path, backup, existed in reversed(done):
        with contextlib.suppress(OSError):
            if backup is not None:
                os.replace(backup, path)
            elif not existed:
                path.unlink()


def _remove(names) -> None:
    for name in names:
        with contextlib.suppress(OSError):
            os.unlink(name)


def _mode_for(path: Path) -> int:
    """The target's own mode when it exists, else that of a file the user creates (0666 less the umask)."""
    with contextlib.suppress(OSError):
        return stat.S_IMODE(os.stat(path).st_mode)
    umask = 0o022
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:  # os.umask would set it
        umask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    return 0o666 & ~umask


# ---------------------------------------------------------------------------- the plan's model file

_SHA256 = re.compile(r"[0-9a-f]{64}")


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes, read in blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def model_file_sha256(spec: str) -> str | None:
    """``model.file_sha256`` of a plan of ``spec``: its model file's content hash (None when unreadable)."""
    try:
        return file_sha256(spec.rsplit(":", 1)[0])
    except OSError:
        return None


def check_model_file(plan: "Plan") -> Path:
    """The plan's model file, checked before anything imports it: a plan is data, and its ``model.spec``
    names a file that ``compile``, ``run`` and ``verify`` import (run). That file must be a Python file
    whose bytes are the ones planned (``model.file_sha256``). A plan without the hash (made before plans
    recorded it) is refused too: nothing could tell its file from another one."""
    spec = plan.model["spec"]
    file_part = spec.rsplit(":", 1)[0]
    path = Path(file_part)
    if path.is_dir():
        raise AutoshardError(f"model file '{file_part}' is a folder; the plan's model.spec must name a Python "
                             f"file (path/to/file.py:factory); re-plan it with `autoshard plan`")
    if not path.is_file():
        raise AutoshardError(f"model file '{file_part}' not found; check the path (relative to {Path.cwd()})")
    if path.suffix != ".py":
        raise AutoshardError(f"model file '{file_part}' is not a Python file (.py); a plan's model.spec names "
                             f"the model file it was made for; re-plan it with `autoshard plan`")
    expected = plan.model.get("file_sha256")
    if expected is None:
        raise AutoshardError(f"the plan does not record the content hash of its model file '{file_part}' (made by "
                             f"an older autoshard), so the file cannot be checked before it is imported; "
                             f"re-plan it with `autoshard plan {spec} ...`")
    try:
        actual = file_sha256(path)
    except OSError as exc:
        raise AutoshardError(f"model file '{file_part}' cannot be read ({exc.strerror}); check its permissions") \
            from exc
    if actual != expected:
        raise AutoshardError(f"model file '{file_part}' is not the model this plan was made for: its sha256 is "
                             f"{actual[:16]}..., the plan's model.file_sha256 {expected[:16]}...; nothing was "
                             f"imported; re-plan it with `autoshard plan {spec} ...`")
    return path


def _check_file_sha256(model: dict[str, Any]) -> dict[str, Any]:
    digest = model.get("file_sha256")
    if digest is not None and not (isinstance(digest, str) and _SHA256.fullmatch(digest)):
        raise AutoshardError(f"plan field 'model.file_sha256' must be 64 lowercase hexadecimal digits, got "
                             f"{str(digest)[:80]!r}; re-create the plan with `autoshard plan`")
    return model


def _mesh(d: Any, where: str) -> Mesh:
    if not isinstance(d, dict):
        raise TypeError(f"{where} must be a mapping of dp, tp, pp")
    unknown = sorted(str(k) for k in d if k not in ("dp", "tp", "pp", "cp"))
    if unknown:
        raise AutoshardError(f"plan field '{where}' has an unknown key {unknown[0][:40]!r}; a mesh has only dp, "
                             f"tp, pp and cp; remove it or re-create the plan with `autoshard plan`")
    return Mesh(**d)


def _memory(d: Any) -> Memory:
    if not isinstance(d, dict):
        raise TypeError("predicted.memory must be a mapping")
    known = {f.name for f in fields(Memory)}
    unknown = sorted(str(k) for k in d if k not in known)
    if unknown:
        raise AutoshardError(f"plan field 'predicted.memory' has an unknown key {unknown[0][:40]!r}; "
                             f"re-create the plan with `autoshard plan`")
    return Memory(**d)


def _plan_from_dict(d: dict[str, Any]) -> Plan:
    return Plan(
        model=_check_file_sha256(dict(_require_keys(d["model"], ("spec", "hash", "params", "layers"), "model"))),
        cluster=dict(d["cluster"]),
        global_batch=_int(d["global_batch"]),
        mesh=_mesh(d["mesh"], "mesh"),
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
        runtime=d.get("runtime", "autoshard"),  # plans written before the field: priced for autoshard's program
        notes=tuple(d.get("notes", ())),
        symbolic=_symbolic(d.get("symbolic", {})),
        search=_search(d.get("search", {})),
        recompute_blocks=dict(d.get("recompute_blocks", {})),
        dp_replicate=_int(d.get("dp_replicate", 1)),
        ep=_int(d.get("ep", 1)),
        experts=tuple(d.get("experts", ())),
        version=PLAN_VERSION,
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
    values["memory"] = _memory(d["memory"])
    return Predicted(**values)


def _alternative(d: dict[str, Any]) -> Alternative:
    return Alternative(
        mesh=_mesh(d["mesh"], "alternatives[].mesh"),
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


def _copied(value: Any) -> Any:
    return dict(value) if isinstance(value, dict) else value


def _ordered(obj: Any) -> Any:
    """Dataclasses to dicts in field order (docs/design.md's key order), tuples to lists."""
    if hasattr(obj, "__dataclass_fields__"):
        unless = getattr(obj, "WRITTEN_UNLESS", {})
        return {f.name: _ordered(getattr(obj, f.name)) for f in fields(obj)
                if f.name not in unless or getattr(obj, f.name) != unless[f.name]}
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
