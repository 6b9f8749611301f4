"""Capture cache: a model file's annotated graph, kept so that planning it again skips capture.

Capture is most of a plan's time (importing torch and ``torch.export``, exporting on meta,
counting FLOPs and bytes); the search after it takes well under a second. Users plan the same
model many times (another cluster, batch, pin or ``--time-limit``), so the graph that
``capture`` + ``annotate`` produce is stored after the first time and read back the next, and
a plan from the cache never imports torch.

**Key** (``entry_key``): the model file's resolved path and factory name, the capture batch,
folding on or off, the torch version, the Python version and a hash of autoshard's own
sources (a new autoshard captures again). **Validity**: while the model file loads and the model
is built and exported (``recording``), the capture notes what it reads besides its arguments,
and the entry is used only if all of it is as it was:

    modules        the model file; every module imported in that window; every loaded module
                   under the model file's directory (``dependencies``)
    environment    every variable the model's code read (``os.environ[...]``, ``.get``, ``in``,
                   ``os.getenv``), by a hash of its value at the window's start, unset being a
                   value of its own; the whole environment if the code listed it
    files          every file the model's code opened for reading (an audit hook on "open"),
                   and every directory it listed, by the names in it
    distributions  the version of each installed distribution a module of that window came from

Files are compared by content hash (the user's own modules, under the model file's directory, and
opened files up to ``DIGEST_LIMIT_BYTES``) or by size and modification time (installed modules,
as Python's own bytecode cache checks a source). Reads are charged to the first caller outside the
standard library: those of torch and autoshard (their own settings: debug and compile switches,
temporary files) and those of the import system (the modules list covers them) are not recorded.
A capture that opened a device, a pipe, a directory or anything under ``/proc``, ``/sys`` or
``/dev``, a file that is gone when the entry is written, that connected to the network or ran
another program, is not cached: nothing says what it would read next time. Errors are never
cached: a model that fails to capture fails again.

**Format**: JSON, tuples tagged (``_encode``), written to a temporary file and renamed into
place (a stopped run leaves no half-written entry). Pickle would be shorter; JSON keeps the
cache as safe to read as the plans are. A graph whose values JSON cannot carry exactly (checked
by decoding it again before writing) is simply not cached.

``AUTOSHARD_CACHE_DIR`` moves the cache (default ``$XDG_CACHE_HOME/autoshard`` or
``~/.cache/autoshard``); ``AUTOSHARD_CACHE=0`` or ``--no-cache`` turns it off.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import os
import stat
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from autoshard.ir.graph import Block, OpGraph, OpNode, ParamInfo
from autoshard.ir.plan import model_source

CACHE_VERSION = 6  # 2: entries record the environment, opened files and distributions read; 3: graphs carry cp_proofs;
# 4: graphs carry batch_coupling; 5: graphs carry loss_parallel_proof; 6: graphs carry hidden_backward
# Packages the key already pins (torch's and Python's versions, autoshard's sources): their
# modules need no entry of their own.
PINNED_PACKAGES = frozenset({"torch", "autoshard", "torchgen", "functorch"})
KEYED_PACKAGES = frozenset(sys.stdlib_module_names) | PINNED_PACKAGES
AUTOSHARD_ROOT = Path(__file__).resolve().parents[2]  # autoshard/
DIGEST_LIMIT_BYTES = 16 * 2**20  # opened files up to this size are compared by content, larger by stat
SPECIAL_ROOTS = ("/proc/", "/sys/", "/dev/")  # files whose content no stat or hash pins down
USER_MODEL_PREFIX = "autoshard_user_model_"  # modelfile's module names for model files


def cache_dir() -> Path | None:
    """Where entries live, or None when caching is off."""
    if os.environ.get("AUTOSHARD_CACHE", "1").lower() in ("0", "off", "false", "no"):
        return None
    if os.environ.get("AUTOSHARD_CACHE_DIR"):
        return Path(os.environ["AUTOSHARD_CACHE_DIR"]) / "capture"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "autoshard" / "capture"


def entry_key(model_path: Path, factory: str, batch_size: int, fold: bool, seq_len: int | None = None) -> str:
    parts = [
        CACHE_VERSION,
        str(model_path.resolve()),
        factory,
        batch_size,
        fold,
        _torch_version(),
        sys.version,
        autoshard_source_hash(),
    ] + ([seq_len] if seq_len is not None else [])
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]


def lookup(spec: str, batch_size: int, fold: bool, seq_len: int | None = None) -> OpGraph | None:
    """The cached graph of ``spec`` (``file.py:factory``), or None (off, absent, stale, unreadable)."""
    path = entry_path(spec, batch_size, fold, seq_len)
    if path is None or not path.is_file():
        return None
    try:
        entry = json.loads(path.read_text())
        if not all(_unchanged(dep) for dep in entry["dependencies"]) or not reads_unchanged(entry["reads"]):
            return None
        return decode_graph(entry["graph"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # a damaged entry is a miss; the capture that follows rewrites it


def store(spec: str, batch_size: int, fold: bool, graph: OpGraph, reads: Reads, seq_len: int | None = None) -> None:
    """Write ``graph`` for ``spec`` with the files and settings it came from (``reads``, from
    ``recording``); quietly skip what cannot be cached."""
    path = entry_path(spec, batch_size, fold, seq_len)
    if path is None or reads.uncacheable:
        return
    try:
        encoded = encode_graph(graph)
        if decode_graph(json.loads(json.dumps(encoded))) != graph:
            return  # a value JSON does not carry exactly: capture again next time rather than guess
        model_path = _model_path(spec)
        deps = dependencies(model_path, reads.modules_before) + opened_files(reads.files)
        entry = {"spec": spec, "dependencies": deps, "reads": reads_entry(model_path, reads), "graph": encoded}
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            json.dump(entry, f, separators=(",", ":"))
        os.replace(f.name, path)
    except (OSError, TypeError, ValueError):
        return  # a read-only or full disk costs the next plan a capture, nothing more
    except Uncacheable:
        return  # a device, a vanished file: capture again next time


def update_graph(spec: str, batch_size: int, fold: bool, graph: OpGraph, seq_len: int | None = None) -> None:
    """Replace the graph of ``spec``'s entry, keeping what it was captured from (the tensor-parallel proofs of
    more degrees, made later from the same model file: ``passes.capturing.front.capture_front``)."""
    path = entry_path(spec, batch_size, fold, seq_len)
    if path is None or not path.is_file():
        return
    try:
        entry = json.loads(path.read_text())
        encoded = encode_graph(graph)
        if entry.get("spec") != spec or decode_graph(json.loads(json.dumps(encoded))) != graph:
            return
        entry["graph"] = encoded
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            json.dump(entry, f, separators=(",", ":"))
        os.replace(f.name, path)
    except (OSError, TypeError, ValueError):
        return  # the next plan proves those degrees again


def dependencies(model_path: Path, modules_before: set[str]) -> list[list]:
    """[path, size, mtime_ns, sha256 or None] of the model file, of modules imported since ``modules_before`` and of
    loaded modules under the model file's directory (module doc)."""
    root = model_path.resolve().parent
    files = {str(model_path.resolve())}
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if not file or name.partition(".")[0] in KEYED_PACKAGES:
            continue
        resolved = Path(file).resolve()
        if name not in modules_before or resolved.is_relative_to(root):
            files.add(str(resolved))
    return [
        [f, *_stat(f), _digest(f) if Path(f).is_relative_to(root) else None] for f in sorted(files) if Path(f).is_file()
    ]


