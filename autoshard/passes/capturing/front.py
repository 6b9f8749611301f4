"""The pipeline's front: capture -> annotate (or their graph from the capture cache), run in this
process or ahead of time in a forked child.

**Why a child.** A cold ``autoshard plan`` does two long things that need nothing of each other:

    capture   import torch (~1.1 s), torch.export with dynamo (~0.7 s), export on meta (~0.3 s)
    planner   import OR-Tools (~0.1 s; ``cli.entry`` gives it a stand-in for the pandas it imports,
              another 0.3-0.45 s), sympy (~0.2 s), networkx, rich

In one process they run one after the other on one core. ``capture_ahead`` forks a child before
either starts; the child captures while the parent imports the planner's libraries on another
core, and the annotated OpGraph comes back pickled through a pipe (milliseconds). Nothing after
the front needs torch (a plan from the capture cache never imports it), so the parent never
imports it at all: on a 2-core machine a cold Llama-3-8B-shape plan drops from ~3.4 s to ~2.9 s.

**When.** Only where it is safe and pays: fork exists, torch is not imported yet (so no thread
pool exists that a fork would break) and only one thread runs: a fresh ``autoshard plan``
process. Everywhere else (tests, the Python API inside a training script) the front runs in this
process, as it always did. ``AUTOSHARD_CAPTURE_AHEAD=0`` turns the child off.

**Errors.** The child's exception comes back as its kind and message (a user error, a bug, an
interrupt, an exit) and is raised here, chained to the child's traceback as text (``--debug``
shows both); a child that dies without answering (killed, out of memory) is one line naming how
it ended. The pipe carries only that, or the graph: plain data and autoshard's own dataclasses,
from a process this one forked.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import multiprocessing
import os
import sys
import threading
import traceback
from collections.abc import Iterator
from typing import TYPE_CHECKING

from autoshard.errors import AutoshardError
from autoshard.ir.graph import OpGraph
from autoshard.passes.capturing import capture_cache
from autoshard.passes.layouts.context_parallel import proof_deferred

if TYPE_CHECKING:  # capture and annotate import torch; a plan from the capture cache never does
    from autoshard.modelfile import ModelFile

CAPTURE_BATCH = 2  # costs scale with the batch; a batch of 2 keeps the batch dimension visible
# Imported by the parent while the child captures: what the passes after the front import anyway.
PLANNER_MODULES = (
    "autoshard.pipeline",
    "autoshard.passes.layouts.styles",  # the TP layout models and OR-Tools
    "autoshard.show",
    # imported lazily after the front, ~50 ms on 2 cores: by sympy's first division of the symbolic cost
    # (``cost.symbolic``), by ``importlib.metadata`` (the capture cache's key reads torch's version) and by
    # the search's shared counter (``passes.planning.price_ahead``)
    "sympy.combinatorics",
    "sympy.tensor.tensor",
    "sympy.assumptions.wrapper",
    "email.parser",
    "multiprocessing.sharedctypes",
    "multiprocessing.synchronize",
)

_Key = tuple[str, bool, bool, "int | None"]  # (model spec, fold, use the capture cache, --seq-len)
_ahead: dict[_Key, _Child] = {}


class PassError(RuntimeError):
    """A pass failed on a bug (not a user error): "while running pass X after [A, B]: ..."."""


@contextlib.contextmanager
def running(name: str, done: list[str]) -> Iterator[None]:
    """The block is pass ``name``, called directly inside it: ``name`` is appended to ``done`` when the block
    ends; a bug raised in it becomes a PassError naming the pass and those done before it (a user error,
    AutoshardError, passes through: its message names the fix)."""
    try:
        yield
    except AutoshardError:
        raise
    except Exception as exc:
        raise PassError(f"while running pass {name} after {done}: {type(exc).__name__}: {exc}") from exc
    done.append(name)


def capture_front(
    spec: str,
    done: list[str],
    fold: bool,
    use_cache: bool,
    seq_len: int | None = None,
    prove_cp: bool = False,
    tp_degrees=None,
) -> tuple[ModelFile | None, OpGraph]:
    """capture -> annotate, or their graph from the capture cache (then no model file is loaded: None).
    Takes the child's graph when ``capture_ahead`` started one for the same request. The tensor-parallel
    proof checks ``tp_degrees`` (every degree when None: tools that read the proofs; a plan, the degrees its
    cluster offers): a degree a cached graph was not proved at is proved here and written into its cache
    entry. The context-parallel proof runs where the search offers cp, or everywhere with ``prove_cp`` (a
    request pinning cp > 1, tools that read the proofs): on a graph that deferred it, here
    (``passes.capturing.cp_proof``, "Deferred")."""
    from autoshard.passes.layouts.allowed import PROOF_DEGREES, unproven_degrees

    degrees = tuple(PROOF_DEGREES if tp_degrees is None else tp_degrees)
    model_file, graph = _front(spec, done, fold, use_cache, seq_len, degrees)
    missing = unproven_degrees(graph, degrees)
    if missing:
        from autoshard.modelfile import load_model_file
        from autoshard.passes.capturing.tp_proof import prove_tensor_parallel

        model_file = model_file or load_model_file(spec, seq_len)
        with running("tp_proof", done):
            graph = prove_tensor_parallel(model_file, graph, missing)
        if use_cache:
            capture_cache.update_graph(spec, CAPTURE_BATCH, fold, graph, seq_len)
    if prove_cp and proof_deferred(graph):
        from autoshard.modelfile import load_model_file
        from autoshard.passes.capturing.cp_proof import prove_context_parallel

        model_file = model_file or load_model_file(spec, seq_len)
        with running("cp_proof", done):
            graph = prove_context_parallel(model_file, graph, prove=True)
    return model_file, graph


def _front(
    spec: str, done: list[str], fold: bool, use_cache: bool, seq_len: int | None = None, tp_degrees=None
) -> tuple[ModelFile | None, OpGraph]:
    child = _ahead.pop((spec, fold, use_cache, seq_len), None)
    if child is not None:
        graph, names = child.result()
        done += names
        return None, graph
    cached = _from_cache(spec, fold, seq_len) if use_cache else None
    if cached is not None:
        done += cached[1]
        return None, cached[0]
    model_file, graph, reads = _capture_and_annotate(spec, done, fold, seq_len, tp_degrees)
    if use_cache:
        capture_cache.store(spec, CAPTURE_BATCH, fold, graph, reads, seq_len)
    return model_file, graph


def _from_cache(spec: str, fold: bool, seq_len: int | None = None) -> tuple[OpGraph, list[str]] | None:
    """The capture cache's graph of ``spec`` and the passes it stands for, or None."""
    graph = capture_cache.lookup(spec, CAPTURE_BATCH, fold, seq_len)
    return None if graph is None else (graph, ["capture (cached)", "annotate (cached)"])


