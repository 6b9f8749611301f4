"""2 ranks, tp 2: the SP plan's layout at b 1, 2, 4, 8, one micro-batch's forward + backward timed per call, against
the price's parts on CLUSTER (compute, the layout's collectives, host: op dispatch and DTensor's per-module time)."""

import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autoshard.cost.hardware import load_cluster
from autoshard.cost.tables import CostTables
from autoshard.cost.tp_units import spmd_microbatch, tp_host_per_unit_s
from autoshard.ir.decisions import Decisions, Mesh
from autoshard.passes.planning.strategies import Pins
from autoshard.passes.planning.tp_layout import hand_tp_layout
from autoshard.pipeline import PlanRequest, capture_graph, plan_graph
from autoshard.runtime.model import build_model, load_model_file
from autoshard.runtime.parallel import apply_tp

GPT = "examples/gpt.py:build"
dist.init_process_group("gloo")
rank, R = dist.get_rank(), dist.get_world_size()
cluster = load_cluster(sys.argv[1], devices_per_node=R)
mf0, graph = capture_graph(GPT)
mf = load_model_file(GPT)
mesh = init_device_mesh("cpu", (1, 1, R), mesh_dim_names=("pp", "dp", "tp"))
tables = CostTables(graph, cluster)
out = []
for b in (1, 2, 4, 8):
    styles = dict(
        plan_graph(
            PlanRequest(
                GPT,
                cluster,
                8,
                Pins(dp=1, tp=R, pp=1, zero_stage=0, microbatch_size=b, recompute="none", sequence_parallel=True),
            ),
            mf0,
            graph,
        ).layout.tensor_parallel
    )
    model = apply_tp(build_model(mf, seed=0, device=torch.device("cpu")), mesh["tp"], styles)
    torch.manual_seed(b)
    inputs, targets = mf.example_batch(b)

    def one():
        mf.loss(model(*inputs), targets).backward()

    one()
    one()
    ts = []
    for _ in range(3):
        dist.barrier()
        for _ in range(4):
            t = time.perf_counter()
            one()
            ts.append(time.perf_counter() - t)
    x = torch.tensor(ts, dtype=torch.float64)
    dist.all_reduce(x)
    t = statistics.median(v / R for v in x.tolist())
    config = Decisions(Mesh(1, R, 1), 0, b, 1, sequence_parallel=True)
    hand_tp_layout(tables, config)
    micro, comm_s, _ = spmd_microbatch(tables, config)
    host = sum(tables.config_units(config).host_s)
    dt = sum(tp_host_per_unit_s(tables, config))
    out.append((b, t, micro.forward_s + micro.backward_s, comm_s, host, dt))
if rank == 0:
    print(" b  measured   compute  collectives  op-host  dtensor  price")
    for b, t, c, m, h, d in out:
        print(
            f"{b:2d} {t * 1e3:8.1f} {c * 1e3:9.1f} {m * 1e3:11.1f} {h * 1e3:8.1f} {d * 1e3:8.1f} {(c + m + h + d) * 1e3:6.1f}"
        )
dist.barrier()
