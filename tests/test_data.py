"""What programs train on (runtime.data), in one process: token files, the per-rank loader against the global
batch one process rebuilds, resuming mid-epoch, the checks that refuse a dataset unlike example_batch."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from autoshard.cli import main
from autoshard.errors import AutoshardError
from autoshard.runtime.data import (
    DataSource,
    RankBatches,
    TokenFile,
    global_batches,
    open_dataset,
    steps_per_epoch,
    take_shard,
)
from autoshard.runtime.model import load_model_file

ROOT = Path(__file__).resolve().parent.parent
GPT = "examples/gpt.py:build"
CPU = torch.device("cpu")


class OneAxisMesh:
    """The two things RankBatches reads of a DeviceMesh: the size of the data axis and this rank's place on it."""

    def __init__(self, dp: int, rank: int):
        self.dp, self.rank = dp, rank

    def __getitem__(self, axis):
        return type("Dim", (), {"size": lambda _: self.dp})()

    def get_local_rank(self, axis) -> int:
        return self.rank


def token_file(folder: Path, tokens, dtype=np.uint16, name: str = "tokens.bin") -> Path:
    path = folder / name
    np.asarray(tokens, dtype=dtype).tofile(path)
    return path


@pytest.fixture(scope="module")
def gpt():
    return load_model_file(GPT)


def test_token_file_windows_are_the_next_tokens(tmp_path):
    tokens = (np.arange(1000) * 7) % 251
    dataset = TokenFile(token_file(tmp_path, tokens), tokens_per_sample=16)
    assert len(dataset) == (1000 - 1) // 16 == 62
    (inputs,), target = dataset[5]
    assert inputs.dtype == target.dtype == torch.int64
    assert inputs.tolist() == tokens[80:96].tolist() and target.tolist() == tokens[81:97].tolist()
    (last,), last_target = dataset[61]
    assert last_target[-1] == tokens[61 * 16 + 16]  # the last window's target ends inside the file
    int32 = TokenFile(token_file(tmp_path, tokens, np.int32, "t32.bin"), 16, "int32")
    assert torch.equal(int32[5][0][0], inputs) and int32.max_token() == 250


