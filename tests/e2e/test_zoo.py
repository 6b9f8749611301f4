"""The model zoo (tests/e2e/zoo.py): no plan trains wrong, none crashes; each is verified or refused."""

import pytest

from e2e.zoo import CASES, MODELS, run_zoo, table

pytestmark = pytest.mark.e2e


def test_every_zoo_plan_trains_like_one_process_or_is_refused(in_repo, tmp_path):
    outcomes = run_zoo(MODELS, CASES, tmp_path)
    print(table(outcomes, MODELS, CASES))
    bad = {key: o for key, o in outcomes.items() if o.status not in ("verified", "refused")}
    assert not bad, "\n".join(f"{m}/{c}: {o.status}: {o.detail}" for (m, c), o in bad.items())
    refusals = [o.detail for o in outcomes.values() if o.status == "refused"]
    assert all("\n" not in why and why for why in refusals)  # one line naming the reason
    verified = {key for key, o in outcomes.items() if o.status == "verified"}
    assert len(verified) >= 3 * len(MODELS)  # most cases train; refusals are the exception
    tp_sharded = [o for (m, c), o in outcomes.items() if c == "tp2" and o.status == "verified"
                  and any(s != "replicate" for s in o.plan.tensor_parallel.values())]
    assert len(tp_sharded) >= len(MODELS) // 2  # tp2 really shards on most models