# ---------------------------------------------------------------------------- what a capture reads


class Uncacheable(Exception):
    """A capture read something no entry can pin down (a device, a socket, a file now gone)."""


@dataclass
class Reads:
    """What one capture read besides its arguments (module doc, **Validity**)."""

    modules_before: set[str]
    environ_at_start: dict[str, str]
    env_names: set[str] = field(default_factory=set)
    whole_env: bool = False  # the model's code listed the environment: every variable counts
    files: set[str] = field(default_factory=set)
    listings: set[str] = field(default_factory=set)
    uncacheable: str | None = None  # why this capture must not be cached


_recording: Reads | None = None  # the window in progress; the audit hook does nothing outside one
_hook_installed = False


@contextlib.contextmanager
def recording() -> Iterator[Reads]:
    """Within the block, note the environment variables read and the files opened or listed by code
    outside torch, autoshard and the standard library (``_charged``). Environment reads go through
    ``os.environ``'s class, swapped for ``_RecordingEnviron`` for the block (so that every name bound
    to it, ``from os import environ`` included, records); opens and listings through an audit hook,
    installed once (hooks cannot be removed) and a no-op outside the block."""
    global _recording
    _install_audit_hook()
    reads = Reads(set(sys.modules), dict(os.environ))
    environs = [env for env in (os.environ, getattr(os, "environb", None)) if type(env) is os._Environ]
    _recording = reads
    for env in environs:
        env.__class__ = _RecordingEnviron
    try:
        yield reads
    finally:
        for env in environs:
            env.__class__ = os._Environ
        _recording = None


