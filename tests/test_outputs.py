"""Outputs and the files a plan names: a plan is data (its model file is checked by content before it is
imported), temporaries are unique and never followed, no output is an input, flags are checked before launch.

Every bad case exits 2 with one line on stderr and no traceback, and leaves every file of the working
folder as it was (bytes and modification time) with nothing added.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from autoshard.cli import main
from autoshard.errors import AutoshardError
from autoshard.ir import plan as plan_io

ROOT = Path(__file__).resolve().parent.parent
LOCAL = ["--cluster", "local-cpu", "--devices-per-node", "2", "--global-batch", "8"]
MARKER = "IMPORTED"  # evil.py creates this file when it is imported


def _model_source() -> str:
    """tests/models/mlp.py, also importing a module of its own folder (helper.py)."""
    text = (ROOT / "tests/models/mlp.py").read_text()
    return text.replace("import torch\n", "import torch\nfrom helper import SCALE  # noqa: F401\n", 1)


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """A folder with a model file, the module it imports, a cluster file, a plan of the model and
    files a tampered plan could point at."""
    folder = tmp_path_factory.mktemp("planned")
    (folder / "model.py").write_text(_model_source())
    (folder / "helper.py").write_text("SCALE = 1.0\n")
    shutil.copy(ROOT / "examples/cluster.yaml", folder / "cluster.yaml")
    (folder / "evil.py").write_text(
        f"open({MARKER!r}, 'w').write('code in a plan ran')\ndef build():\n    raise SystemExit('never')\n"
    )
    (folder / "notes.txt").write_text("not python\n")
    (folder / "package.py").mkdir()
    (folder / "package.py" / "model.py").write_text("")
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        assert main(["plan", "model.py:build", *LOCAL, "-o", "plan.json"]) == 0
    finally:
        os.chdir(cwd)
    data = json.loads((folder / "plan.json").read_text())
    for name, edit in (
        ("evil", {"spec": "evil.py:build"}),
        ("text", {"spec": "notes.txt:build"}),
        ("folder", {"spec": "package.py:build"}),
        ("old", {"file_sha256": None}),
        ("badsha", {"file_sha256": "12ab"}),
    ):
        changed = json.loads(json.dumps(data))
        changed["model"].update(edit)
        if changed["model"]["file_sha256"] is None:
            del changed["model"]["file_sha256"]
        (folder / f"{name}.json").write_text(json.dumps(changed))
    return folder


@pytest.fixture
def work(planned, tmp_path, monkeypatch):
    """A fresh copy of ``planned`` as the current folder."""
    folder = tmp_path / "work"
    shutil.copytree(planned, folder)
    monkeypatch.chdir(folder)
    monkeypatch.delitem(sys.modules, "helper", raising=False)  # imported again from this folder
    return folder


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def run_cli(capsys, argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_refused(capsys, folder: Path, argv: list[str], message: str) -> str:
    """exit 2, one line naming the problem, no traceback, every file as it was and nothing new."""
    before = snapshot(folder)
    code, out, err = run_cli(capsys, argv)
    assert code == 2, (code, out, err)
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert "Traceback" not in out + err
    assert snapshot(folder) == before, "a refused command created or changed a file"
    assert not (folder / MARKER).exists(), "the plan made autoshard import a file it names"
    return err


# ---------------------------------------------------------------------------- the corpus

SECURITY = [  # a plan is data: the file its model.spec names is checked before anything imports it
    (["compile", "evil.json", "-o", "train.py"], "model file 'evil.py' is not the model this plan was made for"),
    (["run", "evil.json", "--steps", "1"], "its sha256 is"),
    (["verify", "evil.json", "--steps", "1"], "nothing was imported"),
    (["compile", "text.json", "-o", "train.py"], "model file 'notes.txt' is not a Python file"),
    (["run", "text.json", "--steps", "1"], "model file 'notes.txt' is not a Python file"),
    (["verify", "text.json", "--steps", "1"], "model file 'notes.txt' is not a Python file"),
    (["compile", "folder.json", "-o", "train.py"], "model file 'package.py' is a folder"),
    (["compile", "old.json", "-o", "train.py"], "does not record the content hash of its model file 'model.py'"),
    (["run", "old.json", "--steps", "1"], "re-plan it with `autoshard plan model.py:build ...`"),
    (["verify", "old.json", "--steps", "1"], "cannot be checked before it is imported"),
    (["inspect", "badsha.json"], "plan field 'model.file_sha256' must be 64 lowercase hexadecimal digits"),
    (["compile", "badsha.json", "-o", "train.py"], "model.file_sha256"),
]

FILES = [  # no output is one of the command's inputs or a module the model imports
    (["plan", "model.py:build", *LOCAL, "-o", "model.py"], "is this command's model file"),
    (
        ["plan", "model.py:build", "--cluster", "cluster.yaml", "--global-batch", "8", "-o", "cluster.yaml"],
        "is this command's cluster file",
    ),
    (["plan", "model.py:build", *LOCAL, "-o", "helper.py"], "is an existing Python file and a plan is JSON"),
    (
        [
            "estimate",
            "model.py:build",
            *LOCAL,
            "--dp",
            "2",
            "--tp",
            "1",
            "--pp",
            "1",
            "--zero",
            "0",
            "--microbatch-size",
            "4",
            "--recompute",
            "none",
            "-o",
            "model.py",
        ],
        "is this command's model file",
    ),
    (["plan", "model.py:build", *LOCAL, "-o", "package.py"], "output 'package.py' is a folder"),
    (["compile", "plan.json", "-o", "helper.py"], "is the module 'helper' that the model imports"),
    (["run", "plan.json", "--program", "helper.py", "--steps", "1"], "is the module 'helper' that the model imports"),
    (["compile", "plan.json", "-o", "package.py"], "output 'package.py' is a folder"),
    (["compile", "plan.json", "-o", "notes.py"], "'notes.sbatch' exists and autoshard did not write it"),
    (["compile", "plan.json", "-o", "job.py"], "output 'job.sbatch' is a folder"),
    (
        ["run", "plan.json", "--metrics-out", "notes.txt", "--steps", "1"],
        "--metrics-out 'notes.txt' is an existing file",
    ),
    (
        ["run", "plan.json", "--checkpoint-dir", "notes.txt", "--steps", "1"],
        "--checkpoint-dir 'notes.txt' is an existing file",
    ),
    (["run", "plan.json", "--metrics-out", "notes.txt/out", "--steps", "1"], "cannot be created"),
    (["run", "plan.json", "--max-restarts", "1"], "without --checkpoint-dir would restart from step 0"),
    (["run", "notes.json", "--steps", "1"], "'notes.train.py' exists and autoshard did not write it"),
    (["calibrate", "-o", "cluster.yaml", "--across-nodes", "cluster.yaml"], "is this command's --across-nodes file"),
    (["plan", "reads_config.py:build", *LOCAL, "-o", "config.json"], "is a file the model read while it was built"),
]

FLAGS = [  # checked before anything is launched
    (["run", "plan.json", "--steps", "-5"], "--steps -5 must be an integer from 1"),
    (["run", "plan.json", "--steps", "0"], "--steps 0 must be an integer from 1"),
    (["run", "plan.json", "--steps", "ten"], "'ten' is not an integer; e.g. --steps 20"),
    (["run", "plan.json", "--checkpoint-every", "0"], "--checkpoint-every 0 must be an integer from 1"),
    (["run", "plan.json", "--timeout-s", "0"], "--timeout-s 0 must be an integer from 1"),
    (["run", "plan.json", "--timeout-s", "99999999999"], "--timeout-s 99999999999 must be an integer from 1"),
    (["run", "plan.json", "--max-restarts", "-1"], "--max-restarts -1 must be an integer from 0"),
    (["run", "plan.json", "--elastic", "3:2", "--checkpoint-dir", "ckpt"], "--elastic '3:2' must be MIN:MAX"),
    (["run", "plan.json", "--elastic", "1:2"], "without --checkpoint-dir would re-plan and start again from step 0"),
    (["run", "plan.json", "--elastic", "3:4", "--checkpoint-dir", "ckpt"], "runs on 2 ranks, outside --elastic 3:4"),
    (["run", "plan.json", "--seed", "-1"], "--seed -1 must be an integer >= 0"),
    (["run", "plan.json", "--seed", str(2**64)], f"--seed {2**64} must be an integer >= 0"),
    (["verify", "plan.json", "--steps", "0"], "--steps 0 must be an integer from 1"),
    (["verify", "plan.json", "--seed", "-3"], "--seed -3 must be an integer >= 0"),
]

MESSAGES = [  # said as what they are
    (["plan", "needs_argument.py:build", *LOCAL, "-o", "p.json"], "the factory build() needs the argument(s) width"),
    (["plan", "package.py:build", *LOCAL, "-o", "p.json"], "model file 'package.py' is a folder, not a file"),
    (["plan", "notes.txt:build", *LOCAL, "-o", "p.json"], "model file 'notes.txt' is not a Python file"),
    (["inspect", "mesh_key.json"], "plan field 'decisions.mesh' has an unknown key 'sp'"),
    (["compile", "mesh_key.json", "-o", "train.py"], "a mesh has only dp, tp, pp and cp"),
    (["inspect", "alt_mesh_key.json"], "plan field 'review.alternatives[0].mesh' has an unknown key 'ep'"),
    (["inspect", "memory_key.json"], "plan field 'predicted.memory' has an unknown key 'vram'"),
]

CASES = SECURITY + FILES + FLAGS + MESSAGES


def _prepare(folder: Path) -> None:
    """Inputs some cases need beside the plan."""
    (folder / "notes.sbatch").write_text("#!/bin/bash\n# my own job script\n")
    (folder / "notes.py").write_text("# my notes\n")
    shutil.copy(folder / "plan.json", folder / "notes.json")
    (folder / "notes.train.py").write_text("# my own training script\n")
    (folder / "job.sbatch").mkdir()
    (folder / "config.json").write_text('{"width": 8}\n')
    (folder / "reads_config.py").write_text(
        "import json\nfrom pathlib import Path\n\nimport torch\nimport torch.nn as nn\n\n\ndef build():\n"
        "    width = json.loads(Path(__file__).with_name('config.json').read_text())['width']\n"
        "    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(3)])\n\n\n"
        "def example_batch(batch_size):\n    return (torch.randn(batch_size, 8),), torch.randn(batch_size, 8)\n"
    )
    (folder / "needs_argument.py").write_text(
        "import torch\n\ndef build(width):\n    return torch.nn.Linear(width, width)\n\n"
        "def example_batch(batch_size):\n    return (torch.randn(batch_size, 4),), torch.randn(batch_size, 4)\n"
    )
    data = json.loads((folder / "plan.json").read_text())
    for name, edit in (
        ("mesh_key", lambda d: d["decisions"]["mesh"].update(sp=2)),
        ("alt_mesh_key", lambda d: [a["mesh"].update(ep=2) for a in d["review"]["alternatives"]]),
        ("memory_key", lambda d: d["predicted"]["memory"].update(vram=1)),
    ):
        changed = json.loads(json.dumps(data))
        edit(changed)
        (folder / f"{name}.json").write_text(json.dumps(changed))


def _id(argv: list[str]) -> str:
    return " ".join(argv[:2] + [a for a in argv[2:] if a.startswith("--") or a == "-o"][-1:] + argv[-1:])


@pytest.mark.parametrize("argv, message", CASES, ids=[_id(a) for a, _ in CASES])
def test_refused_in_one_line_and_nothing_changes(capsys, work, argv, message):
    _prepare(work)
    assert_refused(capsys, work, argv, message)


def test_the_plan_has_alternatives_to_tamper_with(planned):
    """alt_mesh_key.json above edits every alternative's mesh: there must be some."""
    assert json.loads((planned / "plan.json").read_text())["review"]["alternatives"]


