"""Safe loading: a plan is JSON only and never executes code; a model file runs only when the
user names it; checkpoints load weights only (docs/design.md, the bad-input corpus's companion)."""

from __future__ import annotations

import ast
import io
import json
import os
import pickle
import re
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from autoshard.cli import main
from autoshard.errors import AutoshardError
from autoshard.ir.plan import Plan, load_plan
from autoshard.ir.plan_format import flatten
from autoshard.passes.lowering.codegen import emit_program

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "autoshard"

MARKER_MODEL = """
from pathlib import Path
Path({marker!r}).write_text("imported")  # importing this file leaves a mark
import torch.nn as nn
import torch


def build():
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


def example_batch(batch_size):
    return (torch.randn(batch_size, 4),), torch.randn(batch_size, 4)
"""


@pytest.fixture
def marker_plan(in_repo, capsys, tmp_path):
    """A real plan of a model file that writes a marker when imported; the marker is removed after planning."""
    marker = tmp_path / "imported.txt"
    model = tmp_path / "marker_model.py"
    model.write_text(MARKER_MODEL.format(marker=str(marker)))
    plan = tmp_path / "plan.json"
    assert main(["plan", f"{model}:build", "--cluster", "local-cpu", "--global-batch", "8", "-o", str(plan)]) == 0
    capsys.readouterr()
    assert marker.exists()  # `plan` names the model: it runs
    marker.unlink()
    for name in [n for n in list(sys.modules) if n.startswith("autoshard_user_model_")]:
        del sys.modules[name]  # a later import would run the file again
    return plan, marker


def test_inspect_never_runs_the_model_file(marker_plan, capsys):
    plan, marker = marker_plan
    assert main(["inspect", str(plan)]) == 0
    assert load_plan(plan).model["spec"].endswith("marker_model.py:build")
    assert not marker.exists()


def test_plan_json_with_code_in_it_is_only_data(tmp_path):
    """Keys and strings that look like code are read as data: ignored where unknown in a version 1 file,
    refused in one line where unknown in version 2, refused where they reach a program."""
    marker = tmp_path / "ran.txt"
    code = f"__import__('pathlib').Path({str(marker)!r}).write_text('ran')"
    plan = _real_plan_dict()
    plan["review"]["notes"] = [code, "!!python/object/apply:os.system ['true']"]
    loaded = Plan.from_json(json.dumps(plan))
    assert loaded.notes[0] == code
    source = emit_program(loaded)
    compile(source, "train.py", "exec")
    assert code not in source and not marker.exists()
    version_1 = {**flatten(plan), "version": 1, "__reduce__": ["os.system", [f"touch {marker}"]], "py/object": code}
    assert Plan.from_json(json.dumps(version_1)) == loaded
    for section in (None, "decisions", "layout", "review", "provenance"):
        tampered = json.loads(json.dumps(plan))
        (tampered[section] if section else tampered)["__reduce__"] = ["os.system", [f"touch {marker}"]]
        with pytest.raises(AutoshardError, match="unknown key '__reduce__'") as refused:
            Plan.from_json(json.dumps(tampered))
        assert "\n" not in str(refused.value)
    for field, value in (
        (("model", "spec"), f"x.py:build'); {code}; ('"),
        (("layout", "blocks"), [f"h.{{{code}}}.0"]),
        (("model", "tokens_per_sample"), f"1; {code}"),
        (("layout", "tensor_parallel"), {f'h"; {code}; "': "colwise"}),
    ):
        tampered = json.loads(json.dumps(plan))
        target = tampered
        for key in field[:-1]:
            target = target[key]
        target[field[-1]] = value
        with pytest.raises(AutoshardError):
            Plan.from_json(json.dumps(tampered))
    assert not marker.exists()


def test_emitted_program_holds_plan_strings_as_literals():
    plan = Plan.from_json(json.dumps(_real_plan_dict()))
    tree = ast.parse(emit_program(plan))
    constants = {
        t.id: n.value for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)
    }
    assert ast.literal_eval(constants["MODEL"]) == plan.model["spec"]
    assert ast.literal_eval(constants["MODEL_FINGERPRINT"]) == plan.model["hash"]
    assert ast.literal_eval(constants["TOKENS_PER_SAMPLE"]) == plan.model["tokens_per_sample"]


