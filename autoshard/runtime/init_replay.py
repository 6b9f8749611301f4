"""Weights built on the meta device, then only this rank's shards made: the factory's initialisation recorded
and replayed.

A program used to build the whole fp32 model on every rank's CPU before sharding it (a Llama-3-8B plan on 8
GPUs: 32 GB of host memory per rank). Instead:

1. ``record_build`` runs the model file's factory once on the meta device under a dispatch mode that records
   every ATen op it dispatches, after torch's own decompositions (``nn.init.kaiming_uniform_`` reaches it as
   ``uniform_``), with each tensor argument named by its storage and its view (dtype, offset, size, stride).
   Nothing is computed: the meta model has shapes and no values.
2. The plan's steps are applied to the meta model (DTensor and FSDP2 shards, pipeline stages: all meta), and
   each rank allocates what it holds on its device (``Module.to_empty``).
3. ``ReplayReader``, a ``torch.distributed.checkpoint`` storage reader, replays the record on CPU in the
   recorded order with the default generator seeded as ``runtime.build_model`` seeds it, and serves DCP's read
   requests from it: at the last write of each state tensor, the parts this rank holds are copied into its
   shards (DCP's planner does the placement arithmetic, as for any checkpoint: DTensor, strided, stage
   copies) and the whole tensor is freed.

Exactness. The CPU generator (mt19937) draws sequentially and cannot skip ahead, so every rank replays every
random op of the model, in order, and draws exactly the numbers one process draws in
``torch.manual_seed(seed); factory()``: the weights are bitwise those of the one-process build
(``tests/test_init_replay.py`` compares them on models nobody here wrote), so ``autoshard verify``'s
reference is unchanged. The cost is at most one CPU build's arithmetic per rank, not its memory: draws after the
last one the rank keeps are skipped (a first pipeline stage skips the later layers' draws after its own last one;
a factory that initialises every module again at its end, as transformers' ``post_init`` does, keeps most).

Memory. A value is kept only while a later op reads it, or while it is a state tensor whose parts are not yet
taken: an op whose result is never read (a weight's first fill, overwritten by ``post_init``) runs on scratch
storage if it draws random numbers (the later draws depend on it) and is skipped otherwise; ops that only make
views are never run (arguments are rebuilt from their storage and view). Peak host memory: about the largest
tensor plus the few small values later ops read (rotary tables, masks), not the model.

What cannot be replayed is refused by ``record_build`` with the reason (the program then builds the model whole
on CPU and says so): a factory that seeds the generator itself or passes its own ``torch.Generator``, a state
tensor whose values came from outside the record.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.futures import Future
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from autoshard.errors import AutoshardError

_META = torch.device("meta")
_SENTINEL_SEED = 0x5EED_1DEA_C0FFEE
_REPLAY_DEVICE = torch.device("cpu")
# In-place ops that change a tensor's shape or storage: run them on meta, never skip them
_RESHAPING_IN_PLACE = frozenset(
    {
        "resize_",
        "resize_as_",
        "set_",
        "as_strided_",
        "squeeze_",
        "unsqueeze_",
        "t_",
        "transpose_",
        "swapdims_",
        "swapaxes_",
        "detach_",
    }
)
# In-place ops that write every element of their first argument without reading it
_OVERWRITES = frozenset(
    {
        "normal_",
        "uniform_",
        "random_",
        "exponential_",
        "geometric_",
        "log_normal_",
        "cauchy_",
        "fill_",
        "zero_",
        "copy_",
    }
)


class NotReplayable(AutoshardError):
    """The factory's initialisation cannot be replayed exactly; the message says why."""


@dataclass(frozen=True)
class TensorRef:
    """A tensor argument by its storage and its view of it."""

    storage: int  # index into Record.nbytes
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    whole: bool  # the view is its whole storage, each byte once (contiguous from offset 0)


@dataclass
class Op:
    func: Any  # an OpOverload
    args: Any  # pytree with TensorRef leaves (and constants)
    kwargs: Any
    outputs: tuple[TensorRef | None, ...]  # flattened outputs
    reads: frozenset[int]
    writes: frozenset[int]
    overwrites: frozenset[int]  # storages whose previous value this op does not read and fully replaces
    creates: frozenset[int]
    random: bool  # draws from the generator


