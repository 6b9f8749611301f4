"""The model zoo (tests/e2e/zoo.py): every case ends as it is expected to, and none trains wrong or crashes.

``zoo_outcomes.json`` pins each (model, case): "verified" (the program trains like one process), or
"refused" with the key words of its one-line reason; for each verified tp2 case, the styles of the
modules that shard (layer numbers written "*"). A case that falls from verified to refused, a refusal
for another reason, a tp layout that loses (or gains) a sharded module: each fails here with the
case named. After a deliberate change, rewrite the file with ``AUTOSHARD_UPDATE_ZOO=1 pytest
tests/e2e/test_zoo.py`` and review its diff.
"""

import json
import os
import re
from pathlib import Path

import pytest

from e2e.zoo import CASES, MODELS, run_zoo, table

pytestmark = pytest.mark.e2e

OUTCOMES = Path(__file__).with_name("zoo_outcomes.json")
REASON_WORDS = 20  # words of a refusal's reason pinned: enough to name it, few enough to survive a number changing


def expected_of(outcomes: dict) -> dict[str, dict]:
    """Each case's outcome as the file pins it."""
    out = {}
    for (model, case), o in sorted(outcomes.items()):
        entry = {"status": o.status}
        if o.status == "refused":
            entry["reason"] = " ".join(re.sub(r"[\d.]+", "N", o.detail).split()[:REASON_WORDS])
        if o.status == "verified" and o.plan.mesh.tp > 1:
            entry["tp"] = sharded_styles(o.plan.tensor_parallel)
        out[f"{model}/{case}"] = entry
    return out


def sharded_styles(styles: dict[str, str]) -> dict[str, str]:
    """Module path (layer numbers as "*") -> style, for every module that does not stay replicated."""
    return {re.sub(r"(?<=\.)\d+(?=\.|$)", "*", path): style for path, style in sorted(styles.items())
            if style != "replicate"}


def test_every_zoo_case_ends_as_pinned(in_repo, tmp_path):
    outcomes = run_zoo(MODELS, CASES, tmp_path)
    print(table(outcomes, MODELS, CASES))
    bad = {key: o for key, o in outcomes.items() if o.status not in ("verified", "refused")}
    assert not bad, "\n".join(f"{m}/{c}: {o.status}: {o.detail}" for (m, c), o in bad.items())
    refusals = [o.detail for o in outcomes.values() if o.status == "refused"]
    assert all("\n" not in why and why for why in refusals)  # one line naming the reason
    actual = expected_of(outcomes)
    if os.environ.get("AUTOSHARD_UPDATE_ZOO"):
        OUTCOMES.write_text(json.dumps(actual, indent=1, sort_keys=True) + "\n")
    pinned = json.loads(OUTCOMES.read_text())
    assert set(pinned) == set(actual), f"cases added or gone: {sorted(set(pinned) ^ set(actual))}"
    differ = [f"{key}: pinned {pinned[key]}, got {actual[key]}" for key in sorted(actual) if pinned[key] != actual[key]]
    assert not differ, "\n".join(differ)