# ---------------------------------------------------------------------------- the plan's model file


def test_plan_records_the_model_file_hash(planned):
    data = json.loads((planned / "plan.json").read_text())
    assert data["model"]["file_sha256"] == plan_io.file_sha256(planned / "model.py")


def test_an_older_plan_without_the_hash_still_loads(capsys, work):
    """inspect and diff read it (they import nothing); compile, run and verify refuse it (corpus above)."""
    assert run_cli(capsys, ["inspect", "old.json"])[0] == 0
    assert run_cli(capsys, ["diff", "old.json", "plan.json"])[0] == 0


def test_an_edited_model_file_is_refused_before_it_is_imported(capsys, work):
    """A byte added to the model file: refused on its hash, so code added to it never runs."""
    model = work / "model.py"
    model.write_text(model.read_text() + f"\nopen({MARKER!r}, 'w').write('ran')\n")
    assert_refused(
        capsys,
        work,
        ["compile", "plan.json", "-o", "train.py"],
        "model file 'model.py' is not the model this plan was made for",
    )


# ---------------------------------------------------------------------------- temporaries


def test_a_symlink_at_the_old_temporary_name_is_not_followed(capsys, work, tmp_path):
    """plan -o, compile (program and SLURM script) and the metrics writer each go through a fresh
    temporary: links planted at the names they once used leave their targets alone."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    for name in (".p.json.tmp", ".train.py.tmp", ".train.sbatch.tmp"):
        (work / name).symlink_to(victim)
    assert run_cli(capsys, ["plan", "model.py:build", *LOCAL, "-o", "p.json"])[0] == 0
    assert run_cli(capsys, ["compile", "p.json", "-o", "train.py"])[0] == 0
    assert victim.read_text() == "precious\n"
    assert (work / "p.json").read_text().startswith("{") and (work / "train.sbatch").exists()
    assert not [p for p in work.iterdir() if p.name.endswith(".tmp") and not p.is_symlink()]


def test_metrics_files_never_follow_a_planted_link(tmp_path):
    pytest.importorskip("torch")
    from autoshard.runtime.report import StepLog, _write_metrics

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "metrics"
    out.mkdir()
    (out / "metrics.json.tmp").symlink_to(victim)
    log = StepLog(tokens_per_step=8, is_main=False, losses=[1.0, 0.5], step_times_s=[0.1, 0.2])
    _write_metrics(out, log)
    assert victim.read_text() == "precious\n"
    assert json.loads((out / "metrics.json").read_text())["losses"] == [1.0, 0.5]
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json", "metrics.json.tmp"]


def test_a_failed_writer_leaves_the_target_and_no_temporary(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")

    def fails(f):
        f.write(b"half")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        plan_io.write_atomic(target, fails)
    assert target.read_bytes() == b"old" and sorted(tmp_path.iterdir()) == [target]


def test_outputs_of_one_command_are_written_all_or_nothing(tmp_path, monkeypatch):
    """The second rename fails: the first file is put back as it was, and no temporary stays."""
    first, second = tmp_path / "job.py", tmp_path / "job.sbatch"
    first.write_text("# my earlier program\n")
    second.write_text("# my earlier script\n")
    real_replace, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if Path(dst) == second:
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(plan_io.os, "replace", replace)
    with pytest.raises(AutoshardError, match="cannot write .*job.sbatch"):
        plan_io.write_files_atomic({first: b"new program", second: b"new script"})
    monkeypatch.setattr(plan_io.os, "replace", real_replace)
    assert first.read_text() == "# my earlier program\n" and second.read_text() == "# my earlier script\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.py", "job.sbatch"]  # no temporary, no backup
    plan_io.write_files_atomic({first: b"new program", second: b"new script"})
    assert first.read_bytes() == b"new program" and second.read_bytes() == b"new script"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.py", "job.sbatch"]


def test_a_new_file_gets_the_usual_mode_and_a_replaced_one_keeps_its_own(tmp_path):
    fresh, kept = tmp_path / "fresh.json", tmp_path / "kept.json"
    kept.write_text("x")
    kept.chmod(0o640)
    plan_io.write_text_atomic(fresh, "{}")
    plan_io.write_text_atomic(kept, "{}")
    umask = os.umask(0o022)
    os.umask(umask)
    assert fresh.stat().st_mode & 0o777 == 0o666 & ~umask
    assert kept.stat().st_mode & 0o777 == 0o640


# ---------------------------------------------------------------------------- compile's two files


def test_compile_replaces_its_own_slurm_script_and_others_only_with_force(capsys, work):
    assert run_cli(capsys, ["compile", "plan.json", "-o", "train.py"])[0] == 0
    code, out, _ = run_cli(capsys, ["compile", "plan.json", "-o", "train.py"])  # its own: replaced, and said so
    assert code == 0 and "train.sbatch (replaced)" in out
    (work / "mine.sbatch").write_text("# my job\n")
    assert run_cli(capsys, ["compile", "plan.json", "-o", "mine.py"])[0] == 2
    assert not (work / "mine.py").exists()
    assert run_cli(capsys, ["compile", "plan.json", "-o", "mine.py", "--force"])[0] == 0
    assert "emitted by autoshard" in (work / "mine.sbatch").read_text()


def test_counts_match_tests_readme():
    assert (len(SECURITY), len(FILES), len(FLAGS), len(MESSAGES)) == (12, 17, 14, 7)
