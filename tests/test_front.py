"""Capture ahead (``passes.capturing.front``): a fresh ``autoshard plan`` captures the model in a forked child.

The test process has torch imported, so the child is never used in-process here; every case runs
the command in a fresh interpreter, as a user does, and compares it with the same command where
``AUTOSHARD_CAPTURE_AHEAD=0`` keeps the capture in the main process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GPT = "examples/gpt.py:build"
LOCAL = ["--cluster", "local-cpu", "--devices-per-node", "2", "--global-batch", "8"]


def autoshard(*argv: str, cache: Path, ahead: bool = True) -> subprocess.CompletedProcess:
    """The command as users run it (``cli.entry``: it ends without Python's teardown, so its output
    must be flushed by hand; buffered here, as on a terminal that is not a tty)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env.update(AUTOSHARD_CACHE_DIR=str(cache), AUTOSHARD_CAPTURE_AHEAD="1" if ahead else "0")
    return subprocess.run(
        [sys.executable, "-m", "autoshard.cli", *argv], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
    )


def python(code: str, cache: Path, ahead: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, AUTOSHARD_CACHE_DIR=str(cache), AUTOSHARD_CAPTURE_AHEAD="1" if ahead else "0")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
    )


def test_the_childs_plan_is_byte_identical_to_one_captured_in_process(tmp_path):
    for ahead in (True, False):
        proc = autoshard(
            "plan",
            GPT,
            *LOCAL,
            "--no-cache",
            "-o",
            str(tmp_path / f"{ahead}.json"),
            cache=tmp_path / "cache",
            ahead=ahead,
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.endswith(f"plan written to {tmp_path / f'{ahead}.json'}\n"), proc.stdout[-500:]
    assert (tmp_path / "True.json").read_bytes() == (tmp_path / "False.json").read_bytes()


@pytest.mark.parametrize("ahead", [True, False])
def test_the_planning_process_imports_torch_only_when_it_captures_itself(tmp_path, ahead):
    proc = python(
        f"""
        import sys
        from autoshard.cli import main
        code = main(["plan", "{GPT}", *{LOCAL!r}, "--no-cache", "--json"])
        print("torch" in sys.modules, code, file=sys.stderr)
    """,
        tmp_path,
        ahead,
    )
    assert proc.stderr.strip().splitlines()[-1] == f"{not ahead} 0", proc.stderr
    assert json.loads(proc.stdout)["decisions"]["mesh"]["dp"] == 2


def test_the_console_script_plans_without_importing_pandas_and_a_later_import_gets_the_real_one(tmp_path):
    """``cli.entry`` imports OR-Tools' cp_model with a stand-in for pandas (0.3-0.45 s of a cold plan's capture
    child); the capture child, its TP proof's CP-SAT and the search run on it, and the real pandas is untouched."""
    proc = python(
        f"""
        import sys
        from autoshard.cli import import_cp_model_without_pandas, main
        import_cp_model_without_pandas()
        code = main(["plan", "{GPT}", *{LOCAL!r}, "--no-cache", "--tp", "2", "--json"])
        held = "pandas" in sys.modules
        import pandas
        from ortools.sat.python import cp_model
        print(held, code, pandas.Series is not cp_model.pd.Series, hasattr(pandas, "DataFrame"), file=sys.stderr)
    """,
        tmp_path,
    )
    assert proc.stderr.strip().splitlines()[-1] == "False 0 True True", proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["decisions"]["mesh"]["tp"] == 2, plan["decisions"]
    assert plan["layout"]["tensor_parallel"]["h.0.attn.q_proj"] == "colwise", plan["layout"]  # the child's proof


def test_the_child_fills_the_capture_cache_and_answers_from_it(tmp_path):
    cache = tmp_path / "cache"
    first = autoshard("plan", GPT, *LOCAL, "-o", str(tmp_path / "first.json"), cache=cache)
    assert first.returncode == 0, first.stderr
    assert len(list(cache.rglob("*.json"))) == 1, "the child wrote the capture cache entry before exiting"
    second = python(
        f"""
        import sys
        import autoshard.passes.capturing.front as front
        from autoshard.cli import main
        answer = front._Child.result

        def result(child):
            graph, passes = answer(child)
            print(passes, file=sys.stderr)
            return graph, passes

        front._Child.result = result
        code = main(["plan", "{GPT}", *{LOCAL!r}, "-o", "{tmp_path / "second.json"}"])
        print(code, file=sys.stderr)
    """,
        cache,
    )
    assert second.stderr.strip().splitlines()[-2:] == ["['capture (cached)', 'annotate (cached)']", "0"], second.stderr
    assert (tmp_path / "first.json").read_bytes() == (tmp_path / "second.json").read_bytes()


BAD_MODELS = [
    "tests/bad_models/data_dependent.py:build",
    "tests/bad_inputs/syntax_error.py:build",
    "tests/bad_models/wrong_batch.py:build",
    "tests/bad_models/broken.py:not_a_module",
]


@pytest.mark.parametrize("model", BAD_MODELS)
def test_a_capture_error_in_the_child_is_the_same_one_line_exit_2(tmp_path, model):
    ahead, here = (autoshard("plan", model, *LOCAL, "--no-cache", cache=tmp_path, ahead=a) for a in (True, False))
    assert ahead.returncode == here.returncode == 2, ahead.stderr
    assert ahead.stderr == here.stderr and ahead.stderr.startswith("error: ") and ahead.stderr.count("\n") == 1
    assert "Traceback" not in ahead.stderr


def test_debug_shows_the_childs_traceback(tmp_path):
    proc = autoshard(
        "plan", "tests/bad_models/data_dependent.py:build", *LOCAL, "--no-cache", "--debug", cache=tmp_path
    )
    assert proc.returncode != 0
    assert "RemoteTraceback" in proc.stderr and "autoshard/passes/capturing/capture.py" in proc.stderr, proc.stderr[
        -3000:
    ]


def test_a_child_that_exits_is_one_line_naming_its_exit_code(tmp_path):
    proc = autoshard(
        "plan", "tests/bad_models/exits.py:build", *LOCAL, "--no-cache", "-o", str(tmp_path / "p.json"), cache=tmp_path
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "exit code 3" in proc.stderr, proc.stderr
    assert not (tmp_path / "p.json").exists()


def test_a_child_not_taken_is_stopped(tmp_path):
    """A request refused after the child started (bad pins) leaves no capture running."""
    proc = python(
        f"""
        import sys
        import autoshard.passes.capturing.front as front
        try:
            with front.capture_ahead("{GPT}", True, False):
                child = front._ahead[("{GPT}", True, False, None)]  # (spec, fold, cache, seq_len)
                raise ValueError("refused")
        except ValueError:
            pass
        print(child.process.exitcode, "torch" in sys.modules, file=sys.stderr)
    """,
        tmp_path,
    )
    assert proc.stderr.strip().splitlines()[-1] == f"{-signal.SIGKILL} False", proc.stderr


def test_a_pass_is_recorded_when_its_block_ends_and_a_bug_in_it_names_it():
    """``running``: the passes are called directly inside it; it keeps the list of passes done and turns a bug
    into a PassError naming the pass and those before it; a user error passes through unchanged."""
    from autoshard.errors import AutoshardError
    from autoshard.passes.capturing.front import PassError, running

    done: list[str] = []
    with running("blocks", done):
        blocks = ("h.0", "h.1")
    assert blocks and done == ["blocks"]
    with pytest.raises(PassError, match=r"while running pass search after \['blocks'\]: ZeroDivisionError"):
        with running("search", done):
            1 / 0
    with pytest.raises(AutoshardError, match="^no plan fits$"):
        with running("search", done):
            raise AutoshardError("no plan fits")
    assert done == ["blocks"]
