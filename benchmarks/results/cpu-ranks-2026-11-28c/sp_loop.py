"""4 ranks, tp 4, the SP plan's layout at b 1: one micro-batch per call (as calibrate times it) against the program's
step (8 micro-batches, settle, AdamW, zero_grad) per micro-batch, alternating.  torchrun --nproc-per-node 4 sp_loop.py CLUSTER"""

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autoshard.cost.hardware import load_cluster
from autoshard.passes.planning.strategies import Pins
from autoshard.pipeline import PlanRequest, capture_graph, plan_graph
from autoshard.runtime.model import build_model, load_model_file
from autoshard.runtime.parallel import apply_tp
from autoshard.runtime.train_step import settle_partial_grads

GPT = "examples/gpt.py:build"
dist.init_process_group("gloo")
rank, R = dist.get_rank(), dist.get_world_size()
cluster = load_cluster(sys.argv[1], devices_per_node=R)
mf0, graph = capture_graph(GPT)
plan = plan_graph(
    PlanRequest(
        GPT,
        cluster,
        8,
        Pins(dp=1, tp=R, pp=1, zero_stage=0, microbatch_size=1, recompute="none", sequence_parallel=True),
    ),
    mf0,
    graph,
)
mesh = init_device_mesh("cpu", (R,), mesh_dim_names=("tp",))
mf = load_model_file(GPT)
if os.environ.get("AS_PROGRAM"):
    sys.path.insert(0, "/tmp/s/prog")
    import train as prog

    from autoshard import runtime
    from autoshard.runtime.recipe import Recipe

    pmesh = runtime.build_mesh("cpu", prog.MESH, prog.FLATTEN)
    pm = runtime.build_meta_model(mf, seed=0, device=torch.device("cpu"), fixed_randomness=False)
    model, opt = prog.parallelize(pm, pmesh, torch.device("cpu"), Recipe(**prog.RECIPE).for_run(6))
elif os.environ.get("AS_IMPORT"):
    sys.path.insert(0, "/tmp/s/prog")
    import train as prog

    model = apply_tp(build_model(mf, seed=0, device=torch.device("cpu")), mesh, dict(plan.layout.tensor_parallel))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
elif os.environ.get("AS_MESH2"):
    mesh2 = init_device_mesh("cpu", (1, 1, R), mesh_dim_names=("pp", "dp", "tp"))
    model = apply_tp(
        build_model(mf, seed=0, device=torch.device("cpu")), mesh2["tp"], dict(plan.layout.tensor_parallel)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
elif os.environ.get("AS_MESH"):
    sys.path.insert(0, "/tmp/s/prog")
    import train as prog

    from autoshard import runtime

    pmesh = runtime.build_mesh("cpu", prog.MESH, prog.FLATTEN)
    model = apply_tp(
        build_model(mf, seed=0, device=torch.device("cpu")), pmesh["tp"], dict(plan.layout.tensor_parallel)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
else:
    model = apply_tp(build_model(mf, seed=0, device=torch.device("cpu")), mesh, dict(plan.layout.tensor_parallel))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
torch.manual_seed(1)
inputs, targets = mf.example_batch(8)


def one(j=0):
    mf.loss(model(inputs[0][j : j + 1]), targets[j : j + 1]).backward()


def program_step():
    for j in range(8):
        one(j)
    settle_partial_grads(model)
    opt.step()
    opt.zero_grad(set_to_none=True)


def mean(ts):
    x = torch.tensor(ts, dtype=torch.float64)
    dist.all_reduce(x)
    return [v / R for v in x.tolist()]


program_step()
one()
one()
calls, steps, calls_fresh = [], [], []
for _rnd in range(4):
    dist.barrier()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        one()
        ts.append(time.perf_counter() - t)
    calls += mean(ts)
    opt.zero_grad(set_to_none=True)
    dist.barrier()
    ts = []
    for _ in range(2):
        t = time.perf_counter()
        program_step()
        ts.append((time.perf_counter() - t) / 8)
    steps += mean(ts)
if rank == 0:
    print(
        f"per call (calibrate): {statistics.median(calls) * 1e3:.1f} ms; program step / 8: {statistics.median(steps) * 1e3:.1f} ms; predicted step/8 {plan.predicted.step_time_s / 8 * 1e3:.1f} ms"
    )
dist.barrier()
