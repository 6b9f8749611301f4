"""Pipeline parallelism with ``torch.distributed.pipelining``: split, schedule, tie, gather.

Layout. The model is cut at module boundaries into S = pp · v stages (``split_points`` name
the modules where a stage *begins*; v = ``virtual_stages``). With the looped placement stage s
lives on pipeline rank s mod pp, so rank r holds stages r, r + pp, r + 2·pp, ... (Megatron's
interleaved layout; v = 1 is the plain layout). The V placement (``zbv``, ``dualpipev``: v = 2)
gives rank r stages r and 2·pp − 1 − r, so rank 0 holds the first and the last stage and the
V's tip, stages pp − 1 and pp, sits on rank pp − 1 (torch's ``generate_stage_to_rank_mapping``
with style "v"; the schedule tells the stages, and sends nothing between two stages of one rank). The split is ``pipeline(model, mb_args, split_spec)``: torch.export
traces one micro-batch, so any exportable model splits, and each stage is a GraphModule whose
parameters keep the original names (``h.2.attn.q_proj.weight``).

Loss and gradients. A step of batch B runs m = ``n_microbatches`` micro-batches of b = B/m;
the last stage computes ℓ_j = loss_fn(out_j, y_j) (a mean over micro-batch j) and backward
runs on each ℓ_j unscaled. The schedule then divides every gradient by m (``scale_grads=True``,
in ``perform_reduce_grad``), so with equal micro-batches::

    g = (1/m) Σ_j ∇ℓ_j = ∇ (1/m) Σ_j ℓ_j = ∇ ℓ(B)            the one-process gradient

and with dp replicas FSDP2's reduce-scatter averages once more over dp (B = dp · m · b).
The step's loss is (1/(dp·m)) Σ_replicas Σ_j ℓ_j, summed over the world and read on every rank.

Tied weights. ``pipeline()`` REPLICATEs a parameter used by several stages (GPT-2's
``transformer.wte.weight`` in stage 0, ``lm_head.weight`` in the last): each stage gets its own
deep copy, listed in ``Pipe.replicated_params``. The copies start equal; each gets only its
stage's share of the gradient, so after the schedule we sum them (Megatron's embedding-group
all-reduce)::

    g_tied = Σ_{stages s using it} g_s

over the pp ranks holding a copy (all of pp when pp = 2), and AdamW then moves every copy
the same.
Inside one stage every name of a tied weight is made one parameter again (``one_parameter_per_tie``:
``pipeline()`` may copy it under one name and keep the original under another, T5's encoder and
decoder embeddings), and the final weights (``checkpoint.save_weights``) list every alias the model's
``state_dict()`` does.
``pipeline()`` also leaves the original, now unused, alias on stage 0 (``lm_head.weight`` on the
embedding stage); ``drop_unused_state`` removes such leftovers so no stale copy is trained or
saved. State no stage's graph reads at all (a causal-LM decoder's cross-attention, which its forward never
calls) ``pipeline()`` puts in no stage: one stage keeps each such tensor (``unread_state_homes``: the stage of
its layer, else the first), untouched by training as in one process, so the final weights, checkpoints and
exports hold every tensor of the model. The cost model prices each such parameter in the unit of the same home
(``cost.units.unread_param_homes``), so the stage that holds it is priced for it.

DP × PP. ``runtime.parallel.apply_fsdp`` puts FSDP2 ``fully_shard`` on each stage module over the dp
sub-mesh (as torchtitan does); the schedules call FSDP's post-backward themselves
(``perform_reduce_grad``), and tied copies are summed shard by shard (every copy is sharded the
same way over dp).

CP × PP (``SequenceShard``). Each of the cp ranks of a pipeline rank holds s/cp tokens of every sample
(a head-tail pair of chunks, or one contiguous chunk: ``context_parallel.shard_sequence``): the stages are
traced on those tokens of one micro-batch (so every boundary carries the
rank's token shard), each step cuts the rank's batch the same way before the schedule splits it into
micro-batches, and the schedule runs under ``context_parallel.ContextParallelMode``, which turns the
traced graphs' ``aten.scaled_dot_product_attention`` into the ring over the cp ranks of the same stage
and their ``aten.arange`` of s/cp positions into the rank's global ones. The cp ranks of a stage run the
same schedule, so their rings meet action by action (a recomputation, in a split backward's weight pass
too, reruns the ring under the mode: ``runtime.selective``). With ℓ_{j,c} the mean loss over cp rank c's
tokens of micro-batch j (every rank the same count), the dp wrapper over the dp·cp ranks ("dp_cp") and
the schedule's 1/m give::

    g = (1/(dp·cp·m)) Σ_{replica, c, j} ∇ℓ_{j,c} = ∇ ℓ(B)

and ``global_mean_loss`` averages the same ℓ_{j,c} over every rank holding the last stage.

Loss parallelism (``PipelineStages.vocabulary_mesh``). The last stage's output projection keeps its local rows
of the weight and returns rank k's vocabulary shard of the logits, z[..., k·V/t:(k+1)·V/t] (the local form of
``colwise-loss-parallel``: no gather). The schedule's loss sees that shard as the DTensor of the whole logits,
``Shard(-1)`` over the tp mesh (``vocabulary_shards``), and ``schedule.step`` runs under torch's
``loss_parallel()``, so the cross-entropy and its backward run on the shards (``runtime.train_step`` module doc:
three all-reduces of one fp32 number per token), as torchtitan's pipelines run it: no rank holds whole logits.
ℓ_j comes back a replicated DTensor; its local value (the same on every tp rank) is what the schedule's backward
starts from and what ``global_mean_loss`` averages. Beside cp the logits are a cp rank's tokens' and ℓ_{j,c} their
mean, as without loss parallelism; the loss's forward calls no ``torch.arange`` and its backward runs outside the
ring's function mode (autograd runs it where no function mode is active: ``runtime.selective``), so no row index of
the vocabulary-parallel backward is taken for a position (checked with one sample per micro-batch, where the rows
number as the rank's tokens: tests/e2e/test_context_parallel.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
    SplitPoint,
    pipeline,
)
from torch.distributed.pipelining._IR import Pipe
from torch.distributed.pipelining.stage import _PipelineStageBase
from torch.distributed.tensor import DTensor
from torch.export.unflatten import InterpreterModule
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import GraphExecGroup

from autoshard.errors import AutoshardError
from autoshard.ir.decisions import ZERO_BUBBLE_SCHEDULES
from autoshard.runtime.context_parallel import context_parallel, take_sequence_shard
from autoshard.runtime.grad_regions import check_balanced, inline_grad_mode_regions
from autoshard.runtime.loss_shards import local_loss
from autoshard.runtime.loss_shards import vocabulary_shards as loss_on_shards
from autoshard.runtime.model import no_decay_names
from autoshard.runtime.pipeline_skips import make_transfers_contiguous, route_skipped_values
from autoshard.runtime.stage_state import attach, drop_unused_state, unread_state_homes

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "interleaved-zb": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
MULTI_STAGE_SCHEDULES = {"interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev"}
PLACEMENTS = ("loop", "v")  # stage_indices
V_PLACED_SCHEDULES = {"zbv", "dualpipev"}  # torch's V schedules: stages r and 2·pp − 1 − r on rank r


@dataclass(frozen=True)
class SequenceShard:
    """Context parallelism inside the stages (module doc, "CP × PP"): the mesh dim ``axis`` whose ranks each
    take 1/cp of every sample's ``tokens_per_sample`` tokens."""

    mesh: object  # DeviceMesh
    axis: str
    tokens_per_sample: int

    def cut(self, inputs: tuple, targets):
        """This rank's chunk of every tensor whose dim 1 holds the tokens (``take_sequence_shard``)."""
        return take_sequence_shard(inputs, targets, self.mesh, self.axis, self.tokens_per_sample)

    def ring(self):
        """The mode the schedule runs under: attention as a ring over the axis, positions made global."""
        return context_parallel(self.mesh, self.axis, self.tokens_per_sample)


