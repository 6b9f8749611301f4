"""The pass pipeline, in one flat list: model file + cluster -> Plan.

    capture     torch.export on meta tensors, two    ModelFile -> OpGraph
                of L repeated layers (passes.capturing.fold)
    annotate    FLOPs and bytes per op               OpGraph -> OpGraph
                (both read from passes.capturing.capture_cache instead when it has the model unchanged;
                both run in a forked child while this process imports the rest: passes.capturing.front)
    unfold      the L layers, copied from the two    OpGraph -> OpGraph   (after annotate: copies
                                                                           carry their FLOPs)
    blocks      repeated blocks, units of planning   OpGraph -> OpGraph   (needs annotate)
    experts     mixture-of-experts groups whose      OpGraph -> OpGraph   (needs blocks)
                experts may live on other ranks
    strategies  meshes (dp, tp, pp) and configurations
                the runtime supports, pins applied   -> [Decisions]       (needs blocks)
    search      price each (TP layouts, stage cuts),
                keep the fastest fit                 -> SearchResult      (needs blocks)
    assemble    decision + stages + TP styles +
                prediction + symbolic cost + rivals  -> Plan

``estimate_model`` (``autoshard estimate``) runs the same list with every decision pinned and
``price`` in place of ``search``: the one configuration is priced the same way and kept even
when it does not fit, so the user still sees what it would cost.

Each pass is called directly inside ``with running(name, done)`` (``passes.capturing.front.running``): it records
the passes done, and a pass that fails on a bug is re-raised as "while running pass X after [A, B]"; a
user error (AutoshardError) passes through unchanged, as its message already names the fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoshard.cost.dp_comm import ranks_of_stage
from autoshard.cost.float8 import float8_linears
from autoshard.cost.memory import precision_for_graph
from autoshard.cost.schedule import stage_owners
from autoshard.cost.step import price_parts
from autoshard.cost.symbolic import symbolic_cost
from autoshard.cost.tables import CostTables, Runtime
from autoshard.cost.units import node_units, stage_ranges, stage_units
from autoshard.errors import AutoshardError
from autoshard.ir.decisions import FLOAT8_OFF, Decisions, Mesh, TPChoice
from autoshard.ir.graph import OpGraph, unread_params
from autoshard.ir.plan import HF_PREFIX, Plan, PlanLayout, PlanProvenance, PlanReview, Stage, model_file_sha256
from autoshard.ir.plan_format import PLAN_RUNTIMES
from autoshard.ir.topology import Cluster
from autoshard.passes.capturing.annotate import estimated_ops, random_ops
from autoshard.passes.capturing.blocks import find_blocks
from autoshard.passes.capturing.experts import find_experts
from autoshard.passes.capturing.fold import unfold
from autoshard.passes.capturing.front import CAPTURE_BATCH, PassError, capture_front, running  # noqa: F401 (re-exported)
from autoshard.passes.layouts.loss import output_projection
from autoshard.passes.planning.pin_checks import check_pins
from autoshard.passes.planning.search import Priced, SearchResult, price_config, search, search_report, why_not
from autoshard.passes.planning.space import candidate_configs
from autoshard.passes.planning.strategies import Pins, loss_parallel_refusal

if TYPE_CHECKING:  # capture and annotate import torch; a plan from the capture cache never does
    from autoshard.modelfile import ModelFile


@dataclass(frozen=True)
class PlanRequest:
    model_spec: str
    cluster: Cluster
    global_batch: int
    pins: Pins = field(default_factory=Pins)
    fold: bool = True  # capture three of the repeated layers and copy them (passes.capturing.fold); --no-fold
    time_limit_s: float | None = None  # stop the search here, reporting the optimality gap; --time-limit
    cache: bool = True  # read and write the capture cache (passes.capturing.capture_cache); --no-cache
    runtime: str = "autoshard"  # what the cost model prices (cost.tables.Runtime.named); --runtime
    seq_len: int | None = None  # tokens per sample handed to example_batch (None: the model file's); --seq-len
    # keep exactly this many micro-batches per step (None: searched): an elastic re-plan of a model with BatchNorm,
    # which normalises over each micro-batch (``elastic.replan``)
    num_microbatches: int | None = None

    def __post_init__(self):
        if not isinstance(self.global_batch, int) or self.global_batch < 1:
            raise AutoshardError(f"--global-batch {self.global_batch} must be a positive integer")
        if self.runtime not in PLAN_RUNTIMES:
            raise AutoshardError(f"--runtime {self.runtime} must be one of {', '.join(PLAN_RUNTIMES)}")
        if self.pins.precision is not None and self.runtime != "autoshard":
            raise AutoshardError(
                f"--precision {self.pins.precision} with --runtime {self.runtime}: that runtime is "
                f"priced in its own precision (Megatron-LM's bf16 mixed precision); drop --precision"
            )

    def tp_degrees(self) -> tuple[int, ...]:
        """The tensor-parallel degrees this request's search may take before the heads are known
        (``Cluster.tp_degrees``, the pinned one only): the degrees whose proof of the model's code capture runs."""
        return tuple(self.cluster.tp_degrees(self.pins.tp))

    def cost_tables(self, graph: OpGraph) -> CostTables:
        """The cost tables of ``graph`` priced for this request's runtime (in the pinned precision, if any)."""
        return CostTables(graph, self.cluster, Runtime.named(self.runtime, self.cluster, graph, self.pins.precision))


