"""One rank of a plan's world gets through the emitted program's setup on fake tensors: the model built on the
meta device (``runtime.build_meta_model``), the plan's steps applied (``runtime.apply_steps``, as the program's
``parallelize``), over a fake process group of the plan's world size (torch's ``FakeStore`` and "fake" backend).
Prints one JSON line: host memory before and after, and what the rank holds.

    python tests/scale/setup_on_fake_ranks.py PLAN.json [RANK]
"""

from __future__ import annotations

import json
import resource
import sys

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from autoshard import runtime
from autoshard.ir.plan import load_plan
from autoshard.passes.lower import layout, lower


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    plan = load_plan(sys.argv[1])
    rank = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    spec = layout(plan)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=spec.world_size)
    mesh = runtime.build_mesh("cpu", dict(spec.mesh), dict(spec.flatten))
    model_file = runtime.load_model_file(plan.model["spec"], expected_hash=plan.model["hash"])
    before = max_rss_bytes()
    model = runtime.build_meta_model(model_file, seed=0, device="cpu")
    whole_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with FakeTensorMode(allow_non_fake_inputs=True):
        applied = runtime.apply_steps(model, lower(plan), mesh, device=torch.device("cpu"), lr=1e-3)
    params = list(applied["model"].parameters())
    local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    print(json.dumps({
        "world_size": spec.world_size, "rank": rank, "whole_model_bytes": whole_bytes,
        "rank_param_bytes": sum(t.numel() * t.element_size() for t in local),
        "all_dtensors": all(isinstance(p, DTensor) for p in params),
        "any_meta": any(t.is_meta for t in local),
        "max_rss_before_bytes": before, "max_rss_after_bytes": max_rss_bytes(),
        "optimizer": type(applied["optimizer"]).__name__,
    }))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
