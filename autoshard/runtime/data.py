"""Batches: what each rank trains on at each step, and the global batch one process sees.

Three sources, the first that is there (``DataSource``):

1. ``--data PATH``: a flat token file (nanoGPT's / Megatron's ``.bin``: tokens back to back, no header,
   ``--data-dtype`` uint16 or int32), read through ``numpy.memmap`` (``TokenFile``) as non-overlapping
   windows of s = the plan's tokens per sample: sample i is ``((t[i·s : i·s+s],), t[i·s+1 : i·s+s+1])``, int64,
   so there are ⌊(N − 1) / s⌋ samples in N tokens;
2. the model file's ``dataset(seq_len)``: a map-style ``torch.utils.data.Dataset`` of ``(inputs, target)``, or an
   iterable of them (an ``IterableDataset``, a generator's iterable: a stream, ``SampleStream``);
3. neither: ``example_batch`` drawn under a seed derived from (seed, step), torch's RNG state saved and
   restored around it, so every rank and the one-process reference draw the very same global batch
   (``global_batch``); each rank takes its contiguous slice (``take_samples``).

A dataset is read through ``DataLoader`` with ``DistributedSampler(num_replicas=dp, rank=dp index,
shuffle=True, seed, drop_last=True)`` (``RankBatches``), b = B / dp samples per rank and step; the ranks of
the other mesh dims (tp, pp, cp) read what their dp index reads (cp ranks then cut the tokens,
``take_sequence_shard``). Why this is exact: the sampler's permutation π_e of epoch e is
``randperm(len, seed + e)`` whatever the number of replicas, truncated to dp·⌊len / dp⌋, and rank r takes
π_e[r::dp]. With E = ⌊⌊len / dp⌋ / b⌋ steps per epoch, step k is batch j = k mod E of epoch e = ⌊k / E⌋, and

    global batch of step k = concat over r = 0..dp−1 of π_e[r::dp][j·b : (j+1)·b]

whose contiguous slice r (``take_shard``, as with ``example_batch``) is rank r's loader batch: one process
rebuilds it (``dataset_global_batch``, what ``autoshard verify``'s reference trains on). Its samples do not
depend on dp (an elastic run re-planned at another dp goes on with the same data): rank r's i-th sample of batch
j is π_e[r + dp·(j·b + i)] = π_e[j·B + (r + dp·i)], and r + dp·i over r < dp, i < b is 0 .. B − 1, so step k
holds π_e[j·B : (j+1)·B] in another order; and E = ⌊len / B⌋ whatever dp, since B is a multiple of dp
(⌊len / dp⌋·dp = len − (len mod B) mod dp, which lies in [⌊len / B⌋·B, (⌊len / B⌋ + 1)·B)).

A stream (an iterable dataset) has no length and no indexing, so no sampler: step k's global batch is its
samples [k·B, (k+1)·B) counted within the pass, a pass that ends inside a batch drops the rest and the next
pass (epoch) iterates the dataset again. Every rank and the one-process reference iterate it themselves and
rank r keeps slice r (``take_shard``), so the stream must give the same samples in every process (seed any
shuffling it does); it is read in the training process (DataLoader workers would each get a copy of it), and
reaching step k, a resume included, reads the samples before it.

Resuming (``runtime.checkpoint``): the position is a function of the step, so a run resumed after k steps
starts the sampler at epoch ⌊k / E⌋, ``j·b`` samples into its share (``ResumableSampler``) and reads exactly
what an uninterrupted run would have read. The checkpoint keeps the position (epoch, samples consumed, the
dataset's length, the seed) to refuse a resume on other data (``check_position``). The position is this
deterministic one, not torchdata's ``StatefulDataLoader``: nothing to install, and nothing a worker holds
needs saving.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, default_collate

from autoshard.errors import AutoshardError
from autoshard.modelfile import ModelFile
from autoshard.runtime.randomness import drawing_freely

STEP_SEED_STRIDE = 1_000_003  # a prime, so (seed, step) pairs do not collide for small seeds
TOKEN_DTYPES = {"uint16": np.uint16, "int32": np.int32}  # --data-dtype
MAX_CHUNK_TOKENS = 1 << 24  # TokenFile.max_token reads the file in chunks of this many tokens
EXAMPLE_DRAWS = 0  # a checkpoint's dataset_length for a run on example_batch draws
STREAM = -1  # a checkpoint's dataset_length for a run on a stream (an iterable dataset: no length)


def global_batch(model_file: ModelFile, batch_size: int, seed: int, step: int):
    """``(inputs, targets)`` of the whole step drawn from ``example_batch``, identical on every rank."""
    with torch.random.fork_rng(devices=[]), drawing_freely():  # drawn as usual where random ops are fixed
        torch.manual_seed(seed * STEP_SEED_STRIDE + step)
        return model_file.example_batch(batch_size)


def take_samples(batch, mesh, axis: str, device: torch.device):
    """This rank's share of the samples: the slice of the batch dimension of its place along the mesh dim
    ``axis`` (the plan's data axis, "dp"); the ranks along the other dims take the same samples."""
    return take_shard(batch, mesh.get_local_rank(axis), mesh[axis].size(), device)


def take_shard(batch, index: int, count: int, device: torch.device):
    """Rank ``index`` of ``count`` takes its contiguous slice of the batch dimension."""
    inputs, targets = batch
    return tuple(_slice(t, index, count).to(device) for t in inputs), _slice(targets, index, count).to(device)


def split_microbatches(inputs: tuple, targets: Any, count: int):
    """``count`` equal micro-batches of (inputs, targets)."""
    input_chunks = [t.chunk(count) for t in inputs]
    target_chunks = targets.chunk(count)
    return [(tuple(c[i] for c in input_chunks), target_chunks[i]) for i in range(count)]


def _slice(t: torch.Tensor, index: int, count: int) -> torch.Tensor:
    size = t.shape[0] // count
    return t[index * size : (index + 1) * size]


# ---------------------------------------------------------------------------- datasets


@dataclass(frozen=True)
class DataSource:
    """What a program trains on: ``--data`` (a token file of ``--data-dtype``), else the model file's
    ``dataset``, else ``example_batch`` draws."""

    path: str | None = None
    dtype: str = "uint16"

    def __post_init__(self):
        if self.dtype not in TOKEN_DTYPES:
            raise AutoshardError(
                f"--data-dtype {self.dtype} is not one of {', '.join(TOKEN_DTYPES)}; pass the "
                f"type the token file was written with"
            )

    def program_args(self) -> list[str]:
        """The emitted program's flags for this source."""
        return ["--data", str(self.path), "--data-dtype", self.dtype] if self.path else []

    def name(self, model_file: ModelFile) -> str:
        """The source as an error names it."""
        return f"--data {self.path}" if self.path else f"{model_file.path.name}'s dataset"


class TokenFile(Dataset):
    """A flat token file as non-overlapping windows of ``tokens_per_sample`` (module doc): sample i is
    ``((t[i·s : i·s+s],), t[i·s+1 : i·s+s+1])`` as int64. The file is opened with ``numpy.memmap`` in each
    process that reads it (DataLoader workers included), so nothing is read until a sample is."""

    def __init__(self, path: str | Path, tokens_per_sample: int, dtype: str = "uint16"):
        self.path, self.tokens_per_sample, self.dtype = Path(path), tokens_per_sample, dtype
        flag = f"--data {path}"
        if not self.path.is_file():
            raise AutoshardError(f"{flag}: no such file; fix: pass a flat token file (e.g. nanoGPT's train.bin)")
        itemsize = np.dtype(TOKEN_DTYPES[dtype]).itemsize
        size = self.path.stat().st_size
        if size % itemsize:
            raise AutoshardError(
                f"{flag}: {size} bytes is not a whole number of {dtype} tokens; fix: pass "
                f"--data-dtype with the type the file was written in"
            )
        self.num_tokens = size // itemsize
        if self.num_tokens < tokens_per_sample + 1:
            raise AutoshardError(
                f"{flag}: {self.num_tokens} tokens, fewer than one sample needs "
                f"({tokens_per_sample} + 1); fix: pass a longer token file"
            )
        self._tokens: np.ndarray | None = None

    @property
    def tokens(self) -> np.ndarray:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=TOKEN_DTYPES[self.dtype], mode="r")
        return self._tokens

    def __getstate__(self):  # DataLoader workers open their own map
        return {**self.__dict__, "_tokens": None}

    def __len__(self) -> int:
        return (self.num_tokens - 1) // self.tokens_per_sample

    def __getitem__(self, index: int):
        s = self.tokens_per_sample
        window = torch.from_numpy(self.tokens[index * s : index * s + s + 1].astype(np.int64))
        return (window[:-1],), window[1:]

    def max_token(self) -> int:
        """The largest token id in the file (read once, in chunks)."""
        tokens = self.tokens
        return max(int(tokens[i : i + MAX_CHUNK_TOKENS].max()) for i in range(0, len(tokens), MAX_CHUNK_TOKENS))