@dataclass
class Record:
    """What the factory did, and where the model's state ended up."""

    ops: list[Op] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)  # per storage
    constants: dict[int, torch.Tensor] = field(default_factory=dict)  # storage -> real tensor holding it
    state: dict[str, TensorRef] = field(default_factory=dict)  # every parameter and buffer name (tied: each)


# torch.nn.init's initialisers are recorded as themselves (they reach torch-function modes as themselves):
# trunc_normal_ draws until its values fall in range, which a meta tensor cannot show; each overwrites its tensor
_INIT_FUNCTIONS = frozenset(
    getattr(nn.init, name)
    for name in (
        "uniform_",
        "normal_",
        "trunc_normal_",
        "constant_",
        "ones_",
        "zeros_",
        "eye_",
        "dirac_",
        "xavier_uniform_",
        "xavier_normal_",
        "kaiming_uniform_",
        "kaiming_normal_",
        "orthogonal_",
        "sparse_",
    )
)
_DETERMINISTIC_INITS = frozenset(getattr(nn.init, name) for name in ("constant_", "ones_", "zeros_", "eye_", "dirac_"))


# Constructors that copy data the caller gives (a list, an array): they make real CPU tensors (constants of
# the record), and transformers' "is this a meta-device build" test (``torch.tensor([]).device``) says no
_DATA_CONSTRUCTORS = frozenset({torch.tensor, torch.as_tensor, torch.asarray})


class _MetaFactories(TorchFunctionMode):
    """``torch.device("meta")`` for the factories that name no device (but data constructors); each
    ``torch.nn.init`` call on a meta tensor recorded as one op, and skipped."""

    def __init__(self, recording: _Recording):
        super().__init__()
        self.recording = recording
        self.factories = _device_constructors() - _DATA_CONSTRUCTORS

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.factories and kwargs.get("device") is None:
            return func(*args, **{**kwargs, "device": _META})
        target = args[0] if args else kwargs.get("tensor")
        if func not in _INIT_FUNCTIONS or not isinstance(target, torch.Tensor) or not target.is_meta:
            return func(*args, **kwargs)
        return self.recording.record_init(func, target, args, kwargs)


@contextmanager
def _recording_trunc_normal(recording: _Recording):
    """``nn.init.trunc_normal_`` recorded as itself. It draws until every value falls in range (a loop on the
    values, which a meta tensor cannot run) and reaches no torch-function mode, so its helper, which it looks
    up by name at each call (callers such as transformers keep the public function), is swapped for the
    recording's while the factory runs."""
    original = nn.init._no_grad_trunc_normal_

    def recorded(tensor, mean, std, a, b, generator=None):
        if not tensor.is_meta:
            return original(tensor, mean, std, a, b, generator=generator)
        return recording.record_init(nn.init.trunc_normal_, tensor, (tensor, mean, std, a, b), {"generator": generator})

    nn.init._no_grad_trunc_normal_ = recorded
    try:
        yield
    finally:
        nn.init._no_grad_trunc_normal_ = original