class _RecordingEnviron(os._Environ):
    """``os._Environ`` noting the names read (``get``, ``in`` and ``getenv`` read through
    ``__getitem__``) and a listing of the whole environment."""

    def __getitem__(self, key):
        reads = _recording
        if reads is not None and _charged():
            reads.env_names.add(os.fsdecode(key))
        return super().__getitem__(key)

    def __iter__(self):
        reads = _recording
        if reads is not None and _charged():
            reads.whole_env = True
        return super().__iter__()


def _install_audit_hook() -> None:
    global _hook_installed
    if not _hook_installed:
        sys.addaudithook(_audit)
        _hook_installed = True


# Audit events after which nothing on disk says what the capture saw: the network, other programs.
OUTSIDE_EVENTS = frozenset(
    {
        "socket.connect",
        "socket.sendto",
        "urllib.Request",
        "subprocess.Popen",
        "os.system",
        "os.posix_spawn",
        "os.exec",
        "os.fork",
        "os.spawn",
    }
)


def _audit(event: str, args: tuple) -> None:
    """Note files opened for reading and directories listed, inside ``recording`` only; a connection
    or another program run (``OUTSIDE_EVENTS``) makes the capture uncacheable. Never raises (an
    audit hook's exception would fail the open): a surprise makes the capture uncacheable too."""
    reads = _recording
    if reads is None:
        return
    if event in OUTSIDE_EVENTS:
        if _charged():
            reads.uncacheable = event
        return
    if event not in ("open", "os.listdir", "os.scandir"):
        return
    try:
        path = args[0]
        if not isinstance(path, (str, bytes, os.PathLike)):
            return  # a descriptor already open, or the current directory listed by default
        if event == "open" and not _opened_for_reading(args[1], args[2]):
            return  # written, truncated or created: an output, not an input
        if _charged():
            (reads.files if event == "open" else reads.listings).add(os.path.abspath(os.fsdecode(path)))
    except Exception as exc:  # noqa: BLE001 - see docstring
        reads.uncacheable = f"{event}: {type(exc).__name__}"


def _opened_for_reading(mode: str | None, flags: int) -> bool:
    """``open``'s mode ("r", "r+", "a+" keep what is there) or ``os.open``'s flags."""
    if isinstance(mode, str):
        return "r" in mode or ("a" in mode and "+" in mode)
    return (flags & os.O_ACCMODE) != os.O_WRONLY and not flags & (os.O_TRUNC | os.O_EXCL)


def _charged(skip: int = 2) -> bool:
    """Whether the read in progress is the model's. Walking out from it: the first caller outside
    the standard library is not torch or autoshard, and the read is made neither by the import
    system (the import system itself, or a finder or loader it called: the modules list covers what
    they read) nor by the body of an installed module being imported (a library's settings at
    import time; its version is in ``distributions``). A module body is told from a loader by
    what the import system called: ``<module>`` code, or a function."""
    frame, inner, charged = sys._getframe(skip), None, False
    while frame is not None:
        name = frame.f_globals.get("__name__") or ""
        top = name.partition(".")[0]
        if top in PINNED_PACKAGES:
            return charged
        if _is_import_system(name) and (inner is None or _imported_by_the_system(inner)):
            return False
        elif top not in sys.stdlib_module_names:
            charged = True
        frame, inner = frame.f_back, frame
    return charged