def open_dataset(model_file: ModelFile, source: DataSource, tokens_per_sample: int) -> Dataset | None:
    """The dataset a program trains on (``DataSource``), checked against ``example_batch(1)``
    (``check_samples``); None for ``example_batch`` draws."""
    if source.path:
        dataset = TokenFile(source.path, tokens_per_sample, source.dtype)
    elif model_file.has_dataset:
        dataset = model_file.dataset()
    else:
        return None
    check_samples(dataset, model_file, source)
    if isinstance(dataset, TokenFile):
        check_token_ids(dataset, model_file)
    return dataset


def check_samples(dataset, model_file: ModelFile, source: DataSource, what: str | None = None) -> None:
    """Refuse, in one line naming the difference and the fix, a dataset whose samples are not one row of
    ``example_batch``: a map-style dataset (``len``, indexing), or an iterable one that can be iterated again,
    of ``(inputs: tuple, target)`` with the same number
    of inputs, dtypes and shapes (without the batch dimension). ``what`` names the dataset (default: the source's
    name)."""
    fix = (
        "fix: make its samples shaped like one row of example_batch"
        if what
        else "fix: pass --data only for a model that takes token ids and predicts the next ones, or define "
        "dataset(seq_len) in the model file"
        if source.path
        else "fix: make dataset(seq_len) return samples shaped like one row of example_batch"
    )
    what = what or source.name(model_file)
    if is_stream(dataset) and not hasattr(dataset, "__iter__"):
        raise AutoshardError(
            f"{what} is a {type(dataset).__name__}, neither a map-style Dataset (len and indexing) "
            f"nor an iterable of samples; fix: return a torch.utils.data.Dataset or IterableDataset"
        )
    if is_stream(dataset) and not isinstance(dataset, IterableDataset) and iter(dataset) is dataset:
        raise AutoshardError(
            f"{what} is a {type(dataset).__name__}, an iterator (its __iter__ returns itself, so it "
            f"may run once; each epoch, each rank and the one-process check iterate the data anew); "
            f"fix: return an IterableDataset whose __iter__ starts the stream again"
        )
    if not is_stream(dataset) and len(dataset) == 0:
        raise AutoshardError(f"{what} is empty; fix: give it samples")
    try:
        sample = next(iter(dataset), None) if is_stream(dataset) else dataset[0]
    except Exception as exc:  # noqa: BLE001  (the user's dataset failed)
        raise AutoshardError(
            f"{what}: reading sample 0 raised {type(exc).__name__}: {str(exc)[:200]}; fix the dataset"
        ) from exc
    if sample is None and is_stream(dataset):
        raise AutoshardError(f"{what} yields no sample; fix: give it samples")
    inputs, targets = global_batch(model_file, 1, 0, 0)
    want = _layout(tuple(t[0] for t in inputs), targets[0])
    if not (isinstance(sample, (tuple, list)) and len(sample) == 2 and isinstance(sample[0], (tuple, list))):
        raise AutoshardError(
            f"{what}: a sample is a {type(sample).__name__}, not (inputs: tuple, target) "
            f"like one row of example_batch {want}; {fix}"
        )
    got = _layout(tuple(sample[0]), sample[1])
    if got != want:
        raise AutoshardError(f"{what}: a sample is {got} but one row of example_batch is {want}; {fix}")