@pytest.mark.parametrize("dp, workers", [(2, 0), (4, 0), (2, 1)])
def test_each_rank_reads_its_slice_of_the_global_batch_one_process_rebuilds(gpt, tmp_path, dp, workers):
    """Rank r's DataLoader batch at step k is take_shard(global batch of step k, r, dp), across an epoch's end."""
    path = token_file(tmp_path, np.random.default_rng(0).integers(0, 256, 64 * 40 + 1))
    source, batch_size, seed = DataSource(str(path)), 8, 3
    dataset = open_dataset(gpt, source, 64)
    epoch = steps_per_epoch(len(dataset), batch_size, dp)
    assert epoch == (40 // dp) // (8 // dp)
    reference = global_batches(gpt, source, batch_size, seed, 64, dp)
    steps = range(epoch + 2)  # into the second epoch
    whole = [reference(step) for step in steps]
    seen = []
    for rank in range(dp):
        batches = RankBatches(gpt, source, batch_size, 64, OneAxisMesh(dp, rank), "dp", CPU, seed, workers=workers)
        for step in steps:
            (x,), y = batches.take(step)
            (want_x,), want_y = take_shard(whole[step], rank, dp, CPU)
            assert torch.equal(x, want_x) and torch.equal(y, want_y), (rank, step)
            seen += [tuple(row.tolist()) for row in x] if step < epoch else []
    assert len(set(seen)) == len(seen) == epoch * batch_size  # one epoch: no sample twice
    assert not torch.equal(whole[0][1], whole[epoch][1])  # the next epoch is shuffled anew


def test_a_resumed_rank_reads_what_an_uninterrupted_one_reads(gpt, tmp_path):
    path = token_file(tmp_path, np.random.default_rng(1).integers(0, 256, 64 * 24 + 1))
    source, mesh = DataSource(str(path)), OneAxisMesh(2, 1)
    straight = RankBatches(gpt, source, 4, 64, mesh, "dp", CPU, seed=5, workers=0)
    epoch = straight.epoch_steps
    assert epoch == 6
    run = [straight.take(step)[1] for step in range(2 * epoch)]
    for start in (3, epoch, epoch + 4):  # mid-epoch, at an epoch's start, mid-second-epoch
        resumed = RankBatches(gpt, source, 4, 64, mesh, "dp", CPU, seed=5, workers=0)
        assert all(torch.equal(resumed.take(step)[1], run[step]) for step in range(start, 2 * epoch)), start
    position = straight.position(epoch + 4)
    assert position == {"epoch": 1, "epoch_samples": 16, "samples_consumed": 40, "dataset_length": 24, "seed": 5}
    straight.check_position(position, "ckpt/step-00000010", epoch + 4)
    with pytest.raises(AutoshardError, match="--seed 6, this run has --seed 5"):
        straight.check_position({**position, "seed": 6}, "ckpt/step-00000010", epoch + 4)
    with pytest.raises(AutoshardError, match="a dataset of 30 samples, this run reads a dataset of 24"):
        straight.check_position({**position, "dataset_length": 30}, "ckpt/step-00000010", epoch + 4)
    with pytest.raises(AutoshardError, match="a global batch of 8, this plan's is 4"):
        straight.check_position({**position, "samples_consumed": 80}, "ckpt/step-00000010", epoch + 4)


def test_without_a_dataset_each_rank_draws_example_batch_as_before(gpt):
    from autoshard.runtime.data import global_batch

    batches = RankBatches(gpt, DataSource(), 8, 64, OneAxisMesh(2, 1), "dp", CPU, seed=0)
    assert batches.dataset is None
    (x,), y = batches.take(3)
    (want,), want_y = take_shard(global_batch(gpt, 8, 0, 3), 1, 2, CPU)
    assert torch.equal(x, want) and torch.equal(y, want_y)


def test_a_pipeline_rank_with_neither_end_reads_nothing(gpt, tmp_path, monkeypatch):
    """A rank holding neither the first nor the last pipeline stage (reads=False) makes no loader and reads no
    sample, draws nothing, and keeps the position a reading rank keeps (its checkpoints agree)."""
    import autoshard.runtime.data as data

    path = token_file(tmp_path, np.arange(64 * 12 + 1) % 256)
    reading = RankBatches(gpt, DataSource(str(path)), 4, 64, OneAxisMesh(2, 0), "dp", CPU, seed=1, workers=0)
    reads = []
    original = TokenFile.__getitem__
    monkeypatch.setattr(TokenFile, "__getitem__", lambda self, i: reads.append(i) or original(self, i))
    middle = RankBatches(
        gpt, DataSource(str(path)), 4, 64, OneAxisMesh(2, 0), "dp", CPU, seed=1, workers=0, reads=False
    )
    assert middle.loader is None and middle.take(0) == ((), None) and middle.take(7) == ((), None)
    assert middle.position(7) == reading.position(7) and reads == [0]  # sample 0: the check of its layout only
    monkeypatch.setattr(data, "global_batch", lambda *args: pytest.fail("a middle rank drew example_batch"))
    drawn = RankBatches(gpt, DataSource(), 8, 64, OneAxisMesh(2, 1), "dp", CPU, seed=0, reads=False)
    assert drawn.take(3) == ((), None) and drawn.position(3) == {
        **reading.position(0),
        "dataset_length": 0,
        "samples_consumed": 24,
        "epoch_samples": 24,
        "seed": 0,
    }


class Stream(torch.utils.data.IterableDataset):
    """A stream of n samples of example_batch's layout (64 token ids), sample i holding i everywhere."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return (((torch.full((64,), i),), torch.full((64,), i)) for i in range(self.n))


def test_a_stream_is_read_as_consecutive_global_batches_in_every_rank(gpt, tmp_path):
    """An iterable dataset: step k's global batch is the stream's samples kB..(k+1)B within its pass, the tail of a
    pass dropped and the next epoch iterated anew; each dp rank's batch is its slice, a resumed rank reads what an
    uninterrupted one reads, and the one-process reference (global_batches, what verify trains on) is the same."""
    from autoshard.runtime.data import SampleStream, collate

    stream = Stream(10)  # 2 global batches of 4 per pass, 2 samples dropped
    ids = lambda batch: [int(row[0]) for row in batch[1]]  # noqa: E731
    reference = SampleStream(stream, 4)
    assert [ids(collate(reference.batch(k))) for k in range(5)] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [0, 1, 2, 3],
    ]
    assert reference.epoch == 2 and ids(collate(reference.batch(1))) == [4, 5, 6, 7]  # back: a fresh first pass
    ranks = [
        RankBatches(gpt, DataSource(), 4, 64, OneAxisMesh(2, r), "dp", CPU, seed=0, dataset=stream) for r in range(2)
    ]
    for step in range(4):
        together = [ids(rank.take(step)) for rank in ranks]
        assert together[0] + together[1] == ids(collate(SampleStream(stream, 4).batch(step)))
    resumed = RankBatches(gpt, DataSource(), 4, 64, OneAxisMesh(2, 1), "dp", CPU, seed=0, dataset=stream)
    assert ids(resumed.take(3)) == [6, 7]
    assert ranks[1].position(3) == {
        "epoch": 0,
        "epoch_samples": 12,
        "samples_consumed": 12,
        "dataset_length": -1,
        "seed": 0,
    }
    with pytest.raises(AutoshardError, match="gave 3 samples in a pass, fewer than one global batch of 4"):
        RankBatches(gpt, DataSource(), 4, 64, OneAxisMesh(2, 0), "dp", CPU, seed=0, dataset=Stream(3)).take(0)
    with pytest.raises(AutoshardError, match=r"a generator, an iterator \(its __iter__ returns itself"):
        RankBatches(gpt, DataSource(), 4, 64, OneAxisMesh(2, 0), "dp", CPU, seed=0, dataset=iter(Stream(8)))
    with pytest.raises(AutoshardError, match="yields no sample"):
        RankBatches(gpt, DataSource(), 4, 64, OneAxisMesh(2, 0), "dp", CPU, seed=0, dataset=Stream(0))
    model_file = tmp_path / "streamed.py"
    model_file.write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT / 'examples')!r})\n"
        f"from gpt import build, example_batch, loss_fn\n"
        f"from tests.test_data import Stream\n\ndef dataset(seq_len):\n    return Stream(10)\n"
    )
    batch_of = global_batches(load_model_file(f"{model_file}:build"), DataSource(), 4, 0, 64, dp=2)
    assert [ids(batch_of(k)) for k in (0, 1, 2)] == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]


def test_the_example_model_file_dataset_is_the_book_in_byte_windows():
    austen = load_model_file("examples/gpt_austen.py:build")
    dataset = open_dataset(austen, DataSource(), 64)  # checked against example_batch(1)
    text = (ROOT / "examples" / "data" / "northanger_abbey.txt").read_bytes()
    assert len(dataset) == (len(text) - 1) // 64
    (x,), y = dataset[10]
    assert bytes(x.tolist()) == text[640:704] and bytes(y.tolist()) == text[641:705]


@pytest.fixture
def plan_here(tmp_path):
    shutil.copy(ROOT / "tests" / "golden" / "dp_zero0.plan.json", tmp_path / "plan.json")
    return tmp_path


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: token_file(d, np.arange(300) % 280), "token id 279 is past the model's vocabulary of 256"),
        (lambda d: token_file(d, np.arange(301) + 70_000, np.int32), "token id 4764 is past"),  # int32 read as uint16
        (lambda d: token_file(d, np.arange(30), np.uint16), "fewer than one sample needs (64 + 1)"),
        (lambda d: (d / "odd.bin").write_bytes(b"\0" * 301) and d / "odd.bin", "not a whole number of uint16 tokens"),
        (lambda d: d / "missing.bin", "no such file"),
    ],
)
def test_a_token_file_the_model_cannot_read_is_refused_before_launch(plan_here, capsys, monkeypatch, make, message):
    monkeypatch.chdir(ROOT)
    path = make(plan_here)
    code = main(["run", str(plan_here / "plan.json"), "--program", str(plan_here / "train.py"), "--data", str(path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1, err
    assert "fix" in err and not (plan_here / "train.py").exists()  # nothing launched, no program written


def test_a_model_that_takes_no_token_ids_refuses_a_token_file(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    mlp = load_model_file("tests/models/mlp.py:build")
    with pytest.raises(
        AutoshardError,
        match=r"a sample is \(inputs \(int64 \[64\],\), target int64 \[64\]\) but one "
        r"row of example_batch is \(inputs \(float32",
    ):
        open_dataset(mlp, DataSource(str(token_file(tmp_path, np.arange(200)))), 64)


def test_a_stream_is_told_its_epoch_and_leaves_torchs_draws_alone(gpt):
    """A shuffling stream (set_epoch, drawing from torch's RNG) is told each pass's epoch, and reading it leaves
    torch's RNG state as it was (the training's dropout draws do not depend on the data, resumed or not)."""
    from autoshard.runtime.data import SampleStream

    class Shuffling(Stream):
        epochs: list = []

        def set_epoch(self, epoch: int) -> None:
            self.epochs.append(epoch)

        def __iter__(self):
            torch.rand(3)  # a stream that draws
            return super().__iter__()

    stream = Shuffling(9)  # 2 batches of 4 per pass
    before = torch.random.get_rng_state()
    reader = SampleStream(stream, 4)
    reader.batch(4)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert stream.epochs == [0, 1, 2] and reader.epoch == 2
    assert reader.batch(4) is reader.batch(4)  # the step just read is not read again