@dataclass(frozen=True)
class TiedCopies:
    """The copies of one tied parameter held on this rank, and the group that sums their gradients."""

    copies: list[tuple[int, str]]  # (position in PipelineStages.stages, parameter name in that module)
    group: dist.ProcessGroup | None


@dataclass
class PipelineStages:
    """This rank's part of the pipeline: its stages and the tied copies among them."""

    stages: list[_PipelineStageBase]
    pp_size: int
    pp_group: dist.ProcessGroup | None
    output_spec: pytree.TreeSpec  # the model's output structure, to rebuild it for loss_fn
    state_names: frozenset[str]  # the original model's state-dict names
    tied: list[TiedCopies] = field(default_factory=list)
    tp_shard_dims: dict[str, int] = field(default_factory=dict)  # TP inside stages: name -> split dim
    tp_group: dist.ProcessGroup | None = None
    aliases: tuple[tuple[str, ...], ...] = ()  # state names of one tensor (BERT's decoder.bias and bias)
    placement: str = "loop"  # PLACEMENTS: which stages each rank holds (stage_indices)
    # Expert shards the dp wrapper leaves alone, and the group of the dp / ep ranks holding the same ones,
    # which averages their gradients after the schedule (``sync_expert_grads``; set by the dp wrapper).
    expert_replicas: tuple[tuple[nn.Parameter, ...], dist.ProcessGroup | None] = ((), None)
    # 0-d parameters the dp wrapper leaves whole (FSDP2 cannot shard them), and the dp group that averages
    # their gradients after the schedule (``sync_replicated_grads``; set by the dp wrapper).
    dp_replicated: tuple[tuple[nn.Parameter, ...], dist.ProcessGroup | None] = ((), None)
    # The names of the parameters that take no weight decay (norms', biases, embeddings'), found by module type
    # on the whole model: a stage's graph module has lost the types (``model.no_decay_names``)
    no_decay: frozenset[str] = frozenset()
    sequence: SequenceShard | None = None  # context parallelism inside the stages; None: whole samples
    # Loss parallelism (module doc, "Loss parallelism"): the tp DeviceMesh the last stage's logits are sharded over
    # on the vocabulary; None: the last stage hands the loss whole logits
    vocabulary_mesh: object = None

    @property
    def modules(self) -> list[nn.Module]:
        return [stage.submod for stage in self.stages]

    @property
    def has_first(self) -> bool:
        return any(stage.is_first for stage in self.stages)

    @property
    def has_last(self) -> bool:
        return any(stage.is_last for stage in self.stages)

    @property
    def reads(self) -> bool:
        """This rank reads batches: its stages take the inputs (the first) or the targets (the last)."""
        return self.has_first or self.has_last

    def parameters(self) -> list[nn.Parameter]:
        """Every local parameter once (for the optimizer)."""
        seen: dict[int, nn.Parameter] = {}
        for module in self.modules:
            for p in module.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())