def _layout(inputs: tuple, target) -> str:
    """``(inputs (int64 [64],), target int64 [64])``: what a sample's structure is compared by."""

    def one(t) -> str:
        return (
            f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"
            if isinstance(t, torch.Tensor)
            else type(t).__name__
        )

    return f"(inputs ({', '.join(one(t) for t in inputs)},), target {one(target)})"


def check_token_ids(dataset: TokenFile, model_file: ModelFile) -> None:
    """Refuse a token file with an id the model cannot embed: at least its largest ``nn.Embedding``'s rows
    (the vocabulary; a position table is never larger). Models without an embedding are not checked."""
    sizes = [m.num_embeddings for m in model_file.build("meta").modules() if isinstance(m, torch.nn.Embedding)]
    if not sizes:
        return
    largest = dataset.max_token()
    if largest >= max(sizes):
        raise AutoshardError(
            f"--data {dataset.path}: token id {largest} is past the model's vocabulary of "
            f"{max(sizes)} (its largest embedding); fix: tokenize with the model's vocabulary, "
            f"or pass the --data-dtype the file was written in"
        )


def is_stream(dataset) -> bool:
    """An iterable dataset: an ``IterableDataset``, or anything without both a length and indexing."""
    return isinstance(dataset, IterableDataset) or not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"))


