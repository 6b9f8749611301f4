"""One rank of a plan's world gets through the emitted program's setup on fake devices: the model built on the
meta device (``runtime.build_meta_model``), the plan's steps applied (``runtime.apply_steps``, as the program's
``parallelize`` calls them), over a fake process group of the plan's world size (torch's ``FakeStore`` and
"fake" backend), the rank's own tensors made as fake tensors.
Prints one JSON line: host memory before and after, and what the rank holds.

    python tests/scale/setup_on_fake_ranks.py PLAN.json [RANK] [--real] [--whole]

``--real``: the rank's tensors are made for real on CPU and filled by the replay (host memory per rank during
setup, benchmarks/RESULTS.md); ``--whole``: with ``--real``, the model is built whole on CPU first
(``runtime.build_model``, as programs did before ``build_meta_model``), for comparison.
"""

from __future__ import annotations

import contextlib
import json
import resource
import sys
import time

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from autoshard import runtime
from autoshard.ir.plan import load_plan
from autoshard.ir.recipe import Recipe
from autoshard.passes.lowering.lower import layout, lower


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    flags = {a for a in sys.argv[1:] if a.startswith("--")}
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    plan = load_plan(args[0])
    rank = int(args[1]) if len(args) > 1 else 0
    real, whole = "--real" in flags, "--whole" in flags
    spec = layout(plan)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=spec.world_size)
    mesh = runtime.build_mesh("cpu", dict(spec.mesh), dict(spec.flatten))
    model_file = runtime.load_model_file(plan.model["spec"], expected_hash=plan.model["hash"])
    before = max_rss_bytes()
    start = time.perf_counter()
    build = runtime.build_model if whole else runtime.build_meta_model
    model = build(model_file, seed=0, device="cpu")
    whole_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    steps = lower(plan)
    first_real = next(i for i, step in enumerate(steps) if step.op == "init_weights")
    device = torch.device("cpu")
    # The steps before init_weights act on the meta device as in the program; from init_weights on, tensors
    # that would be made on the device are fake (FakeTensorMode: shapes, no memory, no values)
    model = runtime.apply_steps(model, steps[:first_real], mesh, device=device, recipe=Recipe())["model"]
    with contextlib.nullcontext() if real else FakeTensorMode(allow_non_fake_inputs=True):
        applied = runtime.apply_steps(model, steps[first_real:], mesh, device=device, recipe=Recipe())
    seconds = time.perf_counter() - start
    params = list(applied["model"].parameters())
    local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    print(
        json.dumps(
            {
                "world_size": spec.world_size,
                "rank": rank,
                "whole_model_bytes": whole_bytes,
                "rank_param_bytes": sum(t.numel() * t.element_size() for t in local),
                "all_dtensors": all(isinstance(p, DTensor) for p in params),
                "any_meta": any(t.is_meta for t in local),
                "max_rss_before_bytes": before,
                "max_rss_after_bytes": max_rss_bytes(),
                "optimizer": type(applied["optimizer"]).__name__,
                "setup_s": round(seconds, 1),
                "real": real,
                "whole": whole,
            }
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
