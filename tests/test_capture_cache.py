"""passes/capturing/capture_cache: a second plan of an unchanged model skips capture and gives the same plan;
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
from autoshard.passes.capturing import capture_cache
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

    monkeypatch.setattr("autoshard.passes.capturing.capture.capture", fail)


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
    from autoshard.modelfile import load_model_file
    from autoshard.passes.capturing.annotate import annotate
    from autoshard.passes.capturing.capture import capture

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
    runs = [
        subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True, cwd=ROOT
        ).stdout.split()
        for _ in range(2)
    ]
    assert runs == [["True"], ["False"]]


# ---------------------------------------------------------------------------- what the model reads

READS_MODEL = textwrap.dedent("""
    import json
    import os
    from pathlib import Path

    import torch
    import torch.nn as nn

    LAYERS = int(os.environ.get("AUTOSHARD_TEST_LAYERS", "2"))
    WIDTH = 32 if "AUTOSHARD_TEST_WIDE" in os.environ else 16
    CONFIG = json.loads((Path(__file__).parent / "config.json").read_text())

    def build():
        layers = LAYERS + CONFIG["extra_layers"]
        return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])

    def example_batch(batch_size):
        return (torch.randn(batch_size, WIDTH),), torch.randn(batch_size, WIDTH)
""")


@pytest.fixture
def reads_model(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOSHARD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("AUTOSHARD_TEST_LAYERS", raising=False)
    monkeypatch.delenv("AUTOSHARD_TEST_WIDE", raising=False)
    (tmp_path / "config.json").write_text('{"extra_layers": 0}')
    (tmp_path / "model.py").write_text(READS_MODEL)
    return f"{tmp_path}/model.py:build"


def test_an_environment_variable_the_model_reads_is_part_of_the_entry(reads_model, monkeypatch):
    monkeypatch.setenv("AUTOSHARD_TEST_LAYERS", "2")
    two = plan(reads_model)
    monkeypatch.setenv("AUTOSHARD_TEST_LAYERS", "3")
    three = plan(reads_model)
    assert three.model["params"] == two.model["params"] * 3 // 2
    monkeypatch.delenv("AUTOSHARD_TEST_LAYERS")  # unset is a value of its own (the default: 2)
    assert plan(reads_model).model["params"] == two.model["params"]


def test_a_variable_only_tested_with_in_is_part_of_the_entry(reads_model, monkeypatch):
    narrow = plan(reads_model)
    monkeypatch.setenv("AUTOSHARD_TEST_WIDE", "")
    wide = plan(reads_model)
    assert wide.model["params"] > narrow.model["params"]


def test_an_edit_of_a_config_file_the_model_opens_captures_again(reads_model, tmp_path):
    before = plan(reads_model)
    config = tmp_path / "config.json"
    st = config.stat()
    config.write_text('{"extra_layers": 1}')  # same size
    os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns))  # same timestamp too
    after = plan(reads_model)
    assert after.model["params"] == before.model["params"] * 3 // 2


def test_nothing_the_model_reads_changed_reads_the_cache(reads_model, monkeypatch):
    monkeypatch.setenv("AUTOSHARD_TEST_LAYERS", "3")
    first = plan(reads_model)
    monkeypatch.setenv("UNRELATED_VARIABLE", "changed")  # the model never reads it
    forbid_capture(monkeypatch)
    assert plan(reads_model).to_json() == first.to_json()


def test_a_model_that_opens_a_device_or_a_vanished_file_is_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOSHARD_CACHE_DIR", str(tmp_path / "cache"))
    opens_device = READS_MODEL.replace(
        'CONFIG = json.loads((Path(__file__).parent / "config.json").read_text())',
        'open(os.devnull).read()\nCONFIG = {"extra_layers": 0}',
    )
    (tmp_path / "device.py").write_text(opens_device)
    plan(f"{tmp_path}/device.py:build")
    assert entries(tmp_path) == []
    (tmp_path / "config.json").write_text('{"extra_layers": 0}')
    vanishes = READS_MODEL.replace("read_text())", 'read_text())\n(Path(__file__).parent / "config.json").unlink()')
    (tmp_path / "vanish.py").write_text(vanishes)
    plan(f"{tmp_path}/vanish.py:build")
    assert entries(tmp_path) == []


def test_a_directory_the_model_lists_is_part_of_the_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOSHARD_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "a").write_text("")
    lists = READS_MODEL.replace(
        'CONFIG = json.loads((Path(__file__).parent / "config.json").read_text())',
        'CONFIG = {"extra_layers": len(os.listdir(Path(__file__).parent / "shards"))}',
    )
    (tmp_path / "lists.py").write_text(lists)
    spec = f"{tmp_path}/lists.py:build"
    one = plan(spec)
    (tmp_path / "shards" / "b").write_text("")
    assert plan(spec).model["params"] == one.model["params"] * 4 // 3


def test_an_other_version_of_an_imported_distribution_is_a_miss():
    entry = {
        "environment": {},
        "whole_environment": None,
        "listings": [],
        "distributions": {"torch": capture_cache._installed_version("torch")},
    }
    assert capture_cache.reads_unchanged(entry)
    entry["distributions"]["torch"] = "0.0.1"
    assert not capture_cache.reads_unchanged(entry)


def test_reads_outside_the_recording_are_not_noted(tmp_path):
    with capture_cache.recording() as reads:
        os.environ.get("AUTOSHARD_TEST_INSIDE")
        (tmp_path / "inside").write_text("x")
        (tmp_path / "inside").read_text()
    os.environ.get("AUTOSHARD_TEST_OUTSIDE")
    (tmp_path / "inside").read_text()
    assert type(os.environ) is os._Environ
    assert reads.env_names == {"AUTOSHARD_TEST_INSIDE"}
    assert reads.files == {str(tmp_path / "inside")}


def test_the_forked_capture_records_what_the_model_reads(tmp_path):
    (tmp_path / "config.json").write_text('{"extra_layers": 0}')
    (tmp_path / "model.py").write_text(READS_MODEL)
    env = dict(os.environ, AUTOSHARD_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("AUTOSHARD_CAPTURE_AHEAD", None)

    def cli_plan(layers: str) -> int:
        out = tmp_path / f"plan{layers}.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "autoshard.cli",
                "plan",
                f"{tmp_path}/model.py:build",
                "--cluster",
                "local-cpu",
                "--global-batch",
                "8",
                "-o",
                str(out),
            ],
            env=dict(env, AUTOSHARD_TEST_LAYERS=layers),
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        return json.loads(out.read_text())["model"]["params"]

    two = cli_plan("2")
    three = cli_plan("3")
    assert three == two * 3 // 2
    (entry,) = entries(tmp_path)
    written = entry.stat().st_mtime_ns
    assert cli_plan("3") == three and entry.stat().st_mtime_ns == written  # served, not captured again


def test_a_model_that_runs_another_program_is_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOSHARD_CACHE_DIR", str(tmp_path / "cache"))
    runs = READS_MODEL.replace(
        'CONFIG = json.loads((Path(__file__).parent / "config.json").read_text())',
        "import subprocess, sys\n"
        'CONFIG = {"extra_layers": int(subprocess.run([sys.executable, "-c", "print(1)"], '
        "capture_output=True, text=True).stdout)}",
    )
    (tmp_path / "runs.py").write_text(runs)
    assert plan(f"{tmp_path}/runs.py:build").model["params"] == 3 * (16 * 16 + 16)
    assert entries(tmp_path) == []


def test_a_plan_proves_only_the_tp_degrees_its_cluster_offers_and_a_later_one_adds_its_own(tmp_path, monkeypatch):
    """The tensor-parallel proof (passes/capturing/tp_proof) runs at the degrees the request's search may take: a
    plan on 2 devices proves tp 2 only; a plan on 4 proves tp 4 from the cached graph (no capture) and writes it
    into the entry; the plans are byte-identical to plans made from a graph proved at every degree."""
    from autoshard.pipeline import capture_graph

    monkeypatch.setenv("AUTOSHARD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(ROOT)
    spec, fast = "examples/gpt.py:build", "tests/clusters/fast_link_cpu.yaml"  # 4 heads: tp 2 and 4
    on = {n: load_cluster(fast, devices_per_node=n) for n in (2, 4)}
    two = plan_model(PlanRequest(spec, on[2], 8, cache=True))
    [entry] = entries(tmp_path)
    assert sorted(capture_cache.decode_graph(json.loads(entry.read_text())["graph"]).tp_proofs) == ["2", "2sp"]
    forbid_capture(monkeypatch)
    four = plan_model(PlanRequest(spec, on[4], 8, cache=True))
    assert sorted(capture_cache.decode_graph(json.loads(entry.read_text())["graph"]).tp_proofs) == [
        "2",
        "2sp",
        "4",
        "4sp",
    ]
    monkeypatch.undo()
    monkeypatch.chdir(ROOT)
    graph = capture_graph(spec)[1]  # every degree, no cache
    assert sorted(graph.tp_proofs) == ["2", "2sp", "4", "4sp"]
    from autoshard.pipeline import plan_graph

    assert plan_graph(PlanRequest(spec, on[2], 8), None, graph).to_json() == two.to_json()
    assert plan_graph(PlanRequest(spec, on[4], 8), None, graph).to_json() == four.to_json()


def test_the_commands_forked_capture_proves_the_degrees_of_the_commands_cluster(tmp_path):
    """``autoshard plan``'s capture starts in a forked child before the planner is imported; it proves the TP
    degrees the command's cluster offers (here pinned tp 2 on 4 devices: tp 2 only), as the plan in-process would."""
    env = dict(os.environ, AUTOSHARD_CACHE_DIR=str(tmp_path / "cache"), AUTOSHARD_CAPTURE_AHEAD="1")
    command = [sys.executable, "-m", "autoshard.cli", "plan", "examples/gpt.py:build", "--cluster", "local-cpu"]
    command += ["--devices-per-node", "4", "--tp", "2", "--global-batch", "8", "-o", str(tmp_path / "p.json")]
    subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True)
    [entry] = entries(tmp_path)
    assert sorted(capture_cache.decode_graph(json.loads(entry.read_text())["graph"]).tp_proofs) == ["2", "2sp"]