@lru_cache(maxsize=1)
def _real_plan_json() -> str:
    import autoshard

    return autoshard.plan(f"{ROOT / 'examples/gpt.py'}:build", cluster="local-cpu", global_batch=8).to_json()


def _real_plan_dict() -> dict:
    return json.loads(_real_plan_json())


def _autoshard_sources() -> list[tuple[Path, str]]:
    return [(p, p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))]


def test_every_torch_load_is_weights_only():
    calls = [(p, m) for p, text in _autoshard_sources() for m in re.finditer(r"torch\.load\((.*)", text)]
    assert calls, "the grep finds torch.load calls"
    for path, match in calls:
        assert "weights_only=True" in match.group(1), f"{path}: torch.load without weights_only=True"


def test_nothing_else_unpickles_evals_or_loads_yaml_unsafely():
    for path, text in _autoshard_sources():
        rel = path.relative_to(ROOT).as_posix()
        assert not re.search(r"\bpickle\.loads?\(|\bmarshal\.loads?\(|\byaml\.(unsafe_)?load\(|\bshelve\.", text), rel
        assert not re.search(r"(?<![\w.])(eval|exec)\(", text), rel
        if rel != "autoshard/runtime/safe_load.py":
            assert not re.search(r"\bdcp\.load\(|\bcheckpoint\.load_state_dict\(", text), rel


# ---------------------------------------------------------------------------- checkpoints


@pytest.fixture
def one_rank_group():
    """A one-rank gloo process group in this process (DCP needs one), torn down after."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _saved(tmp_path: Path):
    from autoshard.runtime import checkpoint

    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return checkpoint.save(tmp_path / "ckpt", 3, model, optimizer), model


def _fresh():
    model = nn.Linear(4, 4)
    return model, torch.optim.AdamW(model.parameters(), lr=0.5)


def test_checkpoint_round_trip_with_the_safe_loader(one_rank_group, tmp_path):
    from autoshard.runtime import checkpoint

    path, model = _saved(tmp_path)
    fresh, optimizer = _fresh()
    assert checkpoint.load(path, fresh, optimizer) == 3
    assert torch.equal(fresh.weight, model.weight) and optimizer.param_groups[0]["lr"] == 0.01


def test_checkpoint_metadata_that_would_run_code_is_refused(one_rank_group, tmp_path):
    from autoshard.runtime import checkpoint

    path, _ = _saved(tmp_path)
    marker = tmp_path / "ran"
    (path / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    with pytest.raises(AutoshardError, match=r"not a checkpoint autoshard wrote \(global posix\.system") as info:
        checkpoint.load(path, *_fresh())
    assert "\n" not in str(info.value) and "--checkpoint-dir" in str(info.value)
    assert not marker.exists()


def test_checkpoint_value_that_would_run_code_is_refused(one_rank_group, tmp_path):
    """A non-tensor value (AdamW's lr) replaced by a pickle that runs code: weights_only refuses it."""
    from autoshard.runtime import checkpoint

    path, _ = _saved(tmp_path)
    marker = tmp_path / "ran"
    metadata = pickle.loads((path / ".metadata").read_bytes())  # the test's own file: trusted here
    info = next(v for k, v in metadata.storage_data.items() if k.fqn.endswith("param_groups.weight.lr"))
    data = path / "__0_0.distcp"
    evil = io.BytesIO()
    torch.save(_Evil(marker), evil)
    info.offset, info.length = data.stat().st_size, len(evil.getvalue())
    data.write_bytes(data.read_bytes() + evil.getvalue())
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(AutoshardError, match=r"refused \(it names posix\.system"):
        checkpoint.load(path, *_fresh())
    assert not marker.exists()


def test_a_save_and_a_resume_each_say_so_in_one_line(one_rank_group, tmp_path, capsys):
    from autoshard.runtime import checkpoint

    path, _ = _saved(tmp_path)
    saved = capsys.readouterr().out.splitlines()
    assert len(saved) == 1 and saved[0].startswith(f"saved checkpoint {path} after step 3 (")
    fresh, optimizer = _fresh()
    assert checkpoint.resume(tmp_path / "ckpt", fresh, optimizer) == 3
    assert capsys.readouterr().out.splitlines() == [
        f"resumed from checkpoint {path} (3 steps done): training goes on at step 3"
    ]