def plan_model(request: PlanRequest) -> Plan:
    # The request is checked before capture, which takes seconds on large models.
    check_pins(request.pins, request.cluster, request.global_batch)
    done: list[str] = []
    model_file, graph = request_graph(request, done)
    return plan_graph(request, model_file, graph, done)


def request_graph(request: PlanRequest, done: list[str]) -> tuple[ModelFile | None, OpGraph]:
    """capture -> ... -> experts for a plan or estimate request: the TP proof at the degrees its cluster offers,
    the context-parallel proof where cp is pinned."""
    model_file, graph = capture_front(
        request.model_spec,
        done,
        request.fold,
        request.cache,
        request.seq_len,
        prove_cp=(request.pins.cp or 1) > 1,
        tp_degrees=request.tp_degrees(),
    )
    return model_file, _later_graph_passes(graph, done)


def plan_graph(
    request: PlanRequest, model_file: ModelFile | None, graph: OpGraph, done: list[str] | None = None
) -> Plan:
    """strategies -> search -> assemble on an already captured graph (tests plan many requests on one)."""
    done = done if done is not None else ["capture", "annotate", "blocks", "experts"]
    with running("strategies", done):
        configs = with_microbatches(
            candidate_configs(graph, request.cluster, request.global_batch, request.pins), request.num_microbatches
        )
    with running("search", done):
        result = search(
            graph,
            request.cluster,
            configs,
            request.global_batch,
            request.time_limit_s,
            request.pins.recompute is None,
            request.runtime,
            request.pins.stage_cuts,
            request.pins.precision,
        )
    with running("assemble", done):
        return assemble_plan(request, model_file, graph, result)


def with_microbatches(configs: list[Decisions], count: int | None) -> list[Decisions]:
    """The configurations of ``count`` micro-batches per step (all of them for None); one line when none is."""
    if count is None:
        return configs
    kept = [c for c in configs if c.num_microbatches == count]
    if not kept:
        found = sorted({c.num_microbatches for c in configs})
        raise AutoshardError(
            f"no configuration splits the global batch into {count} micro-batch(es) (the search space has "
            f"{', '.join(map(str, found)) or 'none'}); fix: keep the micro-batch count reachable, e.g. another world size"
        )
    return kept


def estimate_model(request: PlanRequest) -> Plan:
    """The plan of the one configuration the pins fix (all of them, or their defaults:
    ``Pins.with_defaults``; the CLI checks), fit or not."""
    pins = request.pins.with_defaults()
    check_pins(pins, request.cluster, request.global_batch)
    done: list[str] = []
    model_file, graph = request_graph(request, done)
    with running("strategies", done):
        configs = candidate_configs(graph, request.cluster, request.global_batch, pins)
    with running("price", done):
        result = price_pinned(request, graph, configs)
    with running("assemble", done):
        return assemble_plan(request, model_file, graph, result, estimated=True)


def price_pinned(request: PlanRequest, graph: OpGraph, configs: list[Decisions]) -> SearchResult:
    """Every decision pinned leaves one configuration: priced as ``search`` prices it (so a plan with the
    same pins that fits is the same plan), and kept when it does not fit."""
    assert len(configs) == 1, f"every decision pinned, yet {len(configs)} configurations"
    best = price_config(
        graph, request.cluster, configs[0], request.global_batch, request.cost_tables(graph), request.pins.stage_cuts
    )
    return SearchResult(best=best, alternatives=(), report=search_report(1, 1, best, None))