class SampleStream:
    """An iterable dataset as a sequence of global batches of B samples (module doc): ``batch(k)`` is step k's,
    the samples [j·B, (j+1)·B) of pass e (k = the steps of the passes before e, plus j). Asking for an earlier
    step than the last starts from the first pass again. A dataset with ``set_epoch`` (a shuffling stream) is told
    each pass's epoch. The stream is read with torch's RNG state saved and restored around it, so a stream that
    draws leaves the training's draws (dropout) as they were, whether a run resumed or not."""

    def __init__(self, dataset, global_batch_size: int):
        self.dataset, self.global_batch_size = dataset, global_batch_size
        self._restart()

    def _restart(self) -> None:
        self.steps_read, self.epoch, self.epoch_steps_read, self._last = 0, 0, 0, None
        self._samples = None  # the first pass begins when read (inside batch's saved RNG state)

    def _pass(self, epoch: int):
        if callable(getattr(self.dataset, "set_epoch", None)):
            self.dataset.set_epoch(epoch)
        return iter(self.dataset)

    def batch(self, step: int) -> list:
        """Step ``step``'s B samples, reading (and dropping) those of the steps between the last one asked and it."""
        if step == self.steps_read - 1 and self._last is not None:
            return self._last
        if step < self.steps_read:
            self._restart()
        with torch.random.fork_rng(devices=[]), drawing_freely():
            while True:
                samples = self._next_batch()
                if self.steps_read == step + 1:
                    self._last = samples
                    return samples

    def _next_batch(self) -> list:
        if self._samples is None:
            self._samples = self._pass(self.epoch)
        samples = list(itertools.islice(self._samples, self.global_batch_size))
        if len(samples) < self.global_batch_size:  # the pass ended: drop its tail, iterate the dataset again
            if self.epoch_steps_read == 0:
                raise _same_everywhere(
                    f"the dataset's stream gave {len(samples)} samples in a pass, fewer than one "
                    f"global batch of {self.global_batch_size}; fix: more data, or a plan with "
                    f"a smaller --global-batch"
                )
            self.epoch, self.epoch_steps_read = self.epoch + 1, 0
            self._samples = self._pass(self.epoch)
            return self._next_batch()
        self.steps_read, self.epoch_steps_read = self.steps_read + 1, self.epoch_steps_read + 1
        return samples


def collate(samples: list) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Samples stacked into ``(inputs: tuple, targets)``, as ``example_batch`` returns a batch."""
    inputs, targets = default_collate([(tuple(x), y) for x, y in samples])
    return tuple(inputs), targets


def steps_per_epoch(dataset_length: int, global_batch_size: int, dp: int) -> int:
    """E = ⌊⌊len / dp⌋ / (B / dp)⌋: whole global batches per epoch (DistributedSampler and DataLoader drop the
    rest), refused when not even one fits."""
    steps = (dataset_length // dp) // (global_batch_size // dp)
    if steps == 0:
        raise AutoshardError(
            f"the dataset has {dataset_length} samples, fewer than one global batch of "
            f"{global_batch_size} over {dp} data-parallel ranks; fix: more data, or a plan with a "
            f"smaller --global-batch"
        )
    return steps


def position(step: int, epoch_steps: int) -> tuple[int, int]:
    """(epoch, batch within it) of ``step``."""
    return divmod(step, epoch_steps)


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` that starts ``start`` samples into this rank's share of the epoch (a resumed run)."""

    start = 0

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.start, None)

    def __len__(self) -> int:
        return self.num_samples - self.start


