"""Checkpoints with torch.distributed.checkpoint (DCP): sharded, resumable, never half-written.

Layout: ``DIR/step-00000012/`` holds the state after 12 steps (model, optimizer, step).
Each save writes ``DIR/.step-00000012.partial/`` first; rank 0 renames it into place only
after every rank has finished writing (a barrier), so a crash during a write leaves a
``.partial`` folder that ``latest`` ignores, and the previous checkpoint still loads.

One job at a time: the job holds ``DIR/.autoshard.lock`` (``fcntl.flock``, released by the kernel when
its holders end, however they end). ``autoshard run`` takes it before it starts torchrun, which
inherits it; a program started by torchrun directly takes it on rank 0 (``resume``). A second job
on the folder is refused in one line naming the holder's pid. The lock's holder removes the
``.partial`` folders it finds on start: their writers are dead.

Resuming is exact because the data of step t depends only on (seed, t) (runtime.data: a dataset's
position is epoch ⌊t / E⌋, batch t mod E) and weights and optimizer state are restored in full. Each
checkpoint keeps the data position too (``data.epoch``, ``data.epoch_samples``, ``data.samples_consumed``,
``data.dataset_length``, ``data.seed``; ``RankBatches.position``), and a resume on another dataset length
or seed is refused in one line (``RankBatches.check_position``).

State is keyed by the original model's names (``h.0.attn.q_proj.weight``,
``state.h.0.attn.q_proj.weight.exp_avg``: DCP's flattened optimizer state), whatever the plan:

    DDP / FSDP2 / DTensor TP   torch's ``get_state_dict`` / ``set_state_dict``
    ZeRO-1                     the same on ZeroRedundancyOptimizer's local AdamW: each rank
                               saves the state of the parameters it owns, under their names
    pipeline stages            one model part and one optimizer per stage (``StageOptimizers``),
                               their state dicts merged (a tied weight's copies are equal), a
                               tied weight's optimizer state under its first name only, as
                               torch keeps it for the others (``one_name_per_tie``)
    TP inside stages           a local shard is plain, so it is saved as the DTensor it is a
                               shard of: Shard(d) over tp, and under FSDP2 on dp
                               (Shard(0) over dp, Shard(d) over tp), or
                               (_StridedShard(0, tp), Shard(0)) when d = 0 (FSDP2's own 2-D layout)
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from autoshard.errors import AutoshardError
from autoshard.runtime import faults, safe_load

STEP_DIR = re.compile(r"step-(\d{8})")
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)  # keys by name, no per-rank lists


class StageOptimizers:
    """One optimizer per pipeline stage module, stepped together.

    DCP's state-dict API maps an optimizer's parameters to names through one module, so a
    rank holding several stages (interleaved) keeps one optimizer per stage (as torchtitan does).
    """

    def __init__(
        self,
        modules: list[nn.Module],
        optimizer_class=torch.optim.AdamW,
        params_of: Callable[[nn.Module], Any] | None = None,
        **kwargs,
    ):
        """``optimizer_class(params_of(module), **kwargs)`` per stage module; ``params_of`` defaults to
        ``module.parameters()`` (``recipe.build_optimizer`` passes its weight-decay groups)."""
        self.modules = list(modules)
        params_of = params_of or (lambda module: module.parameters())
        self.optimizers = [optimizer_class(params_of(m), **kwargs) for m in self.modules]

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


def save(
    checkpoint_dir: str | Path, steps_done: int, model, optimizer, mesh=None, data=None, scheduler=None, scaler=None
) -> Path:
    """Write the state after ``steps_done`` steps (and ``scheduler``'s position, given one: a
    ``recipe.build_scheduler``; and an fp16 plan's loss ``scaler``, its scale and growth count); returns the
    final folder.

    ``model`` is the (wrapped) module, or a pipeline's ``PipelineStages`` with its
    ``StageOptimizers``; ``mesh`` (pp, dp, tp) is needed for TP inside pipeline stages; ``data``
    (``runtime.data.RankBatches``) gives the data position to keep.
    """
    start = time.perf_counter()
    model_state, optim_state, _ = _state(model, optimizer, mesh)
    state = {"model": model_state, "optim": optim_state, "steps_done": torch.tensor(steps_done)}
    if scheduler is not None:
        state["scheduler"] = scheduler_state(scheduler)
    if scaler is not None and scaler.is_enabled():  # a disabled scaler (every precision but fp16) has no state
        state["scaler"] = scaler_state(scaler)
    if data is not None:
        state["data"] = {key: torch.tensor(value) for key, value in data.position(steps_done).items()}
    final = _write(
        Path(checkpoint_dir) / f"step-{steps_done:08d}", state, lambda: faults.inject("kill-in-checkpoint", steps_done)
    )
    _say(f"saved checkpoint {final} after step {steps_done} ({time.perf_counter() - start:.1f} s)")
    return final


def _say(line: str) -> None:
    """One line on rank 0's stdout, between the step lines."""
    if (dist.get_rank() if dist.is_initialized() else 0) == 0:
        print(line, flush=True)


def save_weights(folder: str | Path, model, optimizer, mesh=None) -> Path:
    """The model's weights alone, as a DCP checkpoint in ``folder``: each rank writes the shards it holds
    (DCP keeps one copy of what ranks hold alike), so no rank ever holds the whole model (``read_weights``
    puts them together in one process, for a model small enough to check). Arguments as ``save``'s."""
    model_state, _ = _model_weights(model, optimizer, mesh)
    return _write(Path(folder), {"model": model_state})


def load_weights(source: str | Path, model, optimizer, mesh=None) -> None:
    """Start from pretrained weights (``--init-from``): a Hugging Face folder of ``*.safetensors``
    (``save_pretrained``'s, read by DCP's ``HuggingFaceStorageReader``) or a DCP checkpoint (a ``--metrics-out``
    ``weights/`` folder, a checkpoint's ``step-N``), by the model's own names. Each rank reads only its shards,
    and nothing is unpickled (``safe_load``). A name the source lacks is loaded from a name tied to it
    (``save_pretrained`` writes one of ``lm_head.weight`` and ``model.embed_tokens.weight`` when they are tied);
    any other is refused in one line."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    path = Path(source)
    if (path / ".metadata").is_file():
        reader, prefix = safe_load.SafeFileSystemReader(path), "model."
    elif path.is_dir() and any(path.glob("*.safetensors")):
        reader, prefix = HuggingFaceStorageReader(str(path)), ""
    else:
        raise AutoshardError(
            f"--init-from {source}: neither a Hugging Face folder of *.safetensors nor a DCP "
            f"checkpoint (.metadata); pass the folder save_pretrained wrote, or a checkpoint step-N"
        )
    model_state, restore = _model_weights(model, optimizer, mesh)
    present = {key.removeprefix(prefix) for key in reader.read_metadata().state_dict_metadata}
    ties = _tied_names(model)
    wanted = {
        name: next((t for t in ties.get(name, ()) if t in present), None) if name not in present else name
        for name in model_state
    }
    missing = sorted(name for name, found in wanted.items() if found is None)
    if missing:
        raise AutoshardError(
            f"--init-from {source} lacks {len(missing)} of the model's tensors ({', '.join(missing[:4])}"
            f"{', ...' if len(missing) > 4 else ''}); pass weights saved from this model"
        )
    by_source: dict[str, list[str]] = {}
    for name, found in wanted.items():
        by_source.setdefault(found, []).append(name)
    for round_ in range(max(len(names) for names in by_source.values())):  # a source key once per load
        state = {found: model_state[names[round_]] for found, names in by_source.items() if round_ < len(names)}
        safe_load.dcp_load({"model": state} if prefix else state, path, allow_partial_load=True, reader=reader)
    restore()


def export_hf(folder: str | Path, model, optimizer, mesh=None, configs: tuple | None = None) -> Path:
    """The final weights as a Hugging Face folder of ``.safetensors`` (``--export-hf``), by the model's names:
    each rank writes its shards, then they are joined file by file (DCP's ``HuggingFaceStorageWriter`` with
    consolidation: one tensor at a time, never the whole model on one rank). Rank 0 writes ``configs`` beside
    them (``hf_configs``: a transformers model's, so ``from_pretrained(folder)`` loads the export; a pipeline
    program passes its whole model's, which its stages no longer hold)."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    model_state, _ = _model_weights(model, optimizer, mesh)
    Path(folder).mkdir(parents=True, exist_ok=True)
    dcp.save(
        model_state,
        storage_writer=HuggingFaceStorageWriter(str(folder), save_distributed=True, enable_consolidation=True),
    )
    if not dist.is_initialized() or dist.get_rank() == 0:
        for config in hf_configs(model) if configs is None else configs:
            config.save_pretrained(str(folder))
    return Path(folder)


def hf_configs(module) -> tuple:
    """A transformers module's ``config`` and ``generation_config`` (what ``save_pretrained`` writes beside the
    weights: config.json, generation_config.json); () for another module."""
    module = getattr(module, "module", module)  # DDP's wrapper
    found = (getattr(module, "config", None), getattr(module, "generation_config", None))
    return tuple(config for config in found if callable(getattr(config, "save_pretrained", None)))


def _model_weights(model, optimizer, mesh) -> tuple[dict, Callable[[], None]]:
    """The model's state as checkpoints hold it (``_state``) and its restore function; for pipeline stages, the
    model's own names only, with every name of a tied tensor (as ``state_dict()`` lists them)."""
    model_state, _, restore = _state(model, optimizer, mesh)
    names = getattr(model, "state_names", None)
    if names is not None:
        model_state = {name: value for name, value in model_state.items() if name in names}
        for group in model.aliases:
            held = next((name for name in group if name in model_state), None)
            for name in group if held is not None else ():
                model_state.setdefault(name, model_state[held])
    return model_state, restore


def _tied_names(model) -> dict[str, tuple[str, ...]]:
    """Name -> the other names of the same tensor in the model (pipeline stages: across stages too)."""
    groups = getattr(model, "aliases", None)
    if groups is None:
        from autoshard.runtime.model import strip_wrapper_names
        from autoshard.runtime.pipeline_parallel import state_aliases

        groups = [tuple(strip_wrapper_names(name) for name in group) for group in state_aliases(model)]
    return {name: tuple(n for n in group if n != name) for group in groups for name in group}


def _write(final: Path, state: dict, after_write: Callable[[], None] = lambda: None) -> Path:
    """``dcp.save`` of ``state`` into ``.NAME.partial`` beside ``final``, renamed to ``final`` by rank 0 once
    every rank has written its shards: ``final`` is complete or absent, never half-written."""
    partial = final.with_name(f".{final.name}.partial")
    if dist.get_rank() == 0 and partial.exists():
        shutil.rmtree(partial)
    dist.barrier()
    dcp.save(state, checkpoint_id=partial)
    after_write()
    dist.barrier()  # every rank has written its shards
    if dist.get_rank() == 0:
        if final.exists():  # an earlier write of this step that never finished (no .metadata) or a re-run
            shutil.rmtree(final)
        partial.replace(final)
    dist.barrier()
    return final


def read_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """The whole tensors of ``save_weights``' checkpoint, by the model's names, read in this process alone (no
    process group): what ``autoshard verify`` compares with one process's training. Every tensor the metadata
    lists, allocated whole here and filled by DCP's reader (``safe_load``: nothing is unpickled)."""
    import warnings

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from autoshard.runtime.model import strip_wrapper_names

    path = Path(folder)
    metadata = safe_load.SafeFileSystemReader(path).read_metadata()
    model = {
        key.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        safe_load.dcp_load({"model": model}, path)
    return {strip_wrapper_names(name): tensor for name, tensor in model.items()}


LOCK_FILE = ".autoshard.lock"
LOCK_HELD_ENV = "AUTOSHARD_CHECKPOINT_LOCK"  # the folder whose lock this job's launcher holds
_held: dict[str, CheckpointLock] = {}  # locks this process took for its job (kept until it ends)


class CheckpointLock:
    """An exclusive ``flock`` on a checkpoint folder's lock file; the file says who holds it."""

    def __init__(self, folder: str, fd: int):
        self.folder, self.fd = folder, fd

    def note(self, holder: str) -> None:
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, holder.encode() + b"\n", 0)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # the lock goes with the last descriptor of it (torchrun may still hold one)
            self.fd = -1


def lock(checkpoint_dir: str | Path, holder: str) -> CheckpointLock:
    """Lock ``checkpoint_dir`` (created if missing) for this job, or refuse: another job writes there."""
    root = Path(checkpoint_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise AutoshardError(
            f"cannot use checkpoint folder {root}: {exc.strerror}; fix: choose a folder you "
            f"can write, e.g. --checkpoint-dir ckpt"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        who = os.pread(fd, 200, 0).decode(errors="replace").strip() or "pid unknown"
        os.close(fd)
        raise AutoshardError(
            f"checkpoint folder {root} is in use by another job ({who}); wait for it to end "
            f"or stop it, or give this run another --checkpoint-dir"
        ) from None
    held = CheckpointLock(str(root.resolve()), fd)
    held.note(holder)
    return held


def remove_partials(checkpoint_dir: str | Path) -> list[Path]:
    """Remove the ``.partial`` folders of dead writers (call only while holding the folder's ``lock``)."""
    root = Path(checkpoint_dir)
    gone = sorted(root.glob(".step-*.partial")) if root.is_dir() else []
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def _lock_for_job(checkpoint_dir: str | Path) -> None:
    """On rank 0: lock the folder for this job unless its launcher holds the lock (``LOCK_HELD_ENV``),
    then remove dead writers' ``.partial`` folders."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    folder = str(Path(checkpoint_dir).resolve())
    if os.environ.get(LOCK_HELD_ENV) != folder and folder not in _held:
        _held[folder] = lock(checkpoint_dir, holder=f"training rank 0 pid {os.getpid()}")
    remove_partials(checkpoint_dir)


def latest(checkpoint_dir: str | Path) -> Path | None:
    """The newest complete checkpoint (``.partial`` folders are never complete)."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return None
    done = sorted(p for p in root.iterdir() if STEP_DIR.fullmatch(p.name) and (p / ".metadata").is_file())
    return done[-1] if done else None


def load(path: str | Path, model, optimizer, mesh=None, data=None, scheduler=None, scaler=None) -> int:
    """Restore model and optimizer (and ``scheduler``, ``scaler``, given them) in place from ``path``; returns the steps
    already done. With ``data``
    (``runtime.data.RankBatches``), a checkpoint that keeps a data position must have been written on the same
    data (``check_position``); older checkpoints keep none."""
    model_state, optim_state, restore = _state(model, optimizer, mesh)
    check_same_model(path, model_state, this_rank_has_all=not isinstance(optimizer, StageOptimizers))
    kept = saved_data_keys(path)
    state = {"model": model_state, "optim": optim_state, "steps_done": torch.tensor(0)}
    if scheduler is not None and _has_scheduler(path):
        state["scheduler"] = scheduler_state(scheduler)
    if scaler is not None and scaler.is_enabled() and _has_key(path, "scaler."):
        state["scaler"] = scaler_state(scaler)
    if data is not None and kept:
        state["data"] = {key: torch.tensor(0) for key in kept}
    safe_load.dcp_load(state, Path(path))  # dcp.load that runs no code from the checkpoint (safe_load)
    if "data" in state:
        data.check_position(
            {key: int(value) for key, value in state["data"].items()}, str(path), int(state["steps_done"])
        )
    restore()
    steps_done = int(state["steps_done"])
    if scheduler is not None:  # saved without one: the position of the steps done
        load_scheduler_state(scheduler, state.get("scheduler") or scheduler_position(steps_done))
    if "scaler" in state:
        load_scaler_state(scaler, state["scaler"])
    return steps_done


def scaler_state(scaler) -> dict[str, torch.Tensor]:
    """A loss scaler's (``runtime.grad_scaler``) scale and steps since it last grew, as checkpoints hold them."""
    return {
        "scale": torch.tensor(float(scaler.get_scale()), dtype=torch.float64),
        "growth_tracker": torch.tensor(int(scaler._get_growth_tracker())),
    }


def load_scaler_state(scaler, state: dict[str, torch.Tensor]) -> None:
    """Put ``scaler_state``'s scale and growth count back: a resumed fp16 run scales as the uninterrupted one."""
    kept = scaler.state_dict()
    if kept:  # an enabled scaler
        scaler.load_state_dict(
            {**kept, "scale": float(state["scale"]), "_growth_tracker": int(state["growth_tracker"])}
        )


def _has_key(path: str | Path, prefix: str) -> bool:
    metadata = safe_load.SafeFileSystemReader(Path(path)).read_metadata().state_dict_metadata
    return any(key.startswith(prefix) for key in metadata)


def saved_data_keys(path: str | Path) -> list[str]:
    """The data position's keys a checkpoint keeps (none before checkpoints kept it)."""
    metadata = safe_load.SafeFileSystemReader(Path(path)).read_metadata().state_dict_metadata
    return sorted(key.removeprefix("data.") for key in metadata if key.startswith("data."))


def _has_scheduler(path: str | Path) -> bool:
    """The checkpoint keeps a learning-rate scheduler's position (older ones do not)."""
    metadata = safe_load.SafeFileSystemReader(Path(path)).read_metadata().state_dict_metadata
    return any(key.startswith("scheduler.") for key in metadata)


def _lr_schedulers(scheduler) -> list:
    """The torch LR schedulers of ``scheduler``: itself, or each stage's (``recipe.StageSchedulers``)."""
    return list(getattr(scheduler, "schedulers", [scheduler]))


def scheduler_position(steps_done: int) -> dict[str, torch.Tensor]:
    """A scheduler's position after ``steps_done`` steps (``scheduler_state``), one scheduler step per optimizer step
    (LambdaLR counts its own first step at construction)."""
    return {"last_epoch": torch.tensor(steps_done), "step_count": torch.tensor(steps_done + 1)}


def scheduler_state(scheduler) -> dict[str, torch.Tensor]:
    """A learning-rate scheduler's position as checkpoints hold it: tensors only, the same on every rank and
    every stage. The rates are a function of the recipe and the position (``recipe.lr_factor``), so nothing else
    is saved, and nothing is unpickled on load."""
    first = _lr_schedulers(scheduler)[0]
    return {"last_epoch": torch.tensor(first.last_epoch), "step_count": torch.tensor(first._step_count)}


def load_scheduler_state(scheduler, state: dict[str, torch.Tensor]) -> None:
    """Put ``scheduler_state``'s position back, and each param group's rate with it: lr = base_lr·factor(position)
    (ZeRO-1's optimizer copies its groups' rates into its local optimizer's at each step, so the rate is set on
    the groups, not only read back with the optimizer's state)."""
    for one in _lr_schedulers(scheduler):
        one.load_state_dict(
            {**one.state_dict(), "last_epoch": int(state["last_epoch"]), "_step_count": int(state["step_count"])}
        )
        rates = [base * factor(one.last_epoch) for base, factor in zip(one.base_lrs, one.lr_lambdas)]
        for group, rate in zip(one.optimizer.param_groups, rates):
            group["lr"] = rate
        one._last_lr = rates


def check_same_model(path: str | Path, model_state: dict, this_rank_has_all: bool = True) -> None:
    """Refuse, in one line, a checkpoint written for another model: its parameter names and whole shapes
    (DCP's metadata, read without running code) must be this model's, whatever the plans of the two
    runs (state is keyed by the original model's names). A pipeline rank holds its stages only
    (``this_rank_has_all`` False): then the checkpoint may have more. Every rank finds the same
    mismatch, so only rank 0 prints it (``same_on_every_rank``; ``faults.guard``)."""
    metadata = safe_load.SafeFileSystemReader(Path(path)).read_metadata().state_dict_metadata
    saved = {
        key[len("model.") :]: tuple(getattr(meta, "size", ()))
        for key, meta in metadata.items()
        if key.startswith("model.")
    }
    here = {name: tuple(value.shape) for name, value in model_state.items() if isinstance(value, torch.Tensor)}
    missing = sorted(set(here) - set(saved))
    extra = sorted(set(saved) - set(here)) if this_rank_has_all else []
    reshaped = [name for name in here if name in saved and saved[name] != here[name]]
    if not (missing or extra or reshaped):
        return
    if reshaped:
        name = reshaped[0]
        what = f"'{name}' is {list(saved[name])} there and {list(here[name])} here" + (
            f" ({len(reshaped) - 1} more differ)" if len(reshaped) > 1 else ""
        )
    elif missing:
        what = f"it has no '{missing[0]}'" + (f" ({len(missing) - 1} more missing)" if len(missing) > 1 else "")
    else:
        what = f"it has '{extra[0]}', which this model lacks" + (f" ({len(extra) - 1} more)" if len(extra) > 1 else "")
    exc = AutoshardError(
        f"checkpoint {path} was written for another model: {what}; fix: give this run another "
        f"--checkpoint-dir, or resume it with the model that wrote it"
    )
    exc.same_on_every_rank = True
    raise exc


def resume(
    checkpoint_dir: str | Path | None, model, optimizer, mesh=None, data=None, scheduler=None, scaler=None
) -> int:
    """Load the newest complete checkpoint in ``checkpoint_dir`` if any (``scheduler`` and ``scaler``
    too, given them); the step to start at (``data``, the
    run's ``RankBatches``, then reads from that step's position)."""
    if not checkpoint_dir:
        return 0
    _lock_for_job(checkpoint_dir)
    found = latest(checkpoint_dir)
    steps_done = load(found, model, optimizer, mesh, data, scheduler=scheduler, scaler=scaler) if found else 0
    if found and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:  # a restart says it itself
        _say(f"resumed from checkpoint {found} ({steps_done} steps done): training goes on at step {steps_done}")
    _announce_restart(found, steps_done)
    return steps_done


def _announce_restart(found: Path | None, steps_done: int) -> None:
    """Rank 0 of a restarted attempt says so in one line. The rank that survived a dead peer says it too
    (``faults.peer_gone_message``), but only when it sees the broken collective before torchrun stops it,
    which is a race; this line comes from the attempt that resumes, so it is always there."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = dist.get_rank() if dist.is_initialized() else 0
    if attempt == 0 or rank != 0:
        return
    allowed = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    source = f"checkpoint {found.name} (step {steps_done})" if found else "the start (no complete checkpoint yet)"
    print(f"restart {attempt} of {allowed}: every rank resumes from {source}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- state dicts by plan


def _state(model, optimizer, mesh) -> tuple[dict, dict, Callable[[], None]]:
    """(model state, optimizer state, a function that puts loaded values back into the run)."""
    if isinstance(optimizer, StageOptimizers):
        return _pipeline_state(model, optimizer, mesh)
    if _is_zero_redundancy(optimizer):
        optimizer = optimizer.optim  # the local AdamW over the parameters this rank owns
    model_state, optim_state = get_state_dict(model, optimizer, options=OPTIONS)

    def restore() -> None:
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state, options=OPTIONS)

    return model_state, optim_state, restore


def _is_zero_redundancy(optimizer) -> bool:
    """``optimizer`` is a ZeroRedundancyOptimizer, without importing torch.distributed.optim (its functional
    optimizers take a second per rank to import; ``runtime.parallel`` imports it for ZeRO-1 over DDP only)."""
    optim = sys.modules.get("torch.distributed.optim")
    return optim is not None and isinstance(optimizer, optim.ZeroRedundancyOptimizer)


def model_state(model, mesh=None) -> tuple[dict, Callable[[], None]]:
    """The model's weights alone, as checkpoints hold them (``_state``'s model part: the original names, a
    sharded tensor as the DTensor of its whole), before any optimizer exists (``init_replay.materialize``),
    and the function that puts loaded values back."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    modules = getattr(model, "modules", None)
    if not isinstance(modules, list):  # a module, not pipeline stages
        state = get_model_state_dict(model, options=OPTIONS)
        return state, lambda: set_model_state_dict(model, state, options=OPTIONS)
    per_stage = [get_model_state_dict(m, options=OPTIONS) for m in modules]
    originals = {("model", k): v for stage in per_stage for k, v in stage.items()}
    wrapped = _as_globals(originals, model, modules, mesh)
    state = {k: wrapped.get(("model", k), v) for (_, k), v in originals.items()}

    def restore() -> None:
        for key, value in wrapped.items():
            _local(originals[key]).copy_(value.to_local())

    return state, restore


def _as_globals(originals: dict, parts, modules: list[nn.Module], mesh) -> dict:
    """The stage-local shards among ``originals`` ((kind, key) -> tensor) as DTensors of their wholes: TP
    shards (``_as_global``) and expert shards (``_expert_as_global``)."""
    dims = getattr(parts, "tp_shard_dims", {})
    experts = _expert_shards(modules)
    wrapped = {
        key: _as_global(value, dims[name], mesh)
        for key, value in originals.items()
        if (name := _param_name(*key)) in dims and isinstance(value, torch.Tensor) and value.dim() > 0
    }
    wrapped |= {
        key: _expert_as_global(value, experts[name])
        for key, value in originals.items()
        if (name := _param_name(*key)) in experts
        and name not in dims
        and isinstance(value, torch.Tensor)
        and value.dim() > 0
    }
    return wrapped


def _pipeline_state(parts, optimizers: StageOptimizers, mesh) -> tuple[dict, dict, Callable[[], None]]:
    per_stage = [get_state_dict(m, o, options=OPTIONS) for m, o in zip(optimizers.modules, optimizers.optimizers)]
    model_state = {k: v for m, _ in per_stage for k, v in m.items()}
    optim_state = {k: v for _, o in per_stage for k, v in o.items()}
    originals = {
        **{("model", k): v for k, v in model_state.items()},
        **{("optim", k): v for k, v in optim_state.items()},
    }
    wrapped = _as_globals(originals, parts, optimizers.modules, mesh)
    model_state.update({k: v for (kind, k), v in wrapped.items() if kind == "model"})
    optim_state.update({k: v for (kind, k), v in wrapped.items() if kind == "optim"})
    saved, copies = one_name_per_tie(optim_state, parts.aliases)

    def restore() -> None:
        for key, held in copies.items():  # this rank's other copy of a tied weight: the state loaded for the first
            _copy_state(optim_state[key], saved[held])
        for key, value in wrapped.items():
            _local(originals[key]).copy_(value.to_local())
        for (module, optimizer), (m, o) in zip(zip(optimizers.modules, optimizers.optimizers), per_stage):
            set_state_dict(
                module,
                optimizer,
                options=OPTIONS,
                model_state_dict={k: originals[("model", k)] for k in m},
                optim_state_dict={k: originals[("optim", k)] for k in o},
            )

    return model_state, saved, restore


def one_name_per_tie(optim_state: dict, aliases: tuple[tuple[str, ...], ...]) -> tuple[dict, dict[str, str]]:
    """A pipeline rank's optimizer state with one name per tied weight, and the keys it leaves out.

    A tied weight has one optimizer state whatever the plan, kept under the first of its names
    (``pipeline_parallel.state_aliases``: the order of ``named_parameters``, the name torch's ``get_state_dict``
    keeps for an SPMD plan's one parameter): ``state.lm_head.weight.exp_avg`` of the last stage is saved and
    loaded as ``state.transformer.wte.weight.exp_avg``, so a checkpoint of any plan resumes under any other.
    Where one rank holds two copies (interleaved or V stages), one is saved; the other is left out and
    returned as key -> the key it takes its loaded state from (the copies are equal: their gradients are
    summed, ``TiedCopies``)."""
    first = {
        f"{kind}.{name}.": f"{kind}.{group[0]}."
        for group in aliases
        for name in group[1:]
        for kind in ("state", "param_groups")  # DCP's flattened keys: state.<name>.<key>, param_groups.<name>.<key>
    }
    saved: dict = {}
    copies: dict[str, str] = {}
    for key, value in optim_state.items():
        prefix = next((prefix for prefix in first if key.startswith(prefix)), None)
        held = first[prefix] + key[len(prefix) :] if prefix is not None else key
        if held in saved:
            copies[key] = held
        else:
            saved[held] = value
    return saved, copies


def _copy_state(into, value) -> None:
    """Put a loaded state tensor's values into another copy's (a DTensor in that copy's layout)."""
    if not isinstance(into, torch.Tensor):
        return  # a hyper-parameter (``param_groups``): the run's own, as for every other parameter
    if isinstance(value, DTensor) and isinstance(into, DTensor) and value.placements != into.placements:
        value = value.redistribute(into.device_mesh, into.placements)
    _local(into).copy_(_local(value))


def _param_name(kind: str, key: str) -> str:
    """The parameter a flattened key belongs to: ``state.<name>.exp_avg`` -> ``<name>``."""
    if kind == "model":
        return key
    return key.removeprefix("state.").rpartition(".")[0] if key.startswith("state.") else ""


def _as_global(value: torch.Tensor, dim: int, mesh) -> DTensor:
    """A TP-local shard (plain, or FSDP2's Shard(0) over dp, or over the dp·cp ranks with context parallelism) as
    the DTensor of the whole tensor."""
    tp = mesh["tp"].size()
    if isinstance(value, DTensor):  # FSDP2 on dp over a tp shard: 2-D, as FSDP2 itself lays out TP params
        shape = list(value.shape)
        shape[dim] *= tp
        dp_placement = _StridedShard(0, split_factor=tp) if dim == 0 else Shard(0)
        if value.placements[0].is_replicate():  # FSDP2's replicate (ZeRO-0): whole on every dp rank
            dp_placement = Replicate()
        (dp_axis,) = value.device_mesh.mesh_dim_names  # the dp wrapper's own axis: "dp", or "dp_cp" beside cp
        return DTensor.from_local(
            value.to_local(),
            mesh[dp_axis, "tp"],
            (dp_placement, Shard(dim)),
            run_check=False,
            shape=torch.Size(shape),
            stride=_contiguous_stride(shape),
        )
    shape = list(value.shape)
    shape[dim] *= tp
    return DTensor.from_local(
        value, mesh["tp"], (Shard(dim),), run_check=False, shape=torch.Size(shape), stride=_contiguous_stride(shape)
    )


def _expert_shards(modules: list[nn.Module]) -> dict:
    """Name -> ``ExpertShard`` of every plain expert shard in the stage modules (``expert_parallel``)."""
    from autoshard.runtime.expert_parallel import expert_shard_of

    return {
        name: shard
        for module in modules
        for name, param in module.named_parameters()
        if (shard := expert_shard_of(param)) is not None
    }


_EP_MESHES: dict = {}  # ep process group -> its 1-D DeviceMesh (one per group, made once)


def _expert_as_global(value: torch.Tensor, shard) -> DTensor:
    """A plain expert shard (its E/ep experts along dim 0) as the DTensor of all E experts: Shard(0) over its
    ep group, whose ranks hold the shards in rank order; the ranks that hold the same shard (its dp / ep
    replicas) write one copy between them (DCP's dedup of equal chunks)."""
    from torch.distributed.device_mesh import DeviceMesh

    if shard.group not in _EP_MESHES:
        _EP_MESHES[shard.group] = DeviceMesh.from_group(shard.group, value.device.type)
    shape = [value.shape[0] * shard.ep, *value.shape[1:]]
    return DTensor.from_local(
        value,
        _EP_MESHES[shard.group],
        (Shard(0),),
        run_check=False,
        shape=torch.Size(shape),
        stride=_contiguous_stride(shape),
    )


def _contiguous_stride(shape: list[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value
