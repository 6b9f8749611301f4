"""Programs that train on a dataset train like one process on the same samples, and resume where they stopped.

Two ``autoshard verify --data`` cases, jobs of the session's one 4-rank torchrun launch
(``one_launch.verify_cases``): the model file's ``dataset`` (examples/gpt_austen.py, the book as bytes) at
dp 2 x pp 2, where both pipeline ranks of a dp index read its samples, and a ``--data`` token file of the
same bytes at dp 2 x cp 2, where both cp ranks of a dp index read its samples and cut their tokens. The
one-process reference trains on the global batches ``runtime.data.dataset_global_batch`` rebuilds from the
DistributedSampler's order. The pipeline case's verify run also saves a checkpoint after step 2, and a
second run resumes from a copy of it: its last step, its learning rate (a warmup-cosine recipe: the schedule
goes on from the checkpoint's position) and final weights are the uninterrupted run's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import autoshard
from autoshard.ir.recipe import Recipe
from autoshard.runtime.checkpoint import saved_data_keys
from autoshard.runtime.data import DataSource
from autoshard.runtime.report import read_weights
from e2e.one_launch import Cases, job, verify_cases

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
BOOK = ROOT / "examples" / "data" / "northanger_abbey.txt"
STEPS = 3
CASES = {  # name: (model, pins)
    "austen-dp2-pp2": (
        "examples/gpt_austen.py:build",
        dict(dp=2, pp=2, tp=1, zero=0, schedule="1f1b", microbatch_size=2),
    ),
    "tokens-dp2-cp2": ("examples/gpt.py:build", dict(dp=2, cp=2, tp=1, pp=1, zero=3, microbatch_size=2)),
}
RESUMED = "austen-dp2-pp2"  # its verify run saves a checkpoint after step 2; another run resumes a copy
# the resumed case's recipe: rates lr/2, lr, 0.1 lr; a schedule restarted on resume would give step 2 lr/2
RECIPES = {RESUMED: Recipe(schedule="cosine", warmup_steps=2, min_lr_ratio=0.1)}


def _plan(name):
    model, pins = CASES[name]
    return autoshard.plan(model, cluster="local-cpu", devices_per_node=4, global_batch=8, recompute="none", **pins)


def _data(name, folder: Path) -> DataSource:
    if name != "tokens-dp2-cp2":
        return DataSource()  # the model file's dataset
    folder.mkdir(parents=True, exist_ok=True)
    np.frombuffer(BOOK.read_bytes(), dtype=np.uint8).astype(np.uint16).tofile(folder / "book.bin")
    return DataSource(str(folder / "book.bin"))


prepare_verify, finish_verify = verify_cases(_plan, lambda name: STEPS, data_of=_data, recipe_of=RECIPES.get)


def _prepare(names, ranks, folder):
    made = prepare_verify(names, ranks, folder)
    if RESUMED in made and not isinstance(made[RESUMED], Exception):
        jobs, state = made[RESUMED]
        full = jobs[0]
        ckpt, stopped, out = folder / RESUMED / "ckpt", folder / RESUMED / "stopped", folder / RESUMED / "resumed"
        full["args"] += ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"]
        swap = {full["out"]: str(out), str(ckpt): str(stopped)}  # the same command line, another folder each
        resumed_args = [swap.get(arg, arg) for arg in full["args"]]
        made[RESUMED] = (
            [full, job(full["program"], resumed_args, out, copy=(ckpt / "step-00000002", stopped / "step-00000002"))],
            (state, folder / RESUMED),
        )
    return made


def _finish(name, state, failures):
    if name != RESUMED:
        return finish_verify(name, state, failures), None
    state, folder = state
    return finish_verify(name, state, failures[:1]), (folder, failures[1])


LAUNCHES = Cases(dict.fromkeys(CASES, 4), _prepare, _finish, case_of=lambda test, params: list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_a_dataset_run_trains_like_one_process_on_the_same_samples(launches, name):
    (plan, report), _ = launches.result(LAUNCHES, name)
    assert (plan.mesh.dp, plan.mesh.pp, plan.mesh.cp) == {"austen-dp2-pp2": (2, 2, 1), "tokens-dp2-cp2": (2, 1, 2)}[
        name
    ]
    assert report.ok, report.failure
    assert any("both train on" in note for note in report.notes), report.notes
    assert report.parallel_losses[-1] < report.parallel_losses[0]  # it trains


def test_a_run_resumed_mid_epoch_reads_what_an_uninterrupted_one_reads(launches):
    (plan, report), (folder, failure) = launches.result(LAUNCHES, RESUMED)
    assert not failure, failure[-4000:]
    assert saved_data_keys(folder / "ckpt" / "step-00000002") == [
        "dataset_length",
        "epoch",
        "epoch_samples",
        "samples_consumed",
        "seed",
    ]
    resumed, uninterrupted = (json.loads((folder / run / "metrics.json").read_text()) for run in ("resumed", "metrics"))
    assert resumed["losses"] == report.parallel_losses[2:]  # step 3 only, on step 3's samples
    assert uninterrupted["lrs"] == pytest.approx([5e-4, 1e-3, 1e-4]) and resumed["lrs"] == uninterrupted["lrs"][2:]
    full, resumed = read_weights(folder / "metrics"), read_weights(folder / "resumed")
    assert all(torch.equal(resumed[name], value) for name, value in full.items())