def stage_indices(pp_rank: int, pp_size: int, virtual_stages: int, placement: str = "loop") -> list[int]:
    """Looped placement: rank r holds stages r, r + pp, r + 2·pp, ...; V placement (v = 2): r and 2·pp − 1 − r."""
    if placement not in PLACEMENTS:
        raise AutoshardError(f"unknown stage placement {placement!r}; use one of {', '.join(PLACEMENTS)}")
    if placement == "v":
        if virtual_stages != 2:
            raise AutoshardError(
                f"the V placement puts exactly 2 stages on each rank, not {virtual_stages}; "
                f"use virtual_stages 2 or the loop placement"
            )
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + k * pp_size for k in range(virtual_stages)]


def build_pipeline_stages(
    model: nn.Module,
    example_microbatch_inputs: tuple,
    split_points: list[str],
    pp_rank: int,
    pp_size: int,
    virtual_stages: int,
    device: torch.device,
    pp_group: dist.ProcessGroup | None = None,
    tp_shard_dims: dict[str, int] | None = None,
    tp_group: dist.ProcessGroup | None = None,
    placement: str = "loop",
    sequence: SequenceShard | None = None,
    vocabulary_mesh=None,
) -> PipelineStages:
    """Split ``model`` before each of ``split_points`` and build this rank's stages.

    ``example_microbatch_inputs`` must have the micro-batch shape used at run time (the
    stages' send/receive buffers are sized from it). Non-tied stages share ``model``'s
    parameter objects; drop ``model`` afterwards and train the stages. With tensor parallelism
    the model is already sharded (``tensor_parallel_stages.shard_for_tracing``, which returns
    ``tp_shard_dims``), by which checkpoints save each shard as part of its whole tensor.
    ``placement`` is "loop" or "v" (module doc, ``stage_indices``). With ``sequence`` (context parallelism)
    ``example_microbatch_inputs`` is this rank's token chunk already (module doc, "CP × PP"). With a
    ``vocabulary_mesh`` (the tp mesh) the model's output is its vocabulary shard, and the loss runs on the shards
    (module doc, "Loss parallelism").
    """
    num_stages = pp_size * virtual_stages
    if len(split_points) != num_stages - 1:
        raise AutoshardError(
            f"pp={pp_size} x {virtual_stages} virtual stages needs {num_stages - 1} split points, "
            f"got {len(split_points)}: {split_points}"
        )
    state_names = frozenset(model.state_dict())
    no_decay = no_decay_names(model)
    pipe = split_model(model, example_microbatch_inputs, split_points)
    output_spec = pipe.model_output_spec
    if pipe.num_stages != num_stages:
        raise AutoshardError(
            f"splitting at {split_points} gave {pipe.num_stages} stages, not {num_stages}; "
            f"name modules that run in order, each once"
        )
    local = stage_indices(pp_rank, pp_size, virtual_stages, placement)
    unread = unread_state_homes(model, pipe)
    for index in local:
        drop_unused_state(pipe.get_stage_module(index))
        for name, tensor in unread.get(index, []):
            attach(pipe.get_stage_module(index), name, tensor)
    stages = [pipe.build_stage(index, device, pp_group) for index in local]
    owner = {index: r for r in range(pp_size) for index in stage_indices(r, pp_size, virtual_stages, placement)}
    tied = _local_tied_copies(pipe, local, owner, pp_size, pp_group)
    return PipelineStages(
        stages,
        pp_size,
        pp_group,
        output_spec,
        state_names,
        tied,
        dict(tp_shard_dims or {}),
        tp_group,
        state_aliases(model),
        placement,
        no_decay=no_decay,
        sequence=sequence,
        vocabulary_mesh=vocabulary_mesh,
    )