class _Recording(TorchDispatchMode):
    """Records every op dispatched while building on meta; see the module doc."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No: torch would wrap ``__torch_dispatch__`` in ``torch._dynamo.disable``, whose first call imports
        torch._dynamo (2.5 s per rank); nothing compiles a model's factory."""
        return False

    def __init__(self, record: Record):
        super().__init__()
        self.record = record
        self.ids: dict[int, int] = {}  # storage._cdata -> index
        self.keep: list[Any] = []  # the storages seen, alive so that no address is reused

    def ref(self, tensor: torch.Tensor, creating: bool = False) -> TensorRef:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key not in self.ids:
            index = len(self.record.nbytes)
            self.ids[key] = index
            self.keep.append(storage)
            self.record.nbytes.append(storage.nbytes())
            if not creating:  # a real tensor from outside (a constant), or a meta one of unknown origin
                if tensor.is_meta:
                    self.record.nbytes[index] = -1  # unknown: refused if a state tensor or a needed op reads it
                else:
                    base = torch.empty(0, dtype=torch.uint8).set_(storage.clone())
                    self.record.constants[index] = base
        whole = (
            tensor.storage_offset() == 0
            and tensor.is_contiguous()
            and tensor.numel() * tensor.element_size() == storage.nbytes()
        )
        return TensorRef(
            self.ids[key], tensor.dtype, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), whole
        )

    def record_init(self, func: Callable, target: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        """One ``torch.nn.init`` call on a meta tensor, as one op that overwrites it (skipped here)."""
        if isinstance(kwargs.get("generator"), torch.Generator):
            raise NotReplayable(f"the factory passes its own torch.Generator to torch.nn.init.{func.__name__}")
        args_refs, kwargs_refs = tree_map(lambda x: self.ref(x) if isinstance(x, torch.Tensor) else x, (args, kwargs))
        ref = self.ref(target)
        covers = ref.whole
        self.record.ops.append(
            Op(
                func,
                args_refs,
                kwargs_refs,
                (ref,),
                reads=frozenset() if covers else frozenset({ref.storage}),
                writes=frozenset({ref.storage}),
                overwrites=frozenset({ref.storage}) if covers else frozenset(),
                creates=frozenset(),
                random=func not in _DETERMINISTIC_INITS,
            )
        )
        return target

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        if any(isinstance(x, torch.Generator) for x in flat):
            raise NotReplayable(f"the factory passes its own torch.Generator to {func}")
        in_refs = tree_map(lambda x: self.ref(x) if isinstance(x, torch.Tensor) else _device_token(x), (args, kwargs))
        known = set(self.ids)
        name = func.overloadpacket.__name__
        mutated = [
            i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write
        ]
        skip = (
            bool(mutated)
            and name.endswith("_")
            and name not in _RESHAPING_IN_PLACE
            and args
            and isinstance(args[0], torch.Tensor)
            and args[0].is_meta
        )
        out = args[0] if skip else func(*args, **kwargs)
        out_flat, _ = tree_flatten(out)
        outputs = []
        creates = set()
        for value in out_flat:
            if isinstance(value, torch.Tensor):
                new = value.untyped_storage()._cdata not in known
                ref = self.ref(value, creating=True)
                if new:
                    creates.add(ref.storage)
                outputs.append(ref)
            else:
                outputs.append(None)
        self.record.ops.append(_op(func, name, mutated, in_refs, tuple(outputs), frozenset(creates), self.record))
        return out


def _op(func, name: str, mutated: list[int], in_refs, outputs, creates, record: Record) -> Op:
    args, kwargs = in_refs
    schema_args = func._schema.arguments
    writes, overwrites, reads = set(), set(), set()
    written_refs = []
    for i in mutated:
        ref = args[i] if i < len(args) else kwargs.get(schema_args[i].name)
        if isinstance(ref, TensorRef):
            writes.add(ref.storage)
            written_refs.append(ref)
    for value in tree_flatten((args, kwargs))[0]:
        if isinstance(value, TensorRef):
            reads.add(value.storage)
    if name in _OVERWRITES and len(written_refs) == 1 and written_refs[0].whole:
        target = written_refs[0].storage
        overwrites.add(target)
        self_arg = args[0] if args else None
        other = [v for v in tree_flatten((args[1:], kwargs))[0] if isinstance(v, TensorRef)]
        if isinstance(self_arg, TensorRef) and self_arg.storage == target and all(v.storage != target for v in other):
            reads.discard(target)
        else:
            overwrites.discard(target)
    random = torch.Tag.nondeterministic_seeded in func.tags
    return Op(func, args, kwargs, outputs, frozenset(reads), frozenset(writes), frozenset(overwrites), creates, random)


class _DeviceToken:
    """A device argument that was the meta device: the replay's device."""


_DEVICE = _DeviceToken()


def _device_token(value):
    return _DEVICE if isinstance(value, torch.device) and value.type == "meta" else value


def record_build(build: Callable[[], nn.Module]) -> tuple[nn.Module, Record]:
    """``build()`` with its ops recorded, every tensor it makes made on the meta device; the meta model and its
    record. Raises ``NotReplayable`` with the reason when the record could not reproduce the weights.

    ``build`` runs on the default (CPU) device, not under ``torch.device("meta")``: libraries that see a meta
    device context skip their initialisation (transformers' ``init_weights``), which is what must be recorded.
    The dispatch mode puts every tensor-making op that names no device on meta instead; a tensor made on a
    device the factory names (``torch.linspace(..., device="cpu")`` for a list of rates) is made there.
    The model must not be built under a ``torch.device`` context (``ModelFile.build(None)``), which names one."""
    record = Record()
    recording = _Recording(record)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SENTINEL_SEED)  # a state the factory's own seeding would not give back
        state_before = torch.random.get_rng_state()
        with recording, _MetaFactories(recording), _recording_trunc_normal(recording):
            model = build()
        if not torch.equal(torch.random.get_rng_state(), state_before):
            raise NotReplayable("the factory seeds or draws from torch's generator itself, outside any op")
    for name, tensor in _named_state(model):
        if not tensor.is_meta:
            ref = recording.ref(tensor)  # a real tensor: kept as a constant
        else:
            key = tensor.untyped_storage()._cdata
            if key not in recording.ids:
                raise NotReplayable(f"'{name}' was not made by an op the factory ran")
            ref = recording.ref(tensor)
        if record.nbytes[ref.storage] < 0:
            raise NotReplayable(f"'{name}' holds values made outside the factory's ops")
        record.state[name] = ref
    _plan(record, {ref.storage for ref in record.state.values()} - set(record.constants))  # refuses now, not later
    return model, record


