"""R ranks (tp = R): calibrate's TP probe layouts vs the plans' own layouts, timed side by side as calibrate times them
(one micro-batch's forward + backward per call, b = 1), and priced by the cost model on CLUSTER.
torchrun --nproc-per-node R sp_ab.py CLUSTER.yaml"""

import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autoshard.cost.hardware import load_cluster
from autoshard.model_probes import probe_layouts
from autoshard.passes.planning.strategies import Pins
from autoshard.pipeline import PlanRequest, capture_graph, plan_graph
from autoshard.runtime.model import build_model, load_model_file
from autoshard.runtime.parallel import apply_tp

GPT = "examples/gpt.py:build"
dist.init_process_group("gloo")
rank, R = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
cluster = load_cluster(sys.argv[1], devices_per_node=R)
model_file, graph = capture_graph(GPT)
probe = probe_layouts(graph, R) if R != 2 else probe_layouts(graph)
layouts = {f"probe {k}": (c.sharded, k == "sp") for k, c in probe.items()}
for sp in (False, True):
    plan = plan_graph(
        PlanRequest(
            GPT,
            cluster,
            8,
            Pins(dp=1, tp=R, pp=1, zero_stage=0, microbatch_size=1, recompute="none", sequence_parallel=sp),
        ),
        model_file,
        graph,
    )
    layouts[f"plan {'sp' if sp else 'tp'}"] = (dict(plan.layout.tensor_parallel), sp)
    if rank == 0:
        print(
            f"plan {'sp' if sp else 'tp'} b1: predicted step {plan.predicted.step_time_s * 1e3:.1f} ms, m={plan.num_microbatches}"
        )
if rank == 0:
    for k, (v, _) in layouts.items():
        print(k, len(v), sorted(set(v.values())))
mesh = init_device_mesh("cpu", (R,), mesh_dim_names=("tp",))
mf = load_model_file(GPT)
models = {
    k: apply_tp(build_model(mf, seed=0, device=torch.device("cpu")), mesh, dict(v)) for k, (v, _) in layouts.items()
}
torch.manual_seed(1)
batch = mf.example_batch(1)


def step(model):
    inputs, targets = batch
    mf.loss(model(*inputs), targets).backward()


def timed_calls(model, n):  # as calibrate: a barrier, then n calls back to back, each timed; the ranks' mean per call
    step(model)
    step(model)
    dist.barrier()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        step(model)
        ts.append(time.perf_counter() - t)
    x = torch.tensor(ts, dtype=torch.float64)
    dist.all_reduce(x)
    return [v / R for v in x.tolist()]


res = {k: [] for k in models}
for _rnd in range(3):
    for k, m in models.items():
        res[k] += timed_calls(m, 5)
if rank == 0:
    for k, ts in res.items():
        print(f"{k:10s}: measured {statistics.median(ts) * 1e3:7.1f} ms per micro-batch (b 1)")
dist.destroy_process_group()