def state_aliases(model: nn.Module) -> tuple[tuple[str, ...], ...]:
    """The groups of state names that name one tensor (a stage keeps one name of each)."""
    names: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(tensor), []).append(name)
    return tuple(tuple(group) for group in names.values() if len(group) > 1)


def split_model(model: nn.Module, example_inputs: tuple, split_points: list[str]):
    """``pipeline()`` with a stage beginning at each of ``split_points``.

    ``pipeline()`` cannot split a graph holding a ``torch.no_grad()`` region (export keeps it
    as a ``wrap_with_set_grad_enabled`` higher-order op whose body the splitter cuts off from
    its module: HF Llama's rotary embedding fails at run time with StopIteration). Each region
    is inlined into the traced graph between calls that set the grad mode and put it back
    (``grad_regions``), before the split: exact whether it reads buffers only (rotary tables)
    or weights and activations (a sparse-attention indexer's scores), and no stage ends inside one.

    The first stage takes the model's inputs in the order they are fed (the order the traced
    graph's placeholders have: the declared one), whatever order its code reads them in.
    Values read more than one stage after the one making them, and model inputs read after
    the first stage, are passed through the stages in between, and every value crossing a
    boundary is made contiguous (``pipeline_skips``): torch's stages and schedules only send
    s → s + 1, hand the inputs to stage 0 only, and gloo sends only contiguous tensors.

    The pipe's ``model_output_spec`` is the pytree structure of the model's output as the
    export saw it: the last stage returns exactly its leaves.
    """
    with _traced_on_device(model, example_inputs) as (inputs, meta_of):
        pipe = _pipeline_once(model, inputs, split_points)
    check_balanced(pipe.split_gm, "the pipeline split")
    _back_to_meta(pipe, meta_of)
    _check_inputs_as_fed(pipe, example_inputs)
    one_parameter_per_tie(pipe, state_aliases(model))
    return run_generated_code(make_transfers_contiguous(route_skipped_values(pipe)))


def run_generated_code(pipe):
    """The stages' unflattened modules run their graphs' generated Python, not ``torch.fx.Interpreter``.

    ``pipeline()`` outlines each stage's module calls into ``torch.export.unflatten``'s ``InterpreterModule``s,
    which by default interpret their graph node by node in Python (``RUN_WITH_INTERPRETER``), a host cost per op
    that no SPMD program pays. The generated code runs the same ops in the same order. Measured in one process
    (GPT split in two, stage 0's forward and backward at micro-batch 4, ``benchmarks/experiments/stage_recompute_cost.py``'s
    setting): 11.1 → 6.3 ms without recompute, 28.6 → 11.3 ms selective, 18.3 → 12.1 ms full.
    ``runtime.stage_recompute`` re-finalizes a module whose graph it edits, so its generated code follows. A module
    whose graph names a value ``self`` stays interpreted: the generated code assigns it to a local ``self`` and then
    reads the module's next child from that value (transformers' BERT attention, whose child is called ``self``:
    ``self = self.self(...)``, then ``self.output(...)``)."""
    for module in pipe.split_gm.modules():
        if isinstance(module, InterpreterModule) and all(node.name != "self" for node in module.graph.nodes):
            module._run_with_interpreter = False
    return pipe


@contextmanager
def _traced_on_device(model: nn.Module, example_inputs: tuple):
    """A model on the meta device is traced as if on the inputs' device: its meta tensors stand in as fake
    tensors there (``FakeTensorMode``, the mode export then traces in, the inputs made fake in it too).

    A trace on meta would record the code paths models take for the meta device: transformers' experts pick
    ``histc`` on integers for any device but CPU, which CPU then cannot run. Yields the fake inputs and, for
    each stand-in, the meta tensor it stands for (``_back_to_meta``); the model gets its own tensors back.
    A model with no meta tensor is traced as it is."""
    if not any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        yield example_inputs, {}
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    device = example_inputs[0].device
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    stand_in: dict[int, torch.Tensor] = {}
    meta_of: dict[int, torch.Tensor] = {}
    swapped = []
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in list(table.items()):
                if tensor is None or not tensor.is_meta:
                    continue
                if id(tensor) not in stand_in:
                    with mode:
                        fake = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
                    if isinstance(tensor, nn.Parameter):
                        fake = nn.Parameter(fake, requires_grad=tensor.requires_grad)
                    stand_in[id(tensor)], meta_of[id(fake)] = fake, tensor
                swapped.append((table, name, tensor))
                table[name] = stand_in[id(tensor)]
    try:
        yield tuple(mode.from_tensor(t) for t in example_inputs), meta_of
    finally:
        for table, name, tensor in swapped:
            table[name] = tensor


