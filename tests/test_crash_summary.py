"""The crashed rank's summary (``autoshard.launch.crash_block``, ``summarize_crash``) from traceback text, without
launching anything: it always names the exception type, the last frame and the model file's line, also for an
exception with an empty message; the rank records which model files it loaded (``runtime.faults``)."""

from __future__ import annotations

import sys
import traceback
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from autoshard.launch import crash_block, parse_traceback, summarize_crash
from autoshard.modelfile import load_model_file
from autoshard.runtime import faults

TORCH = "/venv/lib/python3.11/site-packages/torch/nn/functional.py"
AUTOSHARD = sys.modules["autoshard"].__path__[0] + "/runtime/parallel.py"


def _stack(*frames: tuple[str, int, str, str], exception: str = "RuntimeError") -> str:
    lines = ["Traceback (most recent call last):"]
    for path, line, function, source in frames:
        lines += [f'  File "{path}", line {line}, in {function}', f"    {source}"]
    return "\n".join([*lines, exception]) + "\n"


PROGRAM = ("/job/train.py", 90, "<module>", "runtime.faults.guard(main)")
MAIN = ("/job/train.py", 70, "main", "loss = model(x)")
APPLY = (AUTOSHARD, 40, "apply", "return module(x)")
MODEL = ("/job/my_model.py", 12, "forward", "h = F.linear(x, self.w)")
LINEAR = (TORCH, 3, "linear", "return op()")


def test_an_empty_message_still_names_the_type_the_last_frame_and_the_model_line():
    stack = _stack(PROGRAM, MAIN, APPLY, MODEL, LINEAR)
    lines = summarize_crash(stack, "RuntimeError: ", ["/job/my_model.py"])
    assert lines == [
        "RuntimeError (empty message)",
        "at torch/nn/functional.py:3 in linear: return op()",
        "model file: /job/my_model.py:12 in forward: h = F.linear(x, self.w)",
    ]


def test_the_model_file_is_found_without_the_ranks_list():
    """Not a library, not autoshard, not the program run as a script (its ``<module>`` frame)."""
    stack = _stack(PROGRAM, MAIN, APPLY, MODEL, LINEAR, exception="ValueError: width 3 != 4")
    assert summarize_crash(stack)[0] == "ValueError: width 3 != 4"
    assert summarize_crash(stack)[2] == "model file: /job/my_model.py:12 in forward: h = F.linear(x, self.w)"
    no_model = _stack(PROGRAM, MAIN, APPLY, LINEAR)
    lines = summarize_crash(no_model, model_files=["/job/my_model.py"])  # no model frame: the last one of autoshard
    assert lines[:2] == ["RuntimeError (empty message)", "at torch/nn/functional.py:3 in linear: return op()"]
    assert lines[2].startswith("from ") and lines[2].endswith(
        "autoshard/runtime/parallel.py:40 in apply: return module(x)"
    )


def test_a_frame_in_the_model_file_that_raised_is_the_last_frame_once():
    stack = _stack(PROGRAM, MAIN, ("/job/my_model.py", 12, "forward", "raise RuntimeError()"))
    assert summarize_crash(stack, "RuntimeError: ", ["/job/my_model.py"]) == [
        "RuntimeError (empty message)",
        "at /job/my_model.py:12 in forward: raise RuntimeError()",
    ]


def test_the_model_line_inside_a_pipeline_stage_comes_from_fx_original_traceback():
    """A stage's GraphModule runs the model's code, not its file: torch.fx quotes the model's line in the message."""
    exception = (
        "RuntimeError: \n\nWhile executing %linear : call_function[target=aten.linear]\nOriginal traceback:\n"
        'File "/job/my_model.py", line 48, in forward\n    image = self.vision(pixel_values)\n'
        f'  File "{TORCH}", line 134, in forward\n    return F.linear(input, self.weight, self.bias)\n'
    )
    stack = _stack(PROGRAM, MAIN, APPLY, LINEAR, exception=exception)
    lines = summarize_crash(stack, "RuntimeError: ", ["/job/my_model.py"])
    assert lines[0] == "RuntimeError: While executing %linear : call_function[target=aten.linear]"
    assert lines[1:] == [
        "at torch/nn/functional.py:3 in linear: return op()",
        "model file: /job/my_model.py:48 in forward: image = self.vision(pixel_values)",
    ]