def _imported_by_the_system(callee) -> bool:
    """What the import system called (``callee``) is a finder or loader, or the body of an installed
    or standard module: not the user's own module body."""
    name = callee.f_globals.get("__name__") or ""
    if _is_import_system(name):
        return False  # further in: the innermost import-system frame decides
    if callee.f_code.co_name != "<module>":
        return True  # a finder or loader
    if name.startswith(USER_MODEL_PREFIX):
        return False  # the model file's body, wherever the file is
    return name.partition(".")[0] in sys.stdlib_module_names or _is_installed(callee.f_code.co_filename)


def _is_import_system(module_name: str) -> bool:
    return module_name.startswith(("_frozen_importlib", "importlib._bootstrap"))


def _is_installed(filename: str) -> bool:
    return any(part in ("site-packages", "dist-packages") for part in Path(filename).parts)


def reads_entry(model_path: Path, reads: Reads) -> dict:
    """The entry's ``reads``: environment variables by a hash of their value at the start (None:
    unset), the whole environment's hash if it was listed, listings by a hash of the names, and
    the versions of the distributions imported. Raises Uncacheable for a directory gone."""
    env = reads.environ_at_start
    return {
        "environment": {name: _value_hash(env.get(name)) for name in sorted(reads.env_names)},
        "whole_environment": _environment_hash(env) if reads.whole_env else None,
        "listings": [[d, _listing_hash(d)] for d in sorted(reads.listings)],
        "distributions": distributions(model_path, reads.modules_before),
    }


def reads_unchanged(entry: dict) -> bool:
    """Every recorded variable, listing and distribution version as it was (``reads_entry``)."""
    if any(_value_hash(os.environ.get(name)) != h for name, h in entry["environment"].items()):
        return False
    if entry["whole_environment"] is not None and _environment_hash(dict(os.environ)) != entry["whole_environment"]:
        return False
    try:
        if any(_listing_hash(d) != h for d, h in entry["listings"]):
            return False
    except Uncacheable:
        return False
    return all(_installed_version(dist) == version for dist, version in entry["distributions"].items())


def opened_files(files: set[str]) -> list[list]:
    """[path, size, mtime_ns, sha256 or None] of each opened file (by content up to
    ``DIGEST_LIMIT_BYTES``); Uncacheable for one that is gone or is no regular file."""
    rows = []
    for file in sorted(files):
        try:
            st = os.stat(file)
        except OSError:
            raise Uncacheable(f"{file} is gone") from None
        if not stat.S_ISREG(st.st_mode) or file.startswith(SPECIAL_ROOTS):
            raise Uncacheable(f"{file} is not a regular file")
        digest = _digest(file) if st.st_size <= DIGEST_LIMIT_BYTES else None
        rows.append([file, st.st_size, st.st_mtime_ns, digest])
    return rows


def distributions(model_path: Path, modules_before: set[str]) -> dict[str, str]:
    """{distribution: version} of the installed packages whose modules were imported in the window
    (not the user's own, under the model file's directory, nor the keyed ones)."""
    root = model_path.resolve().parent
    tops = set()
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        top = name.partition(".")[0]
        if name in modules_before or top in KEYED_PACKAGES or not file or Path(file).resolve().is_relative_to(root):
            continue
        tops.add(top)
    if not tops:
        return {}
    by_package = importlib.metadata.packages_distributions()
    dists = sorted({dist for top in tops for dist in by_package.get(top, [])})
    return {dist: _installed_version(dist) for dist in dists}


