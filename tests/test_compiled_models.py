"""A factory that returns ``torch.compile(model)`` (or compiles its blocks) is planned and run as the module it
compiles (``modelfile._uncompiled``), with a one-line note; its parameters keep the model's own names."""

import json

import pytest

from autoshard import modelfile
from autoshard.cli import main
from autoshard.modelfile import load_model_file

SPEC = "tests/models/compiled_mlp.py"
PLAN = ["--cluster", "local-cpu", "--devices-per-node", "2", "--global-batch", "8", "--no-cache"]


@pytest.fixture
def fresh_notes(monkeypatch):
    """The note is said once per process and model: forget the ones said before this test."""
    monkeypatch.setattr(modelfile, "_COMPILE_NOTED", set())


def test_a_compiled_model_plans_as_the_module_it_compiles(in_repo, fresh_notes, capfd):
    """torch.compile(nn.Sequential(...)): the TP proof stood in for its children through the wrapper and
    crashed (KeyError: "attribute '0' already exists"); now the plan is the Sequential's, at tp=2 too."""
    assert main(["plan", f"{SPEC}:build", *PLAN, "--tp", "2", "--json"]) == 0
    out, err = capfd.readouterr()
    assert "Traceback" not in err and "error" not in err
    assert (
        f"note: {SPEC}:build: the factory returned torch.compile(model); autoshard plans and runs the module "
        f"it compiles (model._orig_mod)"
    ) in err
    assert err.count("note:") == 1
    plan = json.loads(out)
    assert plan["decisions"]["mesh"]["tp"] == 2 and "_orig_mod" not in out


def test_compiled_models_build_with_their_own_names(in_repo, fresh_notes, capfd):
    outer = load_model_file(f"{SPEC}:build").build("meta")
    assert [n for n, _ in outer.named_parameters()] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    blocks = load_model_file(f"{SPEC}:build_blocks").build("meta")
    names = [n for n, _ in blocks.named_parameters()]
    assert names[:2] == ["0.norm.weight", "0.norm.bias"] and not any("_orig_mod" in n for n in names)
    assert type(blocks[0]).__name__ == "ResidualBlock"
    err = capfd.readouterr().err
    assert f"note: {SPEC}:build_blocks: the factory compiles submodules 0, 1 (torch.compile)" in err
