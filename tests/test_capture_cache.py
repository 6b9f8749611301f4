"""passes/capture_cache: a second plan of an unchanged model skips capture and gives the same plan;
any change to the model's files, a damaged entry or the cache turned off means capturing again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from autoshard.cost.hardware import load_cluster
from autoshard.passes import capture_cache
from autoshard.pipeline import CAPTURE_BATCH, PlanRequest, plan_model

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = load_cluster("local-cpu", devices_per_node=2)

MODEL = textwrap.dedent("""
    import torch
    import torch.nn as nn
    from layers import Block          # a file of the user's beside the model file

    def build():
        return nn.Sequential(nn.Linear(8, WIDTH), *[Block(WIDTH) for _ in range(4)], nn.Linear(WIDTH, 8))

    WIDTH = 64

    def example_batch(batch_size):
        return (torch.randn(batch_size, 8),), torch.randn(batch_size, 8)
""")
LAYERS = textwrap.dedent("""
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.fc = nn.Linear(width, width)

        def forward(self, x):
            return x + self.fc(x).relu()
""")


@pytest.fixture
def model(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOSHARD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # else Python's own .pyc check (stat) would hide edits
    (tmp_path / "layers.py").write_text(LAYERS)
    (tmp_path / "model.py").write_text(MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("layers", None)


def plan(spec: str, **kw):
    for name in [n for n in sys.modules if n == "layers" or n.startswith("autoshard_user_model_")]:
        sys.modules.pop(name)  # a fresh process each time, as from the command line
    return plan_model(PlanRequest(spec, CLUSTER, 8, **kw))


def forbid_capture(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("captured although the cache has the model")

    monkeypatch.setattr("autoshard.passes.capture.capture", fail)


def entries(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "cache" / "capture").glob("*.json"))


def test_a_second_plan_reads_the_cache_and_is_byte_identical(model, monkeypatch):
    spec = f"{model}/model.py:build"
    first = plan(spec)
    assert len(entries(model)) == 1
    forbid_capture(monkeypatch)
    second = plan(spec)
    assert second.to_json() == first.to_json()


def test_an_edit_that_keeps_size_and_timestamp_still_captures_again(model):
    spec = f"{model}/model.py:build"
    before = plan(spec)
    model_file = model / "model.py"
    stat = model_file.stat()
    model_file.write_text(MODEL.replace("WIDTH = 64", "WIDTH = 32"))  # same length
    os.utime(model_file, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same timestamp too
    after = plan(spec)
    assert after.model["params"] < before.model["params"]


def test_an_edit_of_an_imported_user_file_captures_again(model):
    spec = f"{model}/model.py:build"
    before = plan(spec)
    (model / "layers.py").write_text(LAYERS.replace("nn.Linear(width, width)", "nn.Linear(width, width, bias=False)"))
    after = plan(spec)
    assert after.model["params"] == before.model["params"] - 4 * 64


def test_off_or_no_cache_writes_nothing(model, monkeypatch):
    spec = f"{model}/model.py:build"
    plan(spec, cache=False)
    assert entries(model) == []
    monkeypatch.setenv("AUTOSHARD_CACHE", "0")
    plan(spec)
    assert entries(model) == []


def test_a_damaged_entry_is_a_miss_and_is_rewritten(model):
    spec = f"{model}/model.py:build"
    first = plan(spec)
    (entry,) = entries(model)
    entry.write_text(entry.read_text()[: len(entry.read_text()) // 2])  # cut short
    assert capture_cache.lookup(spec, CAPTURE_BATCH, True) is None
    assert plan(spec).to_json() == first.to_json()
    assert capture_cache.lookup(spec, CAPTURE_BATCH, True) is not None


def test_the_json_form_carries_a_folded_graph_exactly(model):
    from autoshard.passes.annotate import annotate
    from autoshard.passes.capture import capture
    from autoshard.modelfile import load_model_file

    graph = annotate(capture(load_model_file(str(ROOT / "examples/gpt.py:build")), CAPTURE_BATCH, True))
    assert graph.fold is not None
    again = capture_cache.decode_graph(json.loads(json.dumps(capture_cache.encode_graph(graph))))
    assert again == graph
    assert isinstance(again.nodes[0].shape, tuple) and again.fold == graph.fold


def test_a_cached_plan_never_imports_torch(tmp_path):
    env = dict(os.environ, AUTOSHARD_CACHE_DIR=str(tmp_path))
    spec = str(ROOT / "examples/gpt.py:build")
    script = textwrap.dedent(f"""
        import sys
        import autoshard
        autoshard.plan({spec!r}, cluster="local-cpu", global_batch=8)
        print("torch" in sys.modules)
    """)
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True,
                           cwd=ROOT).stdout.split() for _ in range(2)]
    assert runs == [["True"], ["False"]]