def capture_graph(
    model_spec: str, fold: bool = True, seq_len: int | None = None, use_cache: bool = False, proofs: bool = True
) -> tuple[ModelFile, OpGraph]:
    """capture -> annotate -> unfold -> blocks, for tools that need only the graph (the capture cache
    only where asked: its entries are what ``plan`` would capture). ``proofs``: the TP proof at every degree
    and the CP proof, for tools that read them; without, neither runs (a graph for the cost model's parts: a
    later plan of the same model proves what it needs and adds it to the cache entry)."""
    done: list[str] = []
    model_file, graph = capture_front(
        model_spec,
        done,
        fold,
        use_cache=use_cache,
        seq_len=seq_len,
        prove_cp=proofs,
        tp_degrees=None if proofs else (),
    )
    return model_file, _later_graph_passes(graph, done)


def _later_graph_passes(graph: OpGraph, done: list[str]) -> OpGraph:
    with running("unfold", done):
        graph = unfold(graph)
    with running("blocks", done):
        graph = find_blocks(graph)
    with running("experts", done):
        return find_experts(graph)


def tp_reasons(graph: OpGraph, config: Decisions, tp: TPChoice | None, not_chosen: str = "") -> dict[str, str]:
    """The layout's reasons, and for an output projection whose logits are gathered whole why loss parallelism
    is not run (``strategies.loss_parallel_refusal``, else ``not_chosen``: why the plan's pins left it off, else
    the price: the search found the gathered logits faster)."""
    if tp is None:
        return {}
    reasons = dict(tp.reasons)
    name, _ = output_projection(graph)
    path = graph.node(name).module_path if name else ""
    if path and not config.loss_parallel and tp.styles.get(path, "").startswith("colwise-gather"):
        why = (
            loss_parallel_refusal(config.mesh, graph.loss_parallel_proof)
            or not_chosen
            or "the gathered logits priced faster"
        )
        reasons[path] = "; ".join(filter(None, (reasons.get(path), f"no loss parallelism: {why}")))
    return reasons


def loss_parallel_left_off(pins: Pins, estimated: bool) -> str:
    """Why the pins, rather than the search, left loss parallelism off ("" where the search chose)."""
    if pins.loss_parallel is False:
        return "pinned --loss-parallel off"
    if estimated and pins.loss_parallel is None:
        return "estimate prices it off unless pinned (--loss-parallel on)"
    return ""


def assemble_plan(
    request: PlanRequest, model_file: ModelFile | None, graph: OpGraph, result: SearchResult, estimated: bool = False
) -> Plan:
    best = result.best
    c = best.config
    tp = best.tp_choice
    blocks = tuple(b.path for b in graph.blocks)
    return Plan(
        model=model_summary(request.model_spec, model_file, graph, request.seq_len),
        cluster=request.cluster.to_dict(),
        global_batch=request.global_batch,
        # the chosen decisions, at the pinned precision, else the parameters' (the search priced the cluster's)
        decisions=replace(
            c, precision=precision_for_graph(request.cluster.backend, graph, request.pins.precision).name
        ),
        layout=PlanLayout(
            blocks=blocks,
            tensor_parallel=dict(tp.sharded) if tp is not None else {},
            split_points=tuple(blocks[k] for k in best.cuts),
            stages=pipeline_stages(graph, c.mesh, best.cuts, c.schedule, c.virtual_stages),
            experts=tuple(g.path for g in graph.experts) if c.ep > 1 else (),
            float8_linears=float8_linears(graph) if c.float8 != FLOAT8_OFF else (),
            unread_params=unread_params(graph),
        ),
        predicted=result.best.predicted,
        review=PlanReview(
            alternatives=result.alternatives,
            tensor_parallel_reasons=tp_reasons(graph, c, tp, loss_parallel_left_off(request.pins, estimated)),
            notes=plan_notes(best, request.runtime)
            + batch_notes(graph, c)
            + precision_notes(request)
            + ((why_not(best, best, request.cluster),) if not best.fits else ()),
            symbolic=plan_symbolic(request, graph, best),
            search=dict(result.report),
        ),
        provenance=PlanProvenance(pinned=request.pins.names, runtime=request.runtime),
    )