def _back_to_meta(pipe, meta_of: dict[int, torch.Tensor]) -> None:
    """Each stage holds the model's meta tensors again where the trace held their stand-ins; a copy the split
    made of one (a weight tied across stages) becomes a meta tensor of its own, one per copy."""
    from torch._subclasses.fake_tensor import FakeTensor

    made: dict[int, torch.Tensor] = {}
    for module in pipe.split_gm.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in list(table.items()):
                if not isinstance(tensor, FakeTensor) and not isinstance(getattr(tensor, "data", None), FakeTensor):
                    continue
                if id(tensor) not in made:
                    meta = meta_of.get(id(tensor))
                    if meta is None:
                        meta = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
                        if isinstance(tensor, nn.Parameter):
                            meta = nn.Parameter(meta, requires_grad=tensor.requires_grad)
                    made[id(tensor)] = meta
                table[name] = made[id(tensor)]


def _check_inputs_as_fed(pipe, example_inputs: tuple) -> None:
    """The traced graph's placeholders are the inputs as the schedule feeds them: one per input, in order.

    ``pipeline_skips`` orders the first stage's inputs by these placeholders; a graph whose inputs
    did not match the positional inputs one to one (shape and dtype) would have them fed to the wrong ones.
    """
    roots = [node for node in pipe.split_gm.graph.nodes if node.op == "placeholder"]
    traced = [
        (tuple(v.shape), v.dtype) if isinstance(v := node.meta.get("val"), torch.Tensor) else None for node in roots
    ]
    fed = [(tuple(t.shape), t.dtype) for t in example_inputs]
    if len(roots) != len(fed) or any(t is not None and t != f for t, f in zip(traced, fed)):
        raise AutoshardError(
            f"the pipeline's traced inputs {[node.name for node in roots]} "
            f"({', '.join(f'{t[1]} {list(t[0])}' if t else '?' for t in traced)}) are not the "
            f"{len(fed)} inputs fed ({', '.join(f'{d} {list(s)}' for s, d in fed)}), in order; "
            f"give forward() each example input as a positional argument"
        )


def one_parameter_per_tie(pipe, aliases: tuple[tuple[str, ...], ...]) -> None:
    """Inside each stage, every name of one tied weight names one parameter again.

    ``pipeline()`` gives a stage a copy of a weight tied across stages under one of its names
    (``Pipe.replicated_params``) but may leave the stage's other names of it on another object
    (T5's ``encoder.embed_tokens`` copied, ``decoder.embed_tokens`` not): the two would each get
    part of the gradient and drift apart. All names then take the listed copy (else the first).
    """
    listed = {(sub, name) for uses in pipe.replicated_params for sub, name in uses.items()}
    for sub, module in pipe.split_gm.named_children():
        held = dict(module.named_parameters(remove_duplicate=False))
        for group in aliases:
            names = [name for name in group if name in held]
            keep = next((name for name in names if (sub, name) in listed), names[0] if names else None)
            for name in names:
                if held[name] is not held[keep]:
                    parent_path, _, leaf = name.rpartition(".")
                    setattr(module.get_submodule(parent_path), leaf, held[keep])


def _pipeline_once(model: nn.Module, example_inputs: tuple, split_points: list[str]):
    exported = []
    try:
        with _recording_exports(exported), _no_stack_traces():
            pipe = pipeline(model, mb_args=example_inputs, split_spec={p: SplitPoint.BEGINNING for p in split_points})
        pipe.model_output_spec = exported[-1].call_spec.out_spec
        return pipe
    finally:  # pipeline() patches each split module's forward; undo it so the model can be split again
        for path in split_points:
            module = model.get_submodule(path)
            if "_orig_forward" in module.__dict__:
                module.forward = module.__dict__.pop("_orig_forward")


@contextmanager
def _no_stack_traces():
    """Export records no source stack trace per node (``torch.fx.config.do_not_emit_stack_traces``, torch >=
    2.13; a GPU machine's older build keeps them): the stages never read them, and recording them
    took about a quarter of the CPU time of splitting examples/gpt.py, on every rank of every pipeline program."""
    if not hasattr(torch.fx.config, "do_not_emit_stack_traces"):
        yield
        return
    before = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = before