def rank_indices(dataset_length: int, dp: int, rank: int, seed: int, epoch: int) -> list[int]:
    """π_e[r::dp]: the sample indices ``DistributedSampler`` gives dp rank ``rank`` in ``epoch``."""
    sampler = DistributedSampler(
        range(dataset_length), num_replicas=dp, rank=rank, shuffle=True, seed=seed, drop_last=True
    )
    sampler.set_epoch(epoch)
    return list(sampler)


def dataset_global_batch(dataset, global_batch_size: int, dp: int, seed: int, step: int):
    """The global batch of ``step`` as one process rebuilds it: the dp ranks' loader batches in rank order
    (module doc), so its ``take_shard`` slice r is rank r's batch."""
    per_rank = global_batch_size // dp
    epoch, batch = position(step, steps_per_epoch(len(dataset), global_batch_size, dp))
    indices = [
        i
        for r in range(dp)
        for i in rank_indices(len(dataset), dp, r, seed, epoch)[batch * per_rank : (batch + 1) * per_rank]
    ]
    return collate([dataset[i] for i in indices])


def global_batches(
    model_file: ModelFile,
    source: DataSource | None,
    global_batch_size: int,
    seed: int,
    tokens_per_sample: int | None = None,
    dp: int = 1,
):
    """``step -> (inputs, targets)`` of the whole step, as one process trains on it: the dataset's
    (``dataset_global_batch``) or, with ``source`` None or naming no dataset, ``example_batch``'s (``global_batch``)."""
    dataset = None if source is None else open_dataset(model_file, source, tokens_per_sample)
    if dataset is None:
        return lambda step: global_batch(model_file, global_batch_size, seed, step)
    if is_stream(dataset):
        stream = SampleStream(dataset, global_batch_size)
        return lambda step: collate(stream.batch(step))
    return lambda step: dataset_global_batch(dataset, global_batch_size, dp, seed, step)