def _installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _value_hash(value: str | None) -> str | None:
    """A value as a short hash (the cache holds no secrets from the environment); None stays None."""
    return None if value is None else hashlib.sha256(value.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def _environment_hash(env: dict[str, str]) -> str:
    return _value_hash(json.dumps(sorted(env.items())))


def _listing_hash(directory: str) -> str:
    if directory.startswith(SPECIAL_ROOTS):
        raise Uncacheable(f"{directory} lists a device or process table")
    try:
        return _value_hash(json.dumps(sorted(os.listdir(directory))))
    except OSError:
        raise Uncacheable(f"{directory} cannot be listed") from None


# ---------------------------------------------------------------------------- JSON form


def encode_graph(graph: OpGraph) -> dict:
    """The graph as JSON-ready values; ``fold`` as its two fields."""
    out = {f.name: _encode(getattr(graph, f.name)) for f in fields(OpGraph) if f.name != "fold"}
    out["fold"] = None if graph.fold is None else [graph.fold.path, graph.fold.layers, graph.fold.first]
    return out


def decode_graph(d: dict) -> OpGraph:
    values = {f.name: _decode(d[f.name]) for f in fields(OpGraph) if f.name != "fold"}
    values["nodes"] = [OpNode(**n) for n in values["nodes"]]
    values["params"] = [ParamInfo(**p) for p in values["params"]]
    values["blocks"] = [Block(**b) for b in values["blocks"]]
    graph = OpGraph(**values)
    if d["fold"] is not None:
        from autoshard.passes.capturing.fold import Fold

        graph.fold = Fold(*d["fold"])
    return graph


def _encode(x: Any) -> Any:
    """Tuples as {"t": [...]}, dataclasses (nodes, params, blocks) as dicts, dicts with string keys."""
    if isinstance(x, tuple):
        return {"t": [_encode(v) for v in x]}
    if isinstance(x, list):
        return [_encode(v) for v in x]
    if isinstance(x, dict):
        if not all(isinstance(k, str) for k in x):
            raise TypeError("only string keys")
        return {"d": {k: _encode(v) for k, v in x.items()}}
    if hasattr(x, "__dataclass_fields__"):
        return {"d": {f.name: _encode(getattr(x, f.name)) for f in fields(x)}}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"cannot cache a {type(x).__name__}")


def _decode(x: Any) -> Any:
    if isinstance(x, list):
        return [_decode(v) for v in x]
    if isinstance(x, dict):
        if "t" in x:
            return tuple(_decode(v) for v in x["t"])
        return {k: _decode(v) for k, v in x["d"].items()}
    return x


# ---------------------------------------------------------------------------- helpers


def entry_path(spec: str, batch_size: int, fold: bool, seq_len: int | None = None) -> Path | None:
    directory = cache_dir()
    if directory is None or ":" not in spec:
        return None
    model_path, factory = model_source(spec)
    if not model_path.is_file():
        return None
    return directory / f"{entry_key(model_path, factory, batch_size, fold, seq_len)}.json"


def _model_path(spec: str) -> Path:
    return model_source(spec)[0]


def _stat(file: str) -> tuple[int, int]:
    st = os.stat(file)
    return st.st_size, st.st_mtime_ns


def _digest(file: str) -> str:
    return hashlib.sha256(Path(file).read_bytes()).hexdigest()


def _unchanged(dep: list) -> bool:
    """The user's own files (under the model file's directory) by content, since an edit can keep
    size and timestamp (two saves within the file system's clock tick); installed ones by stat."""
    path, size, mtime_ns, digest = dep
    try:
        if digest is not None:
            return os.stat(path).st_size == size and _digest(path) == digest
        return _stat(path) == (size, mtime_ns)
    except OSError:
        return False


@functools.lru_cache(maxsize=1)
def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")  # reads the installed metadata; does not import torch
    except importlib.metadata.PackageNotFoundError:
        return ""


@functools.lru_cache(maxsize=1)
def autoshard_source_hash() -> str:
    """sha256 of every source file of the package, by path: what a result computed by this code is keyed by."""
    h = hashlib.sha256()
    for file in sorted(AUTOSHARD_ROOT.rglob("*.py")):
        h.update(file.relative_to(AUTOSHARD_ROOT).as_posix().encode())
        h.update(file.read_bytes())
    return h.hexdigest()
