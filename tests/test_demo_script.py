"""The README's first command, ``bash scripts/demo.sh``, plans on this machine's measured cluster: the plan's
``--cluster`` is the file the script's ``autoshard calibrate`` writes, never a preset. A preset's figures (local-cpu:
rough defaults, no host time) predicted the demo's step about 4-7x too short; a quick calibration prices it as
measured (docs/usage.md)."""

import shlex
from pathlib import Path

from autoshard.cost.hardware import PRESETS

ROOT = Path(__file__).resolve().parents[1]


def _commands(name: str) -> list[list[str]]:
    """The script's ``autoshard NAME ...`` command lines, split as bash splits them."""
    lines = (ROOT / "scripts" / "demo.sh").read_text().splitlines()
    return [shlex.split(line) for line in lines if line.startswith(f"autoshard {name} ")]


def _flag(words: list[str], flag: str) -> str:
    return words[words.index(flag) + 1]


def test_readme_first_command_is_the_demo():
    readme = (ROOT / "README.md").read_text()
    first = next(line for line in readme.splitlines() if line.startswith("bash "))
    assert first.split("#")[0].split() == ["bash", "scripts/demo.sh"]


def test_demo_plans_on_the_cluster_its_calibration_writes():
    (calibrate,), (plan,) = _commands("calibrate"), _commands("plan")
    cluster = _flag(plan, "--cluster")
    assert cluster not in PRESETS
    assert cluster == _flag(calibrate, "-o")
    run = _commands("run")[0]
    assert run[2] == _flag(plan, "-o"), "the run trains the plan the script made"