def _capture_and_annotate(
    spec: str, done: list[str], fold: bool, seq_len: int | None = None, tp_degrees=None, in_child: bool = False
) -> tuple[ModelFile, OpGraph, capture_cache.Reads]:
    """The model file loaded, its annotated graph, and what loading and capturing it read: modules
    imported, environment variables, files (``capture_cache.recording``, for the cache entry). The
    same in this process and in the forked child, which records in itself. The tensor-parallel proof
    checks ``tp_degrees`` (every degree when None); in the forked child (``in_child``), which may fork
    again, its degrees in parallel (``tp_proof._each_degree``)."""
    from autoshard.modelfile import load_model_file
    from autoshard.passes.capturing.annotate import annotate
    from autoshard.passes.capturing.batch_coupling import check_batch_coupling
    from autoshard.passes.capturing.capture import capture, model_output_to_stderr
    from autoshard.passes.capturing.cp_proof import prove_context_parallel
    from autoshard.passes.capturing.tp_proof import prove_tensor_parallel
    from autoshard.passes.layouts.allowed import PROOF_DEGREES

    with capture_cache.recording() as reads, model_output_to_stderr():  # stdout: autoshard's output only
        model_file = load_model_file(spec, seq_len)
        with running("capture", done):
            graph = capture(model_file, CAPTURE_BATCH, fold)
        with running("annotate", done):
            graph = annotate(graph)
        with running("tp_proof", done):
            degrees = PROOF_DEGREES if tp_degrees is None else tp_degrees
            graph = prove_tensor_parallel(model_file, graph, degrees, parallel=in_child)
        with running("cp_proof", done):
            graph = prove_context_parallel(model_file, graph)
        with running("batch_coupling", done):
            graph = check_batch_coupling(model_file, graph)
    return model_file, graph, reads


@contextlib.contextmanager
def capture_ahead(
    spec: str, fold: bool, use_cache: bool, seq_len: int | None = None, tp_degrees=None
) -> Iterator[None]:
    """Within the block, ``capture_front`` for this request takes the graph a forked child captures
    (started here, when ``forking_pays``), its tensor-parallel proof at ``tp_degrees`` (every degree when
    None; ``capture_front`` proves any other its request needs); a child not taken is stopped when the block
    ends."""
    key = (spec, fold, use_cache, seq_len)
    if not forking_pays() or key in _ahead:
        yield
        return
    child = _ahead[key] = _Child.start(spec, fold, use_cache, seq_len, tp_degrees)
    try:
        yield
    finally:
        _ahead.pop(key, None)
        child.stop()


def forking_pays() -> bool:
    """Fork exists, torch is not imported and one thread runs (a fresh process), and not turned off."""
    return (
        hasattr(os, "fork")
        and "torch" not in sys.modules
        and threading.active_count() == 1
        and os.environ.get("AUTOSHARD_CAPTURE_AHEAD", "1") != "0"
    )