@contextmanager
def _recording_exports(exported: list):
    """Keep the ``ExportedProgram`` that ``pipeline()`` traces (it drops it after splitting).

    Its ``call_spec.out_spec`` is the model's output structure without a second run of the
    model: a forward on fake tensors outside export takes other code paths (transformers' MoE
    experts call ``grouped_mm``, whose fake kernel takes only bf16, where export's trace takes
    a fallback). Its grad-mode regions are inlined there, before ``pipeline()`` splits it (``split_model``).
    """
    original = Pipe.__dict__["_trace_with_export"]

    def recording(mod, *args, **kwargs):
        program = original.__func__(mod, *args, **kwargs)
        inline_grad_mode_regions(program.graph_module)
        root_module_stacks(program.graph, {name for name, _ in mod.named_modules(remove_duplicate=False)})
        exported.append(program)
        return program

    Pipe._trace_with_export = staticmethod(recording)
    try:
        yield
    finally:
        Pipe._trace_with_export = original


def root_module_stacks(graph: torch.fx.Graph, modules: set[str]) -> None:
    """Each node's record of the module calls it ran (``nn_module_stack``) with every path rooted at the model, in
    place. ``pipeline()``'s trace can record a module by a path relative to the call holding it: OpenAI GPT's
    post-norm block, split at its start, calls ``self.attn`` first (``attn`` and ``attn.c_attn`` under
    ``transformer.h.1``), and its one activation module serves every layer's MLP (``mlp.act`` under
    ``transformer.h.1.mlp``). Its outlining then stops ("Child module 'attn' is not a descendant of parent module
    'transformer.h.1'"). Such a path is read under the nearest enclosing call where that makes a module of the model
    (``modules``: every name of every module, a shared one's included)."""
    for node in graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if not stack:
            continue
        rooted: list[str] = []
        for key, (path, kind) in list(stack.items()):
            parent = rooted[-1] if rooted else ""
            if path and parent and path != parent and not path.startswith(parent + "."):
                path = next((f"{a}.{path}" for a in reversed(rooted) if a and f"{a}.{path}" in modules), path)
                stack[key] = (path, kind)
            rooted.append(path)


def _local_tied_copies(pipe, local: list[int], owner: dict[int, int], pp_size: int, pp_group) -> list[TiedCopies]:
    """For each parameter ``pipeline()`` replicated over stages, the copies this rank holds.

    The sum runs over the pp ranks holding a copy (``owner``: each stage's pp rank): the whole pp
    group when that is all of it (pp = 2, looped), else a subgroup made only by its members
    (``use_local_synchronization``): in a V the first and the last stage's copies are both on rank 0.
    """
    stage_of = {id(pipe.get_stage_module(i)): i for i in range(pipe.num_stages)}
    ties = []
    for uses in pipe.replicated_params:  # {submodule name: parameter name in it}
        held = {stage_of[id(pipe.split_gm.get_submodule(sub))]: name for sub, name in uses.items()}
        holders = sorted({owner[index] for index in held})
        copies = [(local.index(index), name) for index, name in held.items() if index in local]
        if copies:
            ties.append(TiedCopies(copies, _holders_group(holders, pp_size, pp_group)))
    return ties


def _holders_group(holders: list[int], pp_size: int, pp_group):
    if len(holders) == pp_size:
        return pp_group
    pp_ranks = dist.get_process_group_ranks(pp_group) if pp_group is not None else list(range(pp_size))
    return dist.new_group([pp_ranks[r] for r in holders], use_local_synchronization=True)


def make_torch_schedule(parts: PipelineStages, n_microbatches: int, loss_fn: Callable, schedule: str):
    """torch's schedule named ``schedule`` (``SCHEDULES``) over the local stages; gradients are the mean
    over micro-batches. The zero-bubble ones (interleaved-zb, zbv, dualpipev) split each stage's backward
    into the input's gradient and the weights' (``stage_backward_input`` / ``stage_backward_weight``);
    zbv and dualpipev need the stages placed in a V (``stage_indices``).

    ``loss_fn(outputs, targets)`` sees the model's own output structure (e.g. a Hugging Face
    ``CausalLMOutput``), rebuilt from the last stage's flat tensors.
    """
    if schedule not in SCHEDULES:
        raise AutoshardError(f"unknown pipeline schedule '{schedule}'; use one of {', '.join(SCHEDULES)}")
    multi = schedule in MULTI_STAGE_SCHEDULES
    if multi != (len(parts.stages) > 1):
        raise AutoshardError(
            f"schedule '{schedule}' with {len(parts.stages)} stage(s) per rank: "
            f"{', '.join(sorted(MULTI_STAGE_SCHEDULES))} need virtual_stages > 1, gpipe and 1f1b "
            f"need exactly 1"
        )
    if (schedule in V_PLACED_SCHEDULES) != (parts.placement == "v"):
        want = "v" if schedule in V_PLACED_SCHEDULES else "loop"
        raise AutoshardError(
            f"schedule '{schedule}' runs stages placed '{want}', but this rank's were placed "
            f"'{parts.placement}'; split with placement='{want}'"
        )
    stage_loss = _structured_loss(loss_fn, parts.output_spec, parts.vocabulary_mesh)
    stages = parts.stages if multi else parts.stages[0]
    if parts.placement == "v":
        for stage in parts.stages:
            _skip_own_rank_in_warmup(stage)
    for stage in parts.stages if schedule in ZERO_BUBBLE_SCHEDULES else ():
        _prepare_split_backward(stage)
    return SCHEDULES[schedule](stages, n_microbatches, loss_fn=stage_loss, scale_grads=True)


