"""The SP plan's layout (b 1, tp = world) on meshes of different shapes, alternating: time per micro-batch."""

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

GPT = "examples/gpt.py:build"
dist.init_process_group("gloo")
rank, R = dist.get_rank(), dist.get_world_size()
cluster = load_cluster(sys.argv[1], devices_per_node=R)
mf0, graph = capture_graph(GPT)
styles = dict(
    plan_graph(
        PlanRequest(
            GPT,
            cluster,
            8,
            Pins(dp=1, tp=R, pp=1, zero_stage=0, microbatch_size=1, recompute="none", sequence_parallel=True),
        ),
        mf0,
        graph,
    ).layout.tensor_parallel
)
mf = load_model_file(GPT)
shapes = {
    "1-D (R,)": ((R,), ("tp",)),
    "2-D (1,R)": ((1, R), ("dp", "tp")),
    "3-D (1,1,R)": ((1, 1, R), ("pp", "dp", "tp")),
}
models = {
    k: apply_tp(
        build_model(mf, seed=0, device=torch.device("cpu")), init_device_mesh("cpu", s, mesh_dim_names=n)["tp"], styles
    )
    for k, (s, n) in shapes.items()
}
if rank == 0:
    from torch.distributed.distributed_c10d import _get_default_group

    for k, (s, n) in shapes.items():
        g = init_device_mesh("cpu", s, mesh_dim_names=n).get_group("tp")
        print(
            k,
            "default group" if g is _get_default_group() else "own group",
            g.group_name if hasattr(g, "group_name") else "",
        )
torch.manual_seed(1)
inputs, targets = mf.example_batch(1)


def one(m):
    mf.loss(m(*inputs), targets).backward()


res = {k: [] for k in models}
for m in models.values():
    one(m)
    one(m)
for _rnd in range(4):
    for k, m in models.items():
        dist.barrier()
        ts = []
        for _ in range(4):
            t = time.perf_counter()
            one(m)
            ts.append(time.perf_counter() - t)
        x = torch.tensor(ts, dtype=torch.float64)
        dist.all_reduce(x)
        res[k] += [v / R for v in x.tolist()]
if rank == 0:
    for k, ts in res.items():
        print(f"{k}: {statistics.median(ts) * 1e3:.1f} ms per micro-batch")
dist.barrier()