def plan_symbolic(request: PlanRequest, graph: OpGraph, best: Priced) -> dict[str, Any]:
    """The chosen configuration's step time and memory as expressions (``cost.symbolic``), anchored at
    its priced parts (priced again here, with the TP layout it was priced with: ``search`` keeps only
    their sums)."""
    tables = request.cost_tables(graph)
    if best.tp_choice is not None:
        tables.add_tp_layout(
            best.tp_choice,
            best.config.microbatch_size / best.config.mesh.cp,
            best.config.sequence_parallel,
            best.config.loss_parallel,
        )
    parts = price_parts(tables, best.config, best.cuts or None)
    assert abs(parts.step_time_s - best.predicted.step_time_s) <= 1e-9 * best.predicted.step_time_s, (
        "the parts priced again differ from the search's"
    )
    return symbolic_cost(tables, best.config, request.global_batch, parts, best.tp_choice)


DTYPE_NOTE = "config.json names torch_dtype"  # how precision_notes begins (show.py's precision row repeats it)


def precision_notes(request: PlanRequest) -> tuple[str, ...]:
    """A transformers config naming a 16-bit torch_dtype: ``hf:DIR`` builds fp32 weights (master weights) unless
    --precision bf16-pure is pinned; the plan says which."""
    if not request.model_spec.startswith(HF_PREFIX):
        return ()
    try:
        config = json.loads((Path(request.model_spec[len(HF_PREFIX) :]) / "config.json").read_text())
    except (OSError, ValueError):
        return ()
    named = config.get("torch_dtype") or config.get("dtype") if isinstance(config, dict) else None
    if named not in ("bfloat16", "float16"):
        return ()
    if request.pins.precision == "bf16-pure":
        return (
            f"{DTYPE_NOTE} {named}: --precision bf16-pure trains in bf16 (the fp32 initial "
            f"weights cast to bf16; weights, gradients and optimizer state in bf16)",
        )
    return (
        f"{DTYPE_NOTE} {named}: the program keeps fp32 master weights (precision "
        f"{precision_shown(request)}); pin --precision bf16-pure to train the weights in bf16",
    )


def precision_shown(request: PlanRequest) -> str:
    """The precision the plan trains in, as --precision names it where pinned, else the backend's default."""
    if request.pins.precision is not None:
        return request.pins.precision
    return "bf16 autocast" if request.cluster.backend == "nccl" else "fp32"


def plan_notes(best: Priced, runtime: str = "autoshard") -> tuple[str, ...]:
    """What a reviewer should know that the fields do not say."""
    mesh, tp = best.config.mesh, best.tp_choice
    notes = ()
    if tp is not None and not tp.sharded:
        notes += (
            f"tp={mesh.tp}: the layout model keeps every module replicated on this cluster (resharding would "
            f"cost more than it saves), so the {mesh.tp} tp ranks compute the same thing; pin --tp 1 or use "
            f"a cluster with a faster link",
        )
    if runtime != "autoshard":
        notes += (RUNTIME_NOTE.format(runtime=runtime),)
    return notes


def batch_notes(graph: OpGraph, c: Decisions) -> tuple[str, ...]:
    """What the plan keeps whole for a loss that couples the samples of a batch (``passes.capturing.batch_coupling``), or that
    it could not check whether the loss does."""
    if graph.batch_coupling:
        return (f"the batch stays whole on one rank (dp 1, one micro-batch): {graph.batch_coupling}",)
    if graph.batch_coupling is None and graph.model_fingerprint and c.mesh.dp * c.mesh.cp * c.num_microbatches > 1:
        return (
            "whether the loss of a batch is the mean of its shares' losses (what dp and micro-batches need) was not "
            "checked (the model is too large to run here, or did not run on the CPU); `autoshard verify` a smaller "
            "configuration of it",
        )
    return ()


RUNTIME_NOTE = (
    "priced as {runtime} runs this configuration (--runtime {runtime}), to compare with its published "
    "runs; `autoshard compile` still emits autoshard's program, which `--runtime autoshard` prices"
)


def pipeline_stages(
    graph: OpGraph, mesh: Mesh, cuts: tuple[int, ...], schedule: str = "1f1b", virtual_stages: int = 1
) -> tuple[Stage, ...]:
    """One Stage per pipeline stage (one in all without pipelining): its top-level / block modules
    in run order and the ranks holding it (all of its pp rank's dp × tp; pp rank s mod pp, or in a V
    ``cost.schedule.stage_owners``'s)."""
    if mesh.pp == 1:
        return (Stage(index=0, modules=top_level_modules(graph), ranks=tuple(range(mesh.world_size))),)
    names = unit_modules(graph)
    owner = stage_owners(schedule, mesh.pp, virtual_stages)
    return tuple(
        Stage(
            index=s,
            modules=tuple(m for u in stage_units(rng, len(graph.blocks)) for m in names[u]),
            ranks=ranks_of_stage(mesh, owner[s]),
        )
        for s, rng in enumerate(stage_ranges(cuts, len(graph.blocks)))
    )


