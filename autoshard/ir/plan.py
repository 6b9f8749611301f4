"""Plan: the planner's decision, its predicted cost, and the alternatives it weighed.

A plan is a review artifact: ``plan.json`` is versioned, self-describing, deterministic
(same inputs give the same bytes) and JSON only, so loading one never runs code. Every
predicted figure is a sum of named parts (``Predicted``); alternatives carry the same
breakdown and the reason they lost.

``Plan`` holds one record per section of its JSON (``ir.plan_format``, version 2): ``decisions``
(``ir.decisions.Decisions``, the search's own record), ``layout``, ``predicted``, ``review`` and
``provenance``, beside the model, the cluster and the global batch. Every field of a section's
record is also read flat (``plan.mesh``, ``plan.zero_stage``, ``plan.tensor_parallel``, ``plan.notes``):
read-only accessors made from the records' fields (``_flat_accessors``). ``Plan.of`` builds a plan from
those flat names. Plans of version 1 (one flat object) are read as the same ``Plan`` and saved as
version 2.
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
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from operator import attrgetter
from pathlib import Path
from typing import IO, Any

from autoshard.errors import AutoshardError
from autoshard.ir.decisions import (
    FLOAT8_OFF,
    OFFLOAD_NONE,
    Decisions,
    Mesh,
    async_tp_refusal,
    compile_loss_refusal,
    compile_runs,
    float8_runs,
    offload_refusal,
    tp_style,
)
from autoshard.ir.plan_format import (  # noqa: F401 (the records and names are re-exported)
    PLAN_RECOMPUTE,
    PLAN_RUNTIMES,
    PLAN_VERSION,
    READ_VERSIONS,
    RECOMPUTE_MODES,
    SCHEDULES,
    SECTION_OF,
    SECTION_RECORDS,
    SECTIONS,
    Alternative,
    Memory,
    PlanLayout,
    PlanProvenance,
    PlanReview,
    Predicted,
    Stage,
    flatten,
)
from autoshard.ir.plan_schema import bounded_json_int, check_plan_dict


def _flat_accessors(cls: type) -> type:
    """A read-only property on ``cls`` for every field of every section record (``SECTION_RECORDS``):
    ``plan.zero_stage`` is ``plan.decisions.zero_stage``. A name ``cls`` defines itself keeps its own."""
    for section, record in SECTION_RECORDS.items():
        for f in fields(record):
            if f.name in cls.__dict__:
                continue
            assert f.name not in {g.name for g in fields(cls)}, f"{section}.{f.name} shadows a field of {cls.__name__}"
            setattr(cls, f.name, property(attrgetter(f"{section}.{f.name}"), doc=f"``{section}.{f.name}``"))
    return cls


@_flat_accessors
@dataclass(frozen=True)
class Plan:
    """The plan: what it is for (model, cluster, global batch), and one record per section of ``plan.json``
    (``ir.plan_format``). Its checks (``__post_init__``) are the ones no section can make alone.
    ``decisions.sequence_parallel`` is what the TP styles run (a sequence-parallel style of ``ir.decisions``'
    second table in ``layout.tensor_parallel``): the plan records it there only; ``decisions.loss_parallel``
    likewise (the output projection's ``colwise-loss-parallel`` style)."""

    model: dict[str, Any]  # spec, hash, params, layers
    cluster: dict[str, Any]  # Cluster.to_dict()
    global_batch: int
    decisions: Decisions
    layout: PlanLayout
    predicted: Predicted
    review: PlanReview = field(default_factory=PlanReview)
    provenance: PlanProvenance = field(default_factory=PlanProvenance)
    version: int = PLAN_VERSION  # the format it is written in: a plan read from an older version has this one

    def __post_init__(self):
        d, layout = self.decisions, self.layout
        rows = [tp_style(style) for style in layout.tensor_parallel.values()]
        sequence_parallel = any(row.sequence_parallel for row in rows)
        loss_parallel = any(row.loss_parallel for row in rows)
        if (d.sequence_parallel, d.loss_parallel) != (sequence_parallel, loss_parallel):
            d = replace(d, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
            object.__setattr__(self, "decisions", d)
        if loss_parallel and d.mesh.cp > 1 and d.mesh.pp == 1:
            raise AutoshardError(
                f"the colwise-loss-parallel style runs beside cp only inside pipeline stages (mesh {d.mesh}); "
                f"re-plan, or give the output projection colwise-gather"
            )
        refusal = async_tp_refusal(d.mesh, d.compile, sequence_parallel, "nccl") if d.async_tp else ""
        if refusal:
            raise AutoshardError(f"async_tp is true but cannot run in this plan: {refusal}; or set it false")
        refusal = compile_loss_refusal(d.mesh, loss_parallel) if d.compile_loss else ""
        if refusal:
            raise AutoshardError(f"compile_loss is true but cannot run in this plan: {refusal}; or set it false")
        if d.zero_stage not in (0, 1, 2, 3):
            raise AutoshardError(f"zero_stage={d.zero_stage} must be 0, 1, 2 or 3")
        if d.recompute not in PLAN_RECOMPUTE:
            raise AutoshardError(f"recompute={d.recompute!r} must be one of {', '.join(PLAN_RECOMPUTE)}")
        mixed = d.recompute == "mixed"
        if (
            len(d.recompute_blocks) != (len(layout.blocks) if mixed else 0)
            or not layout.blocks
            and mixed
            or any(m not in RECOMPUTE_MODES for m in d.recompute_blocks)
        ):
            raise AutoshardError(
                f"recompute={d.recompute!r} with recompute_blocks {d.recompute_blocks!r}: a "
                f"mixed plan gives every block one of {', '.join(RECOMPUTE_MODES)}, others none"
            )
        if d.schedule not in SCHEDULES:
            raise AutoshardError(f"schedule={d.schedule!r} must be one of {', '.join(SCHEDULES)}")
        if self.provenance.runtime not in PLAN_RUNTIMES:
            raise AutoshardError(f"runtime={self.provenance.runtime!r} must be one of {', '.join(PLAN_RUNTIMES)}")
        mesh = d.mesh
        if mesh.pp > 1 and len(layout.split_points) != mesh.pp * d.virtual_stages - 1:
            raise AutoshardError(
                f"pp={mesh.pp} x {d.virtual_stages} virtual stages needs "
                f"{mesh.pp * d.virtual_stages - 1} split points, got {len(layout.split_points)}"
            )
        if (mesh.pp > 1) != (d.schedule != "none"):
            raise AutoshardError(
                f"schedule {d.schedule!r} does not fit pp={mesh.pp}: pipelines need "
                f"one of {', '.join(SCHEDULES[1:])}, and pp=1 needs none"
            )
        if d.dp_replicate < 1 or mesh.dp % d.dp_replicate or (d.dp_replicate > 1 and (d.zero_stage < 2 or mesh.pp > 1)):
            raise AutoshardError(
                f"dp_replicate={d.dp_replicate} must divide dp={mesh.dp}, and HSDP "
                f"(dp_replicate > 1) needs ZeRO-2 or 3 without pipeline stages"
            )
        if d.ep < 1 or mesh.dp % d.ep or (d.ep > 1 and not layout.experts):
            raise AutoshardError(
                f"ep={d.ep} must divide dp={mesh.dp}, and ep > 1 needs the expert groups it shards (layout.experts)"
            )
        if (d.float8 != FLOAT8_OFF) != bool(layout.float8_linears):
            raise AutoshardError(
                f"float8={d.float8!r} and {len(layout.float8_linears)} float8 linears: a float8 recipe needs the "
                f"linears it converts (layout.float8_linears), and float8 off none"
            )
        modes = sorted(set(d.recompute_blocks or (d.recompute,)))
        if d.compile and not all(compile_runs(mesh, d.ep, sequence_parallel, m, d.schedule) for m in modes):
            raise AutoshardError(
                f"compile is true, but compiled blocks are not emitted beside mesh {mesh}, ep {d.ep}, recompute "
                f"{'/'.join(modes)} and schedule {d.schedule} (ir.decisions.compile_runs); set it false or re-plan"
            )
        if d.float8 != FLOAT8_OFF and not float8_runs(mesh, d.ep):
            raise AutoshardError(f"float8={d.float8!r} is not emitted beside ep {d.ep}; set it off or re-plan")
        refusal = offload_refusal(mesh, d.zero_stage, d.ep, float8=d.float8) if d.offloaded else None
        if refusal:
            raise AutoshardError(f"offload={d.offload!r}: {refusal}; re-create the plan with `autoshard plan`")
        per_step = mesh.dp * d.microbatch_size * d.num_microbatches
        if per_step != self.global_batch:
            raise AutoshardError(
                f"dp {mesh.dp} x micro-batch {d.microbatch_size} x {d.num_microbatches} "
                f"micro-batches = {per_step}, not the global batch {self.global_batch}"
            )

    @classmethod
    def of(cls, **flat: Any) -> Plan:
        """The plan of flat keywords: ``Plan``'s own fields, and each section record's fields by name
        (``zero_stage=3``, ``tensor_parallel={...}``, ``notes=(...)``), ``recompute_blocks`` by block path as the
        flat accessor gives it. A section given whole (``decisions=...``) takes the flat names of its fields
        on top of it."""
        own = {f.name for f in fields(cls)}
        unknown = sorted(k for k in flat if k not in own and k not in SECTION_OF and k not in _STYLE_RECORDED)
        if unknown:
            raise TypeError(f"Plan.of() got an unknown field {unknown[0]!r}")
        top = {k: v for k, v in flat.items() if k in own}
        blocks = tuple(flat.get("blocks", top["layout"].blocks if "layout" in top else ()))
        if isinstance(flat.get("recompute_blocks"), dict):
            flat = {
                **flat,
                "recompute_blocks": tuple(flat["recompute_blocks"].get(b, "none") for b in blocks)
                if flat["recompute_blocks"]
                else (),
            }
        for section, record in SECTION_RECORDS.items():
            names = {f.name for f in fields(record)}
            values = {k: v for k, v in flat.items() if k in names}
            top[section] = replace(top[section], **values) if section in top else record(**values)
        return cls(**top)

    def stage_group(self, ranks: tuple[int, ...]) -> dict[str, Any] | None:
        """The node group (its ``cluster.groups`` entry) whose ranks hold all of ``ranks``; None on a homogeneous
        cluster or where they span groups. Groups hold consecutive whole nodes in the order listed."""
        groups, per_node = self.cluster.get("groups"), self.cluster["devices_per_node"]
        if not groups or not ranks:
            return None
        end = 0
        for group in groups:
            start, end = end, end + group["nodes"] * per_node
            if start <= min(ranks) < end:
                return group if max(ranks) < end else None
        return None

    @property
    def peak_tflops_per_rank(self) -> float:
        """The devices' peak TFLOP/s averaged over the ranks (``Cluster.mean_peak_tflops``): MFU's per rank."""
        groups = self.cluster.get("groups")
        if not groups:
            return self.cluster["device"]["peak_tflops"]
        return sum(g["nodes"] * g["device"]["peak_tflops"] for g in groups) / self.cluster["nodes"]

    def tightest_memory(self) -> tuple[int, int]:
        """(peak bytes, device bytes) of the rank with the least room: on node groups each pipeline rank against its
        own group's device (``Predicted.pp_rank_memory``), else the peak against the cluster's device (the
        smallest of the groups')."""
        device = self.cluster["device"]["memory_bytes"]
        by_rank = self.predicted.pp_rank_memory
        if not self.cluster.get("groups") or self.mesh.pp == 1 or not by_rank:
            return self.predicted.memory_peak_bytes_per_rank, device
        per_stage = self.world_size // self.mesh.pp
        pairs = [
            (m.peak_bytes, self.stage_group((r * per_stage,))["device"]["memory_bytes"]) for r, m in enumerate(by_rank)
        ]
        return min(pairs, key=lambda pair: (pair[1] - pair[0], pair))

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def recompute_blocks(self) -> dict[str, str]:
        """A mixed plan's mode of each block, by block path (``plan.json``'s ``decisions.recompute_blocks``;
        ``decisions.recompute_blocks`` holds them in ``blocks`` order); {} for the others."""
        return dict(zip(self.layout.blocks, self.decisions.recompute_blocks))

    def to_json(self) -> str:
        """Deterministic JSON of version ``PLAN_VERSION``: fixed sections and key order (``ir.plan_format``),
        floats rounded to 6 significant digits."""
        doc: dict[str, Any] = {"version": PLAN_VERSION}
        for f in fields(self):
            if f.name != "version":
                doc[f.name] = self._decisions_section() if f.name == "decisions" else _ordered(getattr(self, f.name))
        return json.dumps(_rounded(doc), indent=2) + "\n"

    def _decisions_section(self) -> dict[str, Any]:
        """``decisions`` as ``plan.json`` holds it: the written fields (``plan_format.SECTIONS``), recompute_blocks
        by block path."""
        d, unless = self.decisions, Decisions.WRITTEN_UNLESS
        values = {
            name: self.recompute_blocks if name == "recompute_blocks" else getattr(d, name)
            for name in SECTIONS["decisions"]
        }
        return {name: _ordered(value) for name, value in values.items() if name not in unless or value != unless[name]}

    def save(self, path: str | Path) -> None:
        """Write atomically: a crash never leaves a half-written plan."""
        write_text_atomic(Path(path), self.to_json())

    @classmethod
    def from_json(cls, text: str, source: str = "plan") -> Plan:
        try:
            data = json.loads(text, parse_int=bounded_json_int)  # ints of 30+ digits: named by the schema
        except json.JSONDecodeError as exc:
            raise AutoshardError(
                f"{source}: not valid JSON ({exc.msg} at line {exc.lineno}); re-create it with `autoshard plan`"
            ) from exc
        except RecursionError:
            raise AutoshardError(
                f"{source}: not a plan (JSON nested too deeply); re-create it with `autoshard plan`"
            ) from None
        if not isinstance(data, dict):
            raise AutoshardError(f"{source}: a plan is a JSON object; re-create it with `autoshard plan`")
        return cls.from_dict(data, source)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "plan") -> Plan:
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


_STYLE_RECORDED = ("sequence_parallel", "loss_parallel")  # Decisions fields the TP styles record (Plan doc)
MAX_PLAN_BYTES = 64 * 2**20  # a plan of a 2^18-device cluster with every alternative is a few MiB


def load_plan(path: str | Path) -> Plan:
    """The plan in a regular file of at most ``MAX_PLAN_BYTES`` (a device or a pipe is refused unread)."""
    path = Path(path)
    if path.exists() and not path.is_file():
        raise AutoshardError(
            f"plan file '{path}' is not a regular file (a folder, device or pipe); name a plan "
            f"file that `autoshard plan -o` wrote"
        )
    if not path.is_file():
        raise AutoshardError(f"plan file '{path}' not found; create one with `autoshard plan MODEL -o {path}`")
    if path.stat().st_size > MAX_PLAN_BYTES:
        raise AutoshardError(
            f"plan file '{path}' is {path.stat().st_size / 2**20:.0f} MiB, more than a plan can be "
            f"({MAX_PLAN_BYTES // 2**20} MiB); re-create it with `autoshard plan`"
        )
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
        raise AutoshardError(
            f"cannot write {failed} ({exc.strerror or type(exc).__name__}); "
            f"fix: choose a writable file in an existing folder"
        ) from exc
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


HF_PREFIX = "hf:"  # hf:DIR, a transformers folder (config.json) planned without a model file


def model_source(spec: str) -> tuple[Path, str]:
    """The file whose bytes identify the model of ``spec``, and its factory: ``path/to/file.py:factory`` ->
    (file.py, factory); ``hf:DIR`` -> (DIR/config.json, "hf")."""
    if spec.startswith(HF_PREFIX):
        return Path(spec[len(HF_PREFIX) :]) / "config.json", "hf"
    parts = spec.rsplit(":", 1)
    return Path(parts[0]), parts[1] if len(parts) == 2 else ""


def model_file_sha256(spec: str) -> str | None:
    """``model.file_sha256`` of a plan of ``spec``: its model file's content hash (None when unreadable)."""
    try:
        return file_sha256(model_source(spec)[0])
    except OSError:
        return None


def check_model_file(plan: Plan) -> Path:
    """The plan's model file, checked before anything imports it: a plan is data, and its ``model.spec``
    names a file that ``compile``, ``run`` and ``verify`` import (run). That file must be a Python file
    whose bytes are the ones planned (``model.file_sha256``). A plan without the hash (made before plans
    recorded it) is refused too: nothing could tell its file from another one."""
    spec = plan.model["spec"]
    path = model_source(spec)[0]
    file_part = str(path)
    if path.is_dir():
        raise AutoshardError(
            f"model file '{file_part}' is a folder; the plan's model.spec must name a Python "
            f"file (path/to/file.py:factory); re-plan it with `autoshard plan`"
        )
    if not path.is_file():
        raise AutoshardError(f"model file '{file_part}' not found; check the path (relative to {Path.cwd()})")
    if path.suffix != ".py" and not spec.startswith(HF_PREFIX):  # hf:DIR's config.json is read as JSON only
        raise AutoshardError(
            f"model file '{file_part}' is not a Python file (.py); a plan's model.spec names "
            f"the model file it was made for; re-plan it with `autoshard plan`"
        )
    expected = plan.model.get("file_sha256")
    if expected is None:
        raise AutoshardError(
            f"the plan does not record the content hash of its model file '{file_part}' (made by "
            f"an older autoshard), so the file cannot be checked before it is imported; "
            f"re-plan it with `autoshard plan {spec} ...`"
        )
    try:
        actual = file_sha256(path)
    except OSError as exc:
        raise AutoshardError(
            f"model file '{file_part}' cannot be read ({exc.strerror}); check its permissions"
        ) from exc
    if actual != expected:
        raise AutoshardError(
            f"model file '{file_part}' is not the model this plan was made for: its sha256 is "
            f"{actual[:16]}..., the plan's model.file_sha256 {expected[:16]}...; nothing was "
            f"imported; re-plan it with `autoshard plan {spec} ...`"
        )
    return path


def _check_file_sha256(model: dict[str, Any]) -> dict[str, Any]:
    digest = model.get("file_sha256")
    if digest is not None and not (isinstance(digest, str) and _SHA256.fullmatch(digest)):
        raise AutoshardError(
            f"plan field 'model.file_sha256' must be 64 lowercase hexadecimal digits, got "
            f"{str(digest)[:80]!r}; re-create the plan with `autoshard plan`"
        )
    return model


def _mesh(d: Any, where: str) -> Mesh:
    if not isinstance(d, dict):
        raise TypeError(f"{where} must be a mapping of dp, tp, pp")
    unknown = sorted(str(k) for k in d if k not in ("dp", "tp", "pp", "cp"))
    if unknown:
        raise AutoshardError(
            f"plan field '{where}' has an unknown key {unknown[0][:40]!r}; a mesh has only dp, "
            f"tp, pp and cp; remove it or re-create the plan with `autoshard plan`"
        )
    return Mesh(**d)


def _memory(d: Any) -> Memory:
    if not isinstance(d, dict):
        raise TypeError("predicted.memory must be a mapping")
    known = {f.name for f in fields(Memory)}
    unknown = sorted(str(k) for k in d if k not in known)
    if unknown:
        raise AutoshardError(
            f"plan field 'predicted.memory' has an unknown key {unknown[0][:40]!r}; "
            f"re-create the plan with `autoshard plan`"
        )
    return Memory(**d)


def without_float8(plan: Plan) -> Plan:
    """The plan's twin with float8 off: the same layout (mesh, sharding, recompute, micro-batches) without torchao's
    float8 linears, what CPU ranks run of a float8 plan (``verify``, ``dryrun``); any other plan as it is."""
    if plan.decisions.float8 == FLOAT8_OFF:
        return plan
    return replace(
        plan, decisions=replace(plan.decisions, float8=FLOAT8_OFF), layout=replace(plan.layout, float8_linears=())
    )


def without_async_tp(plan: Plan) -> Plan:
    """The plan's twin with async TP off: the same layout and compiled blocks, the TP collectives run as DTensor
    issues them rather than micro-pipelined with their matmuls; what CPU ranks run of an async-TP plan
    (``verify``: gloo has no symmetric memory); any other plan as it is."""
    return replace(plan, decisions=replace(plan.decisions, async_tp=False)) if plan.decisions.async_tp else plan


def in_fp32(plan: Plan) -> Plan:
    """The plan's twin in fp32: the same layout (mesh, sharding, recompute, micro-batches, float8) with
    ``precision`` fp32, what ``verify`` runs beside a 16-bit plan to judge its layout at fp32's tolerance."""
    return replace(plan, decisions=replace(plan.decisions, precision="fp32"))


def _plan_from_dict(d: dict[str, Any]) -> Plan:
    """The plan of a flat (version 1 shaped) document that ``check_plan_dict`` passed; an absent optional key
    reads as its field's default."""
    layout = PlanLayout(
        blocks=tuple(d.get("blocks", ())),
        tensor_parallel=dict(d["tensor_parallel"]),
        split_points=tuple(d.get("split_points", ())),
        stages=tuple(Stage(s["index"], tuple(s["modules"]), tuple(s["ranks"])) for s in d["stages"]),
        experts=tuple(d.get("experts", ())),
        float8_linears=tuple(d.get("float8_linears", ())),
        unread_params=tuple(d.get("unread_params", ())),
    )
    return Plan(
        model=_check_file_sha256(dict(_require_keys(d["model"], ("spec", "hash", "params", "layers"), "model"))),
        cluster=dict(d["cluster"]),
        global_batch=_int(d["global_batch"]),
        decisions=_decisions(d, layout.blocks),
        layout=layout,
        predicted=_predicted(d["predicted"]),
        review=PlanReview(
            alternatives=tuple(_alternative(a) for a in d["alternatives"]),
            tensor_parallel_reasons=dict(d.get("tensor_parallel_reasons", {})),
            notes=tuple(d.get("notes", ())),
            symbolic=_symbolic(d.get("symbolic", {})),
            search=_search(d.get("search", {})),
        ),
        provenance=PlanProvenance(
            pinned=tuple(d.get("pinned", ())),
            runtime=d.get("runtime", "autoshard"),  # plans written before the field: priced for autoshard's program
        ),
        version=PLAN_VERSION,
    )


_READ_RULE: dict[str, Callable[[Any], Any]] = {
    "count": lambda v: _int(v),
    "positive": float,
    "choice": lambda v: v,
    "flag": bool,
    "mesh": lambda v: _mesh(v, "mesh"),
}


def _decisions(d: dict[str, Any], blocks: tuple[str, ...]) -> Decisions:
    """``Decisions`` of a plan's fields, each read by its ``in_plan`` rule; an absent one is its default."""
    values = {}
    for f in fields(Decisions):
        rule = f.metadata.get("plan")
        if rule is not None and f.name in d:
            value = d[f.name]
            values[f.name] = _block_modes(value, blocks) if rule == "recompute_blocks" else _READ_RULE[rule](value)
    return Decisions(**values)


def _block_modes(modes: dict[str, str], blocks: tuple[str, ...]) -> tuple[str, ...]:
    """``recompute_blocks`` by block path -> each block's mode in ``blocks`` order (a block not named: none)."""
    if not modes:
        return ()
    unknown = [b for b in modes if b not in blocks]
    if unknown:
        raise AutoshardError(
            f"plan field 'recompute_blocks' names {unknown[0][:80]!r}, which is not one of the "
            f"plan's blocks (layout.blocks); re-create the plan with `autoshard plan`"
        )
    return tuple(modes.get(b, "none") for b in blocks)


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
    values["pp_rank_memory"] = tuple(_memory(m) for m in d.get("pp_rank_memory", ()))
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
        float8=d.get("float8", FLOAT8_OFF),
        offload=d.get("offload", OFFLOAD_NONE),
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
    """Dataclasses to dicts in field order (docs/design.md's key order), tuples to lists."""
    if hasattr(obj, "__dataclass_fields__"):
        unless = getattr(obj, "WRITTEN_UNLESS", {})
        return {
            f.name: _ordered(getattr(obj, f.name))
            for f in fields(obj)
            if f.name not in unless or getattr(obj, f.name) != unless[f.name]
        }
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