def test_chained_exceptions_and_carets_summarise_the_last():
    first = _stack(MAIN, exception="KeyError: 'x'")
    second = _stack(PROGRAM, ("/job/my_model.py", 7, "forward", "raise AssertionError"), exception="AssertionError")
    second = second.replace("    raise AssertionError\n", "    raise AssertionError\n    ^^^^^^^^^^^^^^^^^^^^\n")
    text = first + "\nDuring handling of the above exception, another exception occurred:\n\n" + second
    frames, _ = parse_traceback(text)
    assert [f.line for f in frames] == [90, 7] and frames[-1].source == "raise AssertionError"
    assert summarize_crash(text) == [
        "AssertionError (empty message)",
        "at /job/my_model.py:7 in forward: raise AssertionError",
    ]


def test_without_a_traceback_the_type_comes_from_the_message():
    """torch's ``format_exc`` outside an except block records "NoneType: None"."""
    assert summarize_crash("NoneType: None\n", "RuntimeError: ") == ["RuntimeError (empty message)"]
    assert summarize_crash("", "OSError: disk full") == ["OSError: disk full"]


def _failure(message: str, stack: str, **extra) -> SimpleNamespace:
    return SimpleNamespace(
        timestamp=1,
        message={"message": message, "extraInfo": {"py_callstack": stack, **extra}},
        error_file_data={"message": 1},
        exitcode=1,
    )


def test_crash_block_of_an_empty_message():
    stack = _stack(PROGRAM, MAIN, MODEL, LINEAR)
    block = crash_block({0: _failure("RuntimeError: ", stack, model_files=["/job/my_model.py"])})
    assert block.splitlines() == [
        "rank 0 failed: RuntimeError (empty message)",
        "  at torch/nn/functional.py:3 in linear: return op()",
        "  model file: /job/my_model.py:12 in forward: h = F.linear(x, self.w)",
    ]
    killed = SimpleNamespace(
        timestamp=1,
        message="Signal 9 (SIGKILL) received by PID 7",
        error_file_data={},
        exitcode=-9,
        signal_name=lambda: "SIGKILL",
    )
    assert crash_block({1: killed}) == "rank 1 failed: killed by signal SIGKILL (no Python exception)"


MODEL_FILE = """import torch
import torch.nn as nn


class Raises(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x):
        h = self.lin(x)
        raise RuntimeError()


def build():
    return Raises()


def example_batch(batch_size):
    return (torch.randn(batch_size, 2),), torch.randn(batch_size, 2)
"""


@pytest.fixture
def model_path(tmp_path):
    path = tmp_path / "raises_model.py"
    path.write_text(MODEL_FILE)
    before = set(sys.modules)
    yield path
    for name in set(sys.modules) - before:
        if name.startswith(faults.MODEL_MODULE_PREFIX):
            del sys.modules[name]


def test_a_rank_records_its_model_files_and_the_launcher_names_the_model_line(model_path, tmp_path, monkeypatch):
    """As a rank does under torchrun: ``record_for_torchrun`` writes torch's error file (with the model files it
    loaded), which torchrun reads back as a ``ProcessFailure``."""
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    model = load_model_file(f"{model_path}:build").build()
    try:
        model(torch.ones(1, 2))
    except RuntimeError as exc:
        faults.record_for_torchrun(exc)
        stack = traceback.format_exc()
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file))
    assert (
        str(model_path.resolve()) in failure.message["extraInfo"][faults.MODEL_FILES_KEY]
    )  # (and any this process loaded before)
    block = crash_block({0: failure}).splitlines()
    assert block == [
        "rank 0 failed: RuntimeError (empty message)",
        f"  at {model_path}:12 in forward: raise RuntimeError()",
    ]
    assert parse_traceback(stack)[0][-1].line == 12