class RankBatches:
    """This rank's samples of each step (``take``), from the source ``DataSource`` names: a dataset through
    ``DataLoader`` + ``ResumableSampler`` over the dp ranks (``workers`` processes, prefetching, pinned on CUDA),
    or ``example_batch`` draws, or a stream read in this process (``SampleStream``); ``position`` and
    ``check_position`` for checkpoints (module doc). ``dataset``: a map-style or iterable dataset of
    ``(inputs, target)`` samples read in place of the source's (the Python API's
    ``Parallelized.data_loader``), checked the same way. Iterating gives ``take(0)``, ``take(1)``, ...

    ``reads=False``: a pipeline rank holding neither the first stage (which takes the inputs) nor the last (the
    targets) reads nothing: no loader, no workers, no draws; ``take`` gives ``((), None)``. It still opens the
    dataset (its length fixes the position its checkpoints keep)."""

    def __init__(
        self,
        model_file: ModelFile,
        source: DataSource,
        global_batch_size: int,
        tokens_per_sample: int,
        mesh,
        axis: str,
        device: torch.device,
        seed: int,
        workers: int = 1,
        dataset: Dataset | None = None,
        reads: bool = True,
    ):
        self.model_file, self.global_batch_size, self.device, self.seed = model_file, global_batch_size, device, seed
        self.reads = reads
        self.dp, self.dp_index = mesh[axis].size(), mesh.get_local_rank(axis)
        if dataset is None:
            self.dataset = open_dataset(model_file, source, tokens_per_sample)
        else:
            check_samples(dataset, model_file, source, what="the dataset given")
            self.dataset = dataset
        self.loader, self._next_step, self._batches, self.stream = None, None, None, None
        if self.dataset is None:
            return
        if is_stream(self.dataset):  # read in this process, every rank the whole stream (module doc)
            self.stream = SampleStream(self.dataset, global_batch_size) if reads else None
            return
        self.epoch_steps = steps_per_epoch(len(self.dataset), global_batch_size, self.dp)
        if not reads:
            return
        self.sampler = ResumableSampler(
            self.dataset, num_replicas=self.dp, rank=self.dp_index, shuffle=True, seed=seed, drop_last=True
        )
        self.loader = DataLoader(
            self.dataset,
            batch_size=global_batch_size // self.dp,
            sampler=self.sampler,
            drop_last=True,
            collate_fn=collate,
            num_workers=workers,
            pin_memory=device.type == "cuda",
            persistent_workers=workers > 0,
            prefetch_factor=2 if workers > 0 else None,
            multiprocessing_context=_fork(workers),
            generator=torch.Generator().manual_seed(seed),
        )  # torch's global RNG untouched

    def take(self, step: int):
        """``(inputs, targets)`` of this rank at ``step`` on its device: ``take_shard`` of the step's global batch
        (``((), None)`` on a rank that reads nothing)."""
        if not self.reads:
            return (), None
        if self.stream is not None:
            return take_shard(collate(self.stream.batch(step)), self.dp_index, self.dp, self.device)
        if self.loader is None:
            batch = global_batch(self.model_file, self.global_batch_size, self.seed, step)
            return take_shard(batch, self.dp_index, self.dp, self.device)
        epoch, batch = position(step, self.epoch_steps)
        if step != self._next_step or batch == 0:  # a new epoch, or a start or resume mid-epoch
            self.sampler.set_epoch(epoch)
            self.sampler.start = batch * self.loader.batch_size
            with drawing_freely():  # the loader draws its workers' base seed from its own generator
                self._batches = iter(self.loader)
        inputs, targets = next(self._batches)
        self._next_step = step + 1
        return (tuple(t.to(self.device, non_blocking=True) for t in inputs), targets.to(self.device, non_blocking=True))

    def __iter__(self):
        """Each step's batch of this rank, from step 0 on, without end (a dataset's epochs follow one another)."""
        return (self.take(step) for step in itertools.count())

    def position(self, steps_done: int) -> dict[str, int]:
        """Where the data stands after ``steps_done`` steps, as a checkpoint keeps it."""
        if self.dataset is not None and is_stream(self.dataset):  # its passes' lengths are unknown: steps count
            length, epoch, batch = STREAM, 0, steps_done
        else:
            length = len(self.dataset) if self.dataset is not None else EXAMPLE_DRAWS
            epoch, batch = position(steps_done, self.epoch_steps) if self.dataset is not None else (0, steps_done)
        return {
            "epoch": epoch,
            "epoch_samples": batch * self.global_batch_size,
            "samples_consumed": steps_done * self.global_batch_size,
            "dataset_length": length,
            "seed": self.seed,
        }

    def check_position(self, saved: dict[str, int], checkpoint: str, steps_done: int) -> None:
        """Refuse to resume from a checkpoint written on other data: another dataset length or seed, or (on a
        dataset, whose position is counted in steps of the global batch) another global batch."""
        here = self.position(0)
        if saved["dataset_length"] != here["dataset_length"]:

            def what(n: int) -> str:
                return {EXAMPLE_DRAWS: "example_batch draws", STREAM: "a stream (an iterable dataset)"}.get(
                    n, f"a dataset of {n} samples"
                )

            raise _same_everywhere(
                f"checkpoint {checkpoint} was written training on {what(saved['dataset_length'])}, "
                f"this run reads {what(here['dataset_length'])}; fix: resume with the data it "
                f"was written with, or give this run another --checkpoint-dir"
            )
        if saved["seed"] != here["seed"]:
            raise _same_everywhere(
                f"checkpoint {checkpoint} was written with --seed {saved['seed']}, this run has "
                f"--seed {here['seed']}, which orders the samples differently; fix: resume with "
                f"--seed {saved['seed']}, or give this run another --checkpoint-dir"
            )
        written = saved["samples_consumed"] // max(steps_done, 1)
        if self.dataset is not None and steps_done and written != self.global_batch_size:
            raise _same_everywhere(
                f"checkpoint {checkpoint} was written with a global batch of {written}, this plan's "
                f"is {self.global_batch_size}, so step {steps_done} is elsewhere in the dataset; "
                f"fix: resume with a plan of global batch {written}, or give this run another "
                f"--checkpoint-dir"
            )


def _fork(workers: int) -> str | None:
    """Workers forked where the platform can: a model file's dataset lives in a module imported under a name
    of autoshard's (``modelfile``), which a spawned or forkserver worker could not import to unpickle it."""
    import multiprocessing

    return "fork" if workers > 0 and "fork" in multiprocessing.get_all_start_methods() else None


def _same_everywhere(message: str) -> AutoshardError:
    exc = AutoshardError(message)
    exc.same_on_every_rank = True  # every rank finds it: rank 0 says it (faults.guard)
    return exc