def _named_state(model: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


# ---------------------------------------------------------------------------- replay


@dataclass
class _Plan:
    run: list[str]  # per op: "real" | "scratch" | "skip"
    free_after: list[list[int]]  # per op: storages whose value is no longer needed after it
    final_after: list[list[int]]  # per op: state storages whose value is final after it


def _plan(record: Record, wanted: set[int]) -> _Plan:
    """Which ops to run for the storages in ``wanted`` (backward liveness over the record; module doc)."""
    live = set(wanted)
    needed = [False] * len(record.ops)
    for i in range(len(record.ops) - 1, -1, -1):
        op = record.ops[i]
        if (op.writes | op.creates) & live:
            needed[i] = True
            live -= op.overwrites | op.creates
            live |= op.reads
    missing = [s for s in live if s not in record.constants]
    if missing:
        raise NotReplayable(f"{len(missing)} value(s) the weights depend on were not made by the factory's ops")
    # A draw nobody keeps still runs (on scratch) when a kept draw follows it: the generator's state at that
    # draw depends on every draw before. After the last kept draw, no draw matters.
    last_kept_draw = max((i for i, op in enumerate(record.ops) if needed[i] and op.random), default=-1)
    run = [
        "real" if n else ("scratch" if op.random and i < last_kept_draw else "skip")
        for i, (n, op) in enumerate(zip(needed, record.ops))
    ]
    fresh_next: dict[int, bool] = {}  # storage -> its next use (in order) fully replaces it, or there is none
    final = set()
    free_after: list[list[int]] = [[] for _ in record.ops]
    final_after: list[list[int]] = [[] for _ in record.ops]
    for i in range(len(record.ops) - 1, -1, -1):  # a value is freed after its last use before it is replaced
        if not needed[i]:
            continue
        op = record.ops[i]
        for s in sorted(op.writes | op.creates):
            if s in wanted and s not in final:
                final.add(s)
                final_after[i].append(s)
        for s in sorted(op.reads | op.writes | op.creates):
            if s not in record.constants and fresh_next.get(s, True):
                free_after[i].append(s)
            fresh_next[s] = s in op.overwrites or s in op.creates
    return _Plan(run, free_after, final_after)


class _Values:
    """Real storages of the replay, by storage index."""

    def __init__(self, record: Record):
        self.record = record
        self.real: dict[int, torch.UntypedStorage] = {}

    def tensor(self, ref: TensorRef, scratch: dict | None = None) -> torch.Tensor:
        if ref.storage in self.record.constants:
            storage = self.record.constants[ref.storage].untyped_storage()
        elif scratch is not None:
            storage = scratch.setdefault(ref.storage, torch.UntypedStorage(self.record.nbytes[ref.storage]))
        else:
            storage = self.real.get(ref.storage)
            if storage is None:
                storage = self.real[ref.storage] = torch.UntypedStorage(self.record.nbytes[ref.storage])
        return torch.empty(0, dtype=ref.dtype).set_(storage, ref.offset, ref.size, ref.stride)

    def run(self, op: Op, scratch: bool) -> None:
        spare: dict | None = {} if scratch else None

        def real(value):
            if isinstance(value, TensorRef):
                return self.tensor(value, spare)
            return _REPLAY_DEVICE if value is _DEVICE else value

        args, kwargs = tree_map(real, (op.args, op.kwargs))
        out = op.func(*args, **kwargs)
        if scratch:
            return
        for ref, value in zip(op.outputs, tree_flatten(out)[0]):
            if ref is not None and ref.storage in op.creates and isinstance(value, torch.Tensor):
                self.real[ref.storage] = value.untyped_storage()


def replay(
    record: Record,
    seed: int,
    names: Iterable[str] | None = None,
    take: Callable[[str, torch.Tensor], None] = lambda name, value: None,
) -> int:
    """Run ``record`` on CPU from ``torch.manual_seed(seed)``, calling ``take(name, value)`` once for each state
    tensor in ``names`` (default: all) as soon as its value is final; ``value`` is freed after the call unless
    ``take`` keeps it. The process's generator state is left as it was. Returns the most bytes the replay held
    at once (its values, not counting constants or what ``take`` keeps)."""
    names = list(record.state if names is None else names)
    by_storage: dict[int, list[str]] = {}
    for name in names:
        by_storage.setdefault(record.state[name].storage, []).append(name)
    for s in list(by_storage):  # constants are final from the start
        if s in record.constants:
            for name in by_storage.pop(s):
                take(name, _view(record.constants[s].untyped_storage(), record.state[name]))
    plan = _plan(record, set(by_storage))
    values = _Values(record)
    peak_bytes = 0
    from autoshard.runtime.randomness import drawing_freely  # verify's fixed random ops are for training only

    with torch.random.fork_rng(devices=[]), torch.no_grad(), drawing_freely():
        torch.manual_seed(seed)
        for i, op in enumerate(record.ops):
            if plan.run[i] == "skip":
                continue
            values.run(op, scratch=plan.run[i] == "scratch")
            for s in plan.final_after[i]:
                for name in by_storage[s]:
                    take(name, _view(values.real[s], record.state[name]))
            peak_bytes = max(peak_bytes, sum(record.nbytes[s] for s in values.real))
            for s in plan.free_after[i]:
                values.real.pop(s, None)
    return peak_bytes


def _view(storage: torch.UntypedStorage, ref: TensorRef) -> torch.Tensor:
    return torch.empty(0, dtype=ref.dtype).set_(storage, ref.offset, ref.size, ref.stride)


# ---------------------------------------------------------------------------- a rank's shards from the replay

_PENDING = "_autoshard_pending_init"  # attribute of a meta model (or its stages): a _Pending


@dataclass(frozen=True)
class _Pending:
    record: Record
    seed: int
    renamed: dict[str, str] = field(default_factory=dict)  # a stage's name of a model tensor -> the model's name


def attach(model, record: Record, seed: int) -> None:
    """Mark ``model`` (built on meta by ``record_build``) as waiting for ``materialize``."""
    object.__setattr__(model, _PENDING, _Pending(record, seed))


def carry(source, target, parts: Iterable[nn.Module] = ()) -> None:
    """``target`` (the stages split from ``source``, ``parts`` their modules) waits for the same initialisation.

    A stage may hold a tensor of ``source`` under a name ``source`` never gives it: ``torch.export`` unflattens a
    module the forward calls twice under a second name (``rotary_emb@1``) holding the very same buffers, which a
    stage may hold under that name alone. Such a tensor is found
    by identity, here, where ``source`` still holds it, and is read under its name in ``source``."""
    pending = getattr(source, _PENDING, None)
    if pending is None:
        return
    names: dict[int, list[str]] = {}
    for name, tensor in _named_state(source):
        names.setdefault(id(tensor), []).append(name)
    renamed = {
        name: names[id(tensor)][0]
        for part in parts
        for name, tensor in _named_state(part)
        if id(tensor) in names and name not in names[id(tensor)]
    }
    object.__setattr__(target, _PENDING, _Pending(pending.record, pending.seed, {**pending.renamed, **renamed}))


def is_pending(model) -> bool:
    return getattr(model, _PENDING, None) is not None


def forget(model) -> None:
    """``model`` waits for no initialisation any more."""
    object.__delattr__(model, _PENDING)


def on_fake_tensors(modules: list[nn.Module]) -> bool:
    """The modules' tensors are fake (``FakeTensorMode``: a setup run for its shapes and memory only)."""
    from torch._subclasses.fake_tensor import is_fake

    return any(is_fake(t) for m in modules for t in [*m.parameters(), *m.buffers()])


def materialize(
    model,
    modules: list[nn.Module],
    state: dict,
    restore: Callable[[], None],
    original_name: Callable[[str], str],
    valued: frozenset[str] = frozenset(),
) -> None:
    """Allocate ``modules``' tensors on ``device`` and fill them with the factory's initial values.

    ``state`` is the model's state as checkpoints hold it (``runtime.checkpoint.model_state``: by the original
    names, DTensors where sharded), made after ``to_empty``; DCP's planner reads from the replay only the parts
    this rank holds, and ``restore`` puts them back. Buffers no state dict lists (non-persistent: rotary tables)
    are filled whole, found by ``original_name`` (a module's tensor name without wrappers' parts).

    Pipeline stages may hold state under names the factory never gave: a model tensor under a stage's own name
    (``carry``), read under the model's, and the names in ``valued`` (``valued_state``: state that held values
    before ``to_empty``, which keeps them). Any other name is refused."""
    pending: _Pending = getattr(model, _PENDING)
    record, seed = pending.record, pending.seed
    held = {original_name(name) for module in modules for name, _ in _named_state(module)}
    renamed = {name: pending.renamed[name] for name in held | set(state) if name in pending.renamed}
    kept = {name for name in valued if name not in record.state and name not in renamed}
    unknown = sorted((set(state) | held) - set(record.state) - set(renamed) - kept)
    if unknown:
        raise AutoshardError(
            f"the sharded model has state the factory did not make ({', '.join(unknown[:3])}); "
            f"this plan's program cannot initialise it on meta"
        )
    extra: dict[str, list[torch.Tensor]] = {}
    for module in modules:
        for name, buffer in module.named_buffers(remove_duplicate=False):
            name = original_name(name)
            if name not in state and renamed.get(name, name) in record.state:
                extra.setdefault(renamed.get(name, name), []).append(buffer)
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    # Each rank reads its own parts from its own replay: no plan to agree on, so no collective (no_dist); DCP
    # warns that it "assumes the intent is to load in a single process", which is this intent exactly
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        load(
            _read_by_model_names(state, renamed, kept),
            storage_reader=ReplayReader(record, seed, extra),
            planner=DefaultLoadPlanner(),
            no_dist=True,
        )
    restore()
    forget(model)


def _read_by_model_names(state: dict, renamed: dict[str, str], kept: set[str]) -> dict:
    """``state`` as the replay is read: a tensor held under a stage's own name read under the model's (once, if
    the stage holds it under both), the state that keeps its values left out."""
    read = {name: value for name, value in state.items() if name not in renamed and name not in kept}
    for name, model_name in renamed.items():
        if name in state:
            read.setdefault(model_name, state[name])
    return read


def valued_state(modules: list[nn.Module], original_name: Callable[[str], str]) -> frozenset[str]:
    """The names of ``modules``' state that holds values already, read before ``to_empty``: the tensors that are
    not on the meta device. A pipeline split adds such state: the constants ``torch.export`` lifts out of the
    forward (``lifted_tensor_0``: a tensor the forward makes from Python data, such as ALiBi's slopes or an index
    list), traced with the values one process's forward makes."""
    return frozenset(
        original_name(name) for module in modules for name, tensor in _named_state(module) if not _is_meta(tensor)
    )


def to_empty(module: nn.Module, device: torch.device) -> None:
    """``module.to_empty(device)`` keeping every parameter's and buffer's object and attributes: the
    pipeline's tied copies, FSDP2 and expert shards refer to parameters by object. Each meta tensor (or
    DTensor over meta) swaps contents with an empty one on ``device`` (``torch.utils.swap_tensors``, as
    ``Module._apply`` does under ``torch.__future__.set_swap_module_params_on_conversion``, whose own
    checks refuse a traced stage's parameters), and FSDP2 re-pads its sharded parameters as its
    ``_apply`` would (``reset_sharded_param``). FSDP2's sharded parameters under its ``CPUOffloadPolicy`` are made
    in host memory, where the policy keeps them (``host_params``); buffers and every other tensor on ``device``."""
    done: set[int] = set()
    replaced: dict[int, torch.Tensor] = {}
    host = host_params(module)
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for tensor in table.values():
                if tensor is None or id(tensor) in done or not _is_meta(tensor):
                    continue
                done.add(id(tensor))
                empty = _empty_like(tensor, torch.device("cpu") if id(tensor) in host else device)
                if isinstance(tensor, nn.Parameter):
                    empty = nn.Parameter(empty, requires_grad=tensor.requires_grad)
                attributes = dict(tensor.__dict__)
                try:
                    torch.utils.swap_tensors(tensor, empty)
                    tensor.__dict__.update(attributes)
                except RuntimeError:  # a fake tensor (its mode holds a weak reference to it): put in its place
                    empty.__dict__.update(attributes)
                    replaced[id(tensor)] = empty
    for sub in module.modules() if replaced else ():
        for table in (sub._parameters, sub._buffers):
            for name, tensor in list(table.items()):
                if tensor is not None and id(tensor) in replaced:
                    table[name] = replaced[id(tensor)]
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            with torch.no_grad():
                for group in sub._get_fsdp_state()._fsdp_param_groups:
                    for fsdp_param in group.fsdp_params:
                        fsdp_param.reset_sharded_param()


def host_params(module: nn.Module) -> set[int]:
    """The ids of FSDP2's sharded parameters whose unit offloads them to the host (``CPUOffloadPolicy``: FSDP2
    checks at its first forward that they are on CPU, and copies each to the device before its all-gather)."""
    from torch.distributed.fsdp import FSDPModule

    return {
        id(fsdp_param.sharded_param)
        for sub in module.modules()
        if isinstance(sub, FSDPModule)
        for group in sub._get_fsdp_state()._fsdp_param_groups
        for fsdp_param in group.fsdp_params
        if fsdp_param.offload_to_cpu
    }


def _empty_like(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor on ``device`` shaped as ``tensor`` (a DTensor: its local shard), made from the
    shapes alone: under ``FakeTensorMode`` an op reading the meta tensor would leave a weak reference to it."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        local = tensor._local_tensor
        local = torch.empty_strided(local.shape, local.stride(), dtype=local.dtype, device=device)
        return DTensor.from_local(
            local, tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
        )
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)


def _is_meta(tensor: torch.Tensor) -> bool:
    local = getattr(tensor, "_local_tensor", None)
    return tensor.is_meta or (local is not None and local.is_meta)


class ReplayReader:
    """A ``torch.distributed.checkpoint`` storage reader whose checkpoint is the factory's replay: every state
    tensor as one whole chunk; ``read_data`` replays the record once and copies each requested part as soon as
    its tensor is final (module doc). ``extra``: more tensors to fill whole, by name."""

    def __init__(self, record: Record, seed: int, extra: dict[str, list[torch.Tensor]] | None = None):
        self.record, self.seed, self.extra = record, seed, extra or {}

    def reset(self, checkpoint_id=None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            Metadata,
            StorageMeta,
            TensorProperties,
            TensorStorageMetadata,
        )

        entries = {}
        for name, ref in self.record.state.items():
            size = torch.Size(ref.size)
            entries[name] = TensorStorageMetadata(
                TensorProperties(dtype=ref.dtype), size, [ChunkStorageMetadata(torch.Size([0] * len(size)), size)]
            )
        return Metadata(state_dict_metadata=entries, storage_meta=StorageMeta())

    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args, **kwargs) -> None:
        pass

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner) -> Future:
        from torch.distributed._shard._utils import narrow_tensor_by_index  # DCP's own file reader uses it

        items: dict[str, list] = {}
        for item in plan.items:
            items.setdefault(item.storage_index.fqn, []).append(item)

        def take(name: str, value: torch.Tensor) -> None:
            for item in items.get(name, ()):
                target = planner.resolve_tensor(item).detach()
                target.copy_(narrow_tensor_by_index(value, item.storage_offsets, item.lengths))
                planner.commit_tensor(item, target)
            for tensor in self.extra.get(name, ()):
                with torch.no_grad():
                    tensor.copy_(value)

        replay(self.record, self.seed, sorted(set(items) | set(self.extra)), take)
        future: Future = Future()
        future.set_result(None)
        return future
