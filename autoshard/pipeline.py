"""The pass pipeline, in one flat list: model file + cluster -> Plan.

    capture     torch.export on meta tensors         ModelFile -> OpGraph
    annotate    FLOPs and bytes per op               OpGraph -> OpGraph
    blocks      repeated blocks, units of planning   OpGraph -> OpGraph   (needs annotate)
    strategies  configurations honouring the pins   -> [Config]
    search      price each, keep the fastest fit     -> SearchResult      (needs blocks)
    assemble    decision + prediction + rivals       -> Plan

A pass that fails on a bug is re-raised as "while running pass X after [A, B]"; a user error
(AutoshardError) passes through unchanged, as its message already names the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from autoshard.errors import AutoshardError
from autoshard.ir.graph import OpGraph
from autoshard.ir.plan import Plan, Stage
from autoshard.ir.topology import Cluster
from autoshard.modelfile import ModelFile, load_model_file
from autoshard.passes.annotate import annotate
from autoshard.passes.blocks import find_blocks
from autoshard.passes.capture import capture
from autoshard.passes.search import SearchResult, search
from autoshard.passes.strategies import Pins, candidate_configs, choose_dp, refuse_unsupported
from autoshard.runtime.model import model_fingerprint

CAPTURE_BATCH = 2  # costs scale with the batch; a batch of 2 keeps the batch dimension visible


class PassError(RuntimeError):
    pass


@dataclass(frozen=True)
class PlanRequest:
    model_spec: str
    cluster: Cluster
    global_batch: int
    pins: Pins = field(default_factory=Pins)

    def __post_init__(self):
        if not isinstance(self.global_batch, int) or self.global_batch < 1:
            raise AutoshardError(f"--global-batch {self.global_batch} must be a positive integer")


def plan_model(request: PlanRequest) -> Plan:
    # The request is checked before capture, which takes seconds on large models.
    refuse_unsupported(request.pins)
    choose_dp(request.cluster.world_size, request.global_batch, request.pins)
    model_file = load_model_file(request.model_spec)
    done: list[str] = []
    graph = _graph_passes(model_file, done)
    configs = _run("strategies", done, candidate_configs, request.cluster.world_size, request.global_batch,
                   request.pins)
    result = _run("search", done, search, graph, request.cluster, configs, request.global_batch)
    return _run("assemble", done, assemble_plan, request, model_file, graph, result)


def capture_graph(model_spec: str) -> tuple[ModelFile, OpGraph]:
    """capture -> annotate -> blocks, for tools that need only the graph."""
    model_file = load_model_file(model_spec)
    return model_file, _graph_passes(model_file, [])


def _graph_passes(model_file: ModelFile, done: list[str]) -> OpGraph:
    graph = _run("capture", done, capture, model_file, CAPTURE_BATCH)
    graph = _run("annotate", done, annotate, graph)
    return _run("blocks", done, find_blocks, graph)


def assemble_plan(request: PlanRequest, model_file: ModelFile, graph: OpGraph, result: SearchResult) -> Plan:
    c = result.best.config
    world = list(range(c.mesh.world_size))
    return Plan(
        model=model_summary(request.model_spec, model_file, graph),
        cluster=request.cluster.to_dict(),
        global_batch=request.global_batch,
        mesh=c.mesh,
        zero_stage=c.zero_stage,
        microbatch_size=c.microbatch_size,
        num_microbatches=c.num_microbatches,
        schedule=c.schedule,
        recompute=c.recompute,
        stages=(Stage(index=0, modules=top_level_modules(graph), ranks=tuple(world)),),
        tensor_parallel={},
        predicted=result.best.predicted,
        alternatives=result.alternatives,
        blocks=tuple(b.path for b in graph.blocks),
        ddp_bucket_cap_mb=c.ddp_bucket_cap_mb,
        precision="bf16-autocast" if request.cluster.backend == "nccl" else "fp32",
        pinned=request.pins.names,
    )


def model_summary(spec: str, model_file: ModelFile, graph: OpGraph) -> dict[str, Any]:
    return {
        "spec": spec,
        "hash": model_fingerprint(model_file.build("meta")),
        "params": graph.param_count,
        "layers": len(graph.blocks),
        "tokens_per_sample": graph.tokens_per_sample,
    }


def top_level_modules(graph: OpGraph) -> tuple[str, ...]:
    """The root's children that own ops, in first-use order."""
    seen: dict[str, None] = {}
    for node in graph.nodes:
        if node.module_path:
            seen.setdefault(node.module_path.split(".")[0], None)
    return tuple(seen)


def _run(name: str, done: list[str], fn: Callable, *args):
    try:
        out = fn(*args)
    except AutoshardError:
        raise
    except Exception as exc:
        raise PassError(f"while running pass {name} after {done}: {type(exc).__name__}: {exc}") from exc
    done.append(name)
    return out
