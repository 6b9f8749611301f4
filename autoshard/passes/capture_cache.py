"""Capture cache: a model file's annotated graph, kept so that planning it again skips capture.

Capture is most of a plan's time (importing torch and ``torch.export``, exporting on meta,
counting FLOPs and bytes); the search after it takes well under a second. Users plan the same
model many times (another cluster, batch, pin or ``--time-limit``), so the graph that
``capture`` + ``annotate`` produce is stored after the first time and read back the next, and
a plan from the cache never imports torch.

**Key** (``entry_key``): the model file's resolved path and factory name, the capture batch,
folding on or off, the torch version, the Python version and a hash of autoshard's own
sources (a new autoshard captures again). **Validity** (``dependencies``): the entry lists the
files the capture ran (the model file; every module imported while the model file loaded and
the model was exported; every loaded module under the model file's directory): the user's own
files (under that directory) by content hash, installed ones by size and modification time as
Python's own bytecode cache checks a source; any change to one and the entry is not used. Errors are never cached: a model that fails to capture fails again.

**Format**: JSON, tuples tagged (``_encode``), written to a temporary file and renamed into
place (a stopped run leaves no half-written entry). Pickle would be shorter; JSON keeps the
cache as safe to read as the plans are. A graph whose values JSON cannot carry exactly (checked
by decoding it again before writing) is simply not cached.

``AUTOSHARD_CACHE_DIR`` moves the cache (default ``$XDG_CACHE_HOME/autoshard`` or
``~/.cache/autoshard``); ``AUTOSHARD_CACHE=0`` or ``--no-cache`` turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import sys
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import Any

from autoshard.ir.graph import Block, OpGraph, OpNode, ParamInfo

CACHE_VERSION = 1
# Packages the key already pins (torch's and Python's versions, autoshard's sources): their
# modules need no entry of their own.
KEYED_PACKAGES = frozenset(sys.stdlib_module_names) | {"torch", "autoshard", "torchgen", "functorch"}
AUTOSHARD_ROOT = Path(__file__).resolve().parent.parent


def cache_dir() -> Path | None:
    """Where entries live, or None when caching is off."""
    if os.environ.get("AUTOSHARD_CACHE", "1").lower() in ("0", "off", "false", "no"):
        return None
    if os.environ.get("AUTOSHARD_CACHE_DIR"):
        return Path(os.environ["AUTOSHARD_CACHE_DIR"]) / "capture"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "autoshard" / "capture"


def entry_key(model_path: Path, factory: str, batch_size: int, fold: bool) -> str:
    parts = [CACHE_VERSION, str(model_path.resolve()), factory, batch_size, fold, _torch_version(),
             sys.version, _autoshard_source_hash()]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]


def lookup(spec: str, batch_size: int, fold: bool) -> OpGraph | None:
    """The cached graph of ``spec`` (``file.py:factory``), or None (off, absent, stale, unreadable)."""
    path = _entry_path(spec, batch_size, fold)
    if path is None or not path.is_file():
        return None
    try:
        entry = json.loads(path.read_text())
        if not all(_unchanged(dep) for dep in entry["dependencies"]):
            return None
        return decode_graph(entry["graph"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # a damaged entry is a miss; the capture that follows rewrites it


def store(spec: str, batch_size: int, fold: bool, graph: OpGraph, modules_before: set[str]) -> None:
    """Write ``graph`` for ``spec`` with the files it came from; quietly skip what cannot be cached."""
    path = _entry_path(spec, batch_size, fold)
    if path is None:
        return
    try:
        encoded = encode_graph(graph)
        if decode_graph(json.loads(json.dumps(encoded))) != graph:
            return  # a value JSON does not carry exactly: capture again next time rather than guess
        entry = {"spec": spec, "dependencies": dependencies(_model_path(spec), modules_before), "graph": encoded}
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            json.dump(entry, f, separators=(",", ":"))
        os.replace(f.name, path)
    except (OSError, TypeError, ValueError):
        return  # a read-only or full disk costs the next plan a capture, nothing more


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
    return [[f, *_stat(f), _digest(f) if Path(f).is_relative_to(root) else None]
            for f in sorted(files) if Path(f).is_file()]


# ---------------------------------------------------------------------------- JSON form


def encode_graph(graph: OpGraph) -> dict:
    """The graph as JSON-ready values; ``fold`` as its two fields."""
    out = {f.name: _encode(getattr(graph, f.name)) for f in fields(OpGraph) if f.name != "fold"}
    out["fold"] = None if graph.fold is None else [graph.fold.path, graph.fold.layers]
    return out


def decode_graph(d: dict) -> OpGraph:
    values = {f.name: _decode(d[f.name]) for f in fields(OpGraph) if f.name != "fold"}
    values["nodes"] = [OpNode(**n) for n in values["nodes"]]
    values["params"] = [ParamInfo(**p) for p in values["params"]]
    values["blocks"] = [Block(**b) for b in values["blocks"]]
    graph = OpGraph(**values)
    if d["fold"] is not None:
        from autoshard.passes.fold import Fold

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


def _entry_path(spec: str, batch_size: int, fold: bool) -> Path | None:
    directory = cache_dir()
    if directory is None or ":" not in spec:
        return None
    model_path, factory = _model_path(spec), spec.rsplit(":", 1)[1]
    if not model_path.is_file():
        return None
    return directory / f"{entry_key(model_path, factory, batch_size, fold)}.json"


def _model_path(spec: str) -> Path:
    return Path(spec.rsplit(":", 1)[0])


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
def _autoshard_source_hash() -> str:
    h = hashlib.sha256()
    for file in sorted(AUTOSHARD_ROOT.rglob("*.py")):
        h.update(file.relative_to(AUTOSHARD_ROOT).as_posix().encode())
        h.update(file.read_bytes())
    return h.hexdigest()