def _skip_own_rank_in_warmup(stage: _PipelineStageBase) -> None:
    """The V's tip holds stages pp − 1 and pp on one rank: the schedules send nothing between them, but
    the stages' first-step handshake (``_get_init_p2p_neighbors_ops``) would send to the rank itself,
    which gloo refuses ("Pair is not connected"). Leave those out: the two ends of each are on this rank."""
    neighbour_ops = stage._get_init_p2p_neighbors_ops

    def ops_to_other_ranks() -> list[dist.P2POp]:
        return [op for op in neighbour_ops() if op.group_peer != stage.group_rank]

    stage._get_init_p2p_neighbors_ops = ops_to_other_ranks


def _prepare_split_backward(stage: _PipelineStageBase) -> None:
    """``_keep_passed_inputs_needing_grad`` and ``_recompute_once_per_weight_pass``, once per stage: a second
    schedule over the same stages would nest the weight pass's groups, which torch refuses."""
    if getattr(stage, "_autoshard_split_backward", False):
        return
    _keep_passed_inputs_needing_grad(stage)
    _recompute_once_per_weight_pass(stage)
    stage._autoshard_split_backward = True


def _keep_passed_inputs_needing_grad(stage: _PipelineStageBase) -> None:
    """A stage that passes an input on unchanged (transformers' rotary ``cos`` / ``sin``, a value routed past
    it: ``pipeline_skips``) outputs the input tensor itself, and a split backward's input pass
    (``stage_backward_input``) ends with ``detach_()`` on every output: the input, a leaf, stops needing a
    gradient. The weight pass then reruns a checkpointed block on an input that no longer needs one, autograd
    saves fewer tensors than the forward did, and checkpoint raises ``CheckpointError`` (Llama with 8 layers
    at pp 4 under zbv: 43 saved, 39 recomputed, one fewer per ``q * cos``-like product). The inputs that
    needed a gradient before the input pass need it again after; nothing reads their ``requires_grad``
    between the two passes but the weight pass's rerun."""
    input_pass = stage.backward_one_chunk

    def input_pass_keeping_inputs(bwd_chunk_id: int, *args, **kwargs):
        _, inputs = stage.fwd_cache.get(bwd_chunk_id, (None, ()))
        leaves = [
            t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf
        ]
        result = input_pass(bwd_chunk_id, *args, **kwargs)
        for leaf in leaves:
            if not leaf.requires_grad:
                leaf.requires_grad_(True)
        return result

    stage.backward_one_chunk = input_pass_keeping_inputs


def _recompute_once_per_weight_pass(stage: _PipelineStageBase) -> None:
    """A zero-bubble schedule's weight pass (``backward_weight_one_chunk``: ``stage_backward_weight``) makes one
    ``autograd`` call per parameter group, and a block under non-reentrant checkpointing reruns its forward in
    each call: 1 + g reruns per micro-batch with the input pass, g the block's ops that read a parameter
    (``benchmarks/experiments/split_backward_recompute.py``: 8 for each GPT block). Under one ``GraphExecGroup`` the calls
    share one rerun, so a block reruns twice (once per pass). The groups' calls never unpack one saved tensor
    twice (each op's weight gradient reads its own saved inputs); if a model's ever did, checkpoint raises
    ``CheckpointError`` rather than computing a wrong gradient. Schedules that never split the backward never
    call it."""
    weight_pass = stage.backward_weight_one_chunk

    def weight_pass_in_one_group(bwd_chunk_id: int, last_backward: bool = False) -> None:
        with GraphExecGroup():
            weight_pass(bwd_chunk_id, last_backward=last_backward)

    stage.backward_weight_one_chunk = weight_pass_in_one_group


def _structured_loss(loss_fn: Callable, output_spec: pytree.TreeSpec, vocabulary_mesh=None) -> Callable:
    """The schedule's loss: ``loss_fn`` on the model's output structure rebuilt from the last stage's tensors; with
    a ``vocabulary_mesh`` (module doc, "Loss parallelism") on the logits' vocabulary shards, its local value."""

    def stage_loss(stage_output, targets):
        flat = list(stage_output) if isinstance(stage_output, (tuple, list)) else [stage_output]
        if vocabulary_mesh is None:
            return loss_fn(pytree.tree_unflatten(flat, output_spec), targets)
        shards = vocabulary_shards(flat, vocabulary_mesh)
        return local_loss(loss_fn(pytree.tree_unflatten(shards, output_spec), targets), True)

    return stage_loss