class RemoteTraceback(Exception):
    """The child's traceback, as text: the ``__cause__`` of an exception raised in the child."""

    def __str__(self) -> str:
        return "\n" + self.args[0]


class _Child:
    """One forked capture: the process and the parent's end of its pipe."""

    def __init__(self, spec: str, process: multiprocessing.process.BaseProcess, conn) -> None:
        self.spec, self.process, self.conn, self.answered = spec, process, conn, False

    @classmethod
    def start(cls, spec: str, fold: bool, use_cache: bool, seq_len: int | None = None, tp_degrees=None) -> _Child:
        # multiprocessing's fork context: its children end with os._exit (no teardown of torch's
        # modules, ~0.7 s), and Pipe uses no named semaphores, so nothing is left to clean up.
        context = multiprocessing.get_context("fork")
        parent_end, child_end = context.Pipe(duplex=False)
        process = context.Process(
            target=_capture_in_child,
            args=(child_end, spec, fold, use_cache, seq_len, tp_degrees),
            name="autoshard-capture",
            daemon=True,
        )
        process.start()
        child_end.close()
        return cls(spec, process, parent_end)

    def result(self) -> tuple[OpGraph, list[str]]:
        """Import the planner's modules meanwhile, then the child's (graph, passes done) or its error."""
        for name in PLANNER_MODULES:
            importlib.import_module(name)
        try:
            status, payload, extra = self.conn.recv()
        except EOFError:
            self.process.join()
            ended = _how_it_ended(self.process)
            raise AutoshardError(
                f"{self.spec}: capturing the model ended its process without an answer ({ended}): the model "
                f"file or what it calls exited or was killed; AUTOSHARD_CAPTURE_AHEAD=0 with --debug captures "
                f"in the main process, to see where"
            ) from None
        self.answered = True
        if status == "error":
            self.process.join()
            raise _rebuilt(*payload) from RemoteTraceback(extra)
        # The graph and the modules imported live until this process (a fresh ``autoshard plan``) ends: frozen,
        # the collector's full passes skip them (DeepSeek-V3's search: 0.58 -> 0.27 s of collection).
        gc.freeze()
        return payload, extra

    def stop(self) -> None:
        """Wait for a child that answered (it may be writing the capture cache); kill one that did not."""
        if not self.answered and self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.conn.close()


def _capture_in_child(
    conn, spec: str, fold: bool, use_cache: bool, seq_len: int | None = None, tp_degrees=None
) -> None:
    """The child: send ``("ok", graph, passes done)`` or ``("error", exception, traceback)``, then write
    the capture cache entry while the parent plans (the parent waits for it before it exits).

    The garbage collector is off: importing torch and torch.export allocates enough container
    objects to run hundreds of collections that find next to nothing (0.4 s of the 2 s those
    imports take on a 2-core machine), and this process ends as soon as its answer is sent."""
    gc.disable()
    cached = _from_cache(spec, fold, seq_len) if use_cache else None
    if cached is not None:
        conn.send(("ok", *cached))
        conn.close()
        return
    try:
        done: list[str] = []
        _, graph, reads = _capture_and_annotate(spec, done, fold, seq_len, tp_degrees, in_child=True)
    except BaseException as exc:  # KeyboardInterrupt included: the parent raises it as the CLI expects
        conn.send(("error", _portable(exc), traceback.format_exc()))
        conn.close()
        return
    conn.send(("ok", graph, done))
    conn.close()
    if use_cache:
        capture_cache.store(spec, CAPTURE_BATCH, fold, graph, reads, seq_len)


def _how_it_ended(process: multiprocessing.process.BaseProcess) -> str:
    code = process.exitcode
    if code is not None and code < 0:
        return f"killed by signal {-code}{' (out of memory?)' if -code == 9 else ''}"
    return f"exit code {code}"


def _portable(exc: BaseException) -> tuple[str, str]:
    """The child's exception as plain data (the parent rebuilds it: ``_rebuilt``), so that nothing but
    strings, numbers and autoshard's own dataclasses crosses the pipe."""
    for kind, cls in (("user", AutoshardError), ("bug", PassError), ("interrupt", KeyboardInterrupt)):
        if isinstance(exc, cls):
            return kind, str(exc)
    if isinstance(exc, SystemExit):
        return "exit", str(exc.code)
    return "bug", f"while running pass capture: {type(exc).__name__}: {exc}"


def _rebuilt(kind: str, text: str) -> BaseException:
    if kind == "user":
        return AutoshardError(text)
    if kind == "interrupt":
        return KeyboardInterrupt()
    if kind == "exit":
        return SystemExit(int(text) if text.lstrip("-").isdigit() else text)
    return PassError(text)