def unit_modules(graph: OpGraph) -> list[tuple[str, ...]]:
    """Per pipeline unit (``cost.units``): each block's path; outside blocks, the outermost module
    that is not an ancestor of a block ("wte", "lm_head"; "transformer.wte" under HF GPT-2)."""
    ancestors = {".".join(b.path.split(".")[:i]) for b in graph.blocks for i in range(1, b.path.count(".") + 1)}
    outside: list[dict[str, None]] = [{} for _ in range(len(graph.blocks) + 2)]
    in_block = {n for b in graph.blocks for n in b.node_names}
    for node, u in zip(graph.nodes, node_units(graph)):
        if node.module_path and node.name not in in_block:
            outside[u].setdefault(_outermost_outside(node.module_path, ancestors), None)
    blocks = [(b.path,) for b in graph.blocks]
    return [tuple(outside[0]), *[blk + tuple(outside[k + 1]) for k, blk in enumerate(blocks)], tuple(outside[-1])]


def _outermost_outside(module_path: str, ancestors: set[str]) -> str:
    parts = module_path.split(".")
    return next(
        (".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) not in ancestors), module_path
    )


def check_plan_modules(plan: Plan, model_file: ModelFile) -> None:
    """Every module the plan names exists in the model (built on meta): tensor-parallel modules, stage
    modules, split points, blocks and recompute blocks. A plan edited by hand, or made for another
    version of the model, otherwise compiles into a program that fails on every rank."""
    from autoshard.passes.capturing.capture import build_on_meta

    have = {name for name, _ in build_on_meta(model_file).named_modules()}
    named = [
        *(("tensor_parallel", path) for path in plan.tensor_parallel),
        *((f"stage {s.index}", path) for s in plan.stages for path in s.modules),
        *(("split_points", path) for path in plan.split_points),
        *(("blocks", path) for path in plan.blocks),
        *(("recompute_blocks", path) for path in plan.recompute_blocks),
    ]
    missing = [(where, path) for where, path in named if path not in have]
    if missing:
        where, path = missing[0]
        more = f" ({len(missing) - 1} more missing)" if len(missing) > 1 else ""
        raise AutoshardError(
            f"the plan names module '{path}' in {where}, which {plan.model['spec']} does not have"
            f"{more}; fix: re-plan with `autoshard plan {plan.model['spec']} ...` instead of "
            f"editing the plan"
        )


OPS_NAMED = 5  # op targets a plan names in model.ops_estimated (the count covers them all)


def model_summary(
    spec: str, model_file: ModelFile | None, graph: OpGraph, seq_len: int | None = None
) -> dict[str, Any]:
    if graph.model_fingerprint or model_file is None:
        fingerprint = graph.model_fingerprint
    else:
        from autoshard.modelfile import model_fingerprint

        fingerprint = model_fingerprint(model_file.build("meta"))
    summary = {
        "spec": spec,
        "hash": fingerprint,
        "params": graph.param_count,
        "layers": len(graph.blocks),
        "tokens_per_sample": graph.tokens_per_sample,
    }
    if seq_len is not None:  # --seq-len: the programs hand it to example_batch as the plan did
        summary["seq_len"] = seq_len
    file_sha256 = model_file_sha256(spec)  # checked before compile, run or verify import the file
    if file_sha256 is not None:
        summary["file_sha256"] = file_sha256
    estimated = estimated_ops(graph)
    if estimated:  # only then: plans of models whose every op has a formula stay as they were
        summary["ops_estimated"] = {"count": len(estimated), "ops": sorted({n.target for n in estimated})[:OPS_NAMED]}
    drawn = random_ops(graph)
    if drawn:  # only then: plans of models that draw nothing stay as they were
        summary["random_ops"] = drawn
    return summary


def top_level_modules(graph: OpGraph) -> tuple[str, ...]:
    """The root's children that own ops, in first-use order."""
    seen: dict[str, None] = {}
    for node in graph.nodes:
        if node.module_path:
            seen.setdefault(node.module_path.split(".")[0], None)
    return tuple(seen)