def vocabulary_shards(flat: list, tp_mesh) -> list:
    """The last stage's one output, this rank's vocabulary shard of the logits, as the DTensor of the whole logits
    sharded on its last dim over ``tp_mesh`` (what DTensor's ``ColwiseParallel(output_layouts=Shard(-1))`` hands
    the loss in an SPMD plan); an output of more tensors than the logits is refused."""
    from torch.distributed.tensor import Shard

    tensors = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor)]
    if len(tensors) != 1:
        raise AutoshardError(
            f"loss parallelism: the last stage outputs {len(tensors)} tensors, not the logits alone; the model's "
            f"output is not what the plan proved; re-plan with --loss-parallel off"
        )
    i = tensors[0]
    shard = DTensor.from_local(flat[i], tp_mesh, [Shard(flat[i].dim() - 1)], run_check=False)
    return [*flat[:i], shard, *flat[i + 1 :]]


def pipeline_step(schedule, parts: PipelineStages, inputs: tuple, targets: torch.Tensor) -> float:
    """One forward/backward of this rank's batch through the pipeline; returns the global mean loss.

    ``inputs`` and ``targets`` are this dp replica's batch (the schedule splits it into
    micro-batches); only the first stage reads inputs and only the last reads targets. With context
    parallelism (``parts.sequence``) this rank keeps its chunk of every sample's tokens and the schedule
    runs the ring (module doc, "CP × PP").
    Gradients are left summed over tied copies, ready for ``optimizer.step()``.
    """
    losses: list[torch.Tensor] = []
    if parts.sequence is not None:
        inputs, targets = parts.sequence.cut(tuple(inputs), targets)
    args = inputs if parts.has_first else ()
    kwargs = {"target": targets, "losses": losses} if parts.has_last else {}
    with (
        parts.sequence.ring() if parts.sequence is not None else nullcontext(),
        loss_on_shards(parts.vocabulary_mesh is not None),  # the loss's forward and backward, inside the schedule
    ):
        schedule.step(*args, **kwargs, return_outputs=False)  # the losses suffice; merging 0-d outputs would fail
    sync_tied_grads(parts)
    sync_expert_grads(parts)
    sync_replicated_grads(parts)
    return global_mean_loss(losses, parts)


def sync_expert_grads(parts: PipelineStages) -> None:
    """Expert shards (``expert_parallel``), which the stages' dp wrapper leaves alone: their gradients
    averaged over the dp / ep ranks holding the same experts, as the wrapper averages the rest over dp
    (the dispatch already scaled them by 1/ep). Nothing to do when dp = ep."""
    _average_grads(*parts.expert_replicas)


def sync_replicated_grads(parts: PipelineStages) -> None:
    """0-d parameters, which the stages' dp wrapper leaves whole: their gradients averaged over dp, as the
    wrapper averages the rest. After ``sync_tied_grads``: a tied copy's gradient is its ties' sum."""
    _average_grads(*parts.dp_replicated)


def _average_grads(params: tuple[nn.Parameter, ...], group: dist.ProcessGroup | None) -> None:
    """Each gradient of ``params`` averaged over ``group``, in one flat all-reduce."""
    if group is None or dist.get_world_size(group) == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        flat = torch.cat([g.reshape(-1) for g in grads])  # one collective per step, not one per tensor
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat /= dist.get_world_size(group)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


def sync_tied_grads(parts: PipelineStages) -> None:
    """g_tied = Σ over the stages holding a copy; every copy then takes the same step."""
    for tie in parts.tied:
        grads = [_local_grad(parts.stages[pos].submod.get_parameter(name)) for pos, name in tie.copies]
        total = torch.stack(grads).sum(0)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=tie.group)
        for grad in grads:
            grad.copy_(total)


def _local_grad(param: nn.Parameter) -> torch.Tensor:
    assert param.grad is not None, "a tied copy got no gradient"
    grad = param.grad
    return grad.to_local() if isinstance(grad, DTensor) else grad


def global_mean_loss(losses: list[torch.Tensor], parts: PipelineStages) -> float:
    """(Σ ℓ_j) / (dp·m) over every replica's micro-batches; only last-stage ranks hold ℓ_j."""
    device = parts.stages[0].device
    local_sum = sum((loss.detach().double() for loss in losses), torch.zeros((), dtype=torch.float64))
    sum_and_count = torch.stack(
        [local_sum.to(device), torch.tensor(float(len(losses)), dtype=torch.float64, device=device)]
    )
    dist.all_reduce(sum_and_count, op=dist.ReduceOp.SUM)
    mean = sum_and_count[0] / sum_and_count[1]
    if is_fake(mean):  # a run on fake tensors for its memory (``autoshard.dryrun``): no value to read
        return math.nan
    return mean.item()
