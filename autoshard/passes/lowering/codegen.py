"""Codegen: Plan -> a readable training program, launchable with torchrun.

The program states the plan in its header and the decisions as constants, then prints the plan's
apply steps (``passes.lowering.lower``) as calls of the runtime's applier (``runtime.parallel``: apply_tp,
apply_ac, apply_fsdp, apply_ddp, build_optimizer, ...) in one ``parallelize`` (or ``build_pipeline``)
function, each with its reason as a comment; per-block decisions are folded over ``BLOCKS``. The
plan's layout (``passes.lowering.lower.layout``: the mesh, the axes that split the samples and the tokens, the
loss's axis, the sequence length) is printed as constants the training loop hands to the runtime.
The training recipe (``ir.recipe.Recipe``: optimizer, weight-decay groups, learning-rate schedule,
clipping) is printed as the ``RECIPE`` constant, one key a line: ``autoshard compile --recipe FILE`` and
its flags choose it, the program's ``--lr`` alone overrides it at run time. The loop is one of two fixed
texts, picked by the plan: SPMD (context parallelism included: its runtime calls do nothing without a
sequence axis) or a pipeline schedule; both clip after the backward (the pipeline's step) and step the
scheduler after the optimizer (``runtime.recipe``). No decision is made here:
``autoshard.parallelize`` runs the same steps through ``apply_steps`` on the same layout. The output
depends only on the plan and the recipe, so it is byte-stable.
"""

from __future__ import annotations

import hashlib
import re
import textwrap
from pathlib import Path

from autoshard.ir.decisions import TP_STYLES, cp_load_balanced, precision_policy
from autoshard.ir.plan import Plan
from autoshard.ir.plan_format import V_SCHEDULES
from autoshard.ir.recipe import Recipe
from autoshard.ir.steps import RESULTS, RUN_INPUTS, WHOLE_MESH, Layout, Step
from autoshard.passes.lowering.lower import dp_ranks, layout, lower, recompute_modes

MIB = 2**20


def emit_program(
    plan: Plan, program: str = "train.py", plan_file: str = "plan.json", recipe: Recipe | None = None
) -> str:
    """The whole program as Python source; its header's run commands name ``program`` (the file it is written
    to) and ``plan_file`` (the plan it comes from), as the user would type them; it trains with ``recipe``
    (None: ``Recipe()``, the defaults), printed as its ``RECIPE`` constant."""
    steps, spec, pipeline = lower(plan), layout(plan), plan.mesh.pp > 1
    body = _build_pipeline(plan, steps) if pipeline else _parallelize(plan, steps)
    main = _MAIN_PIPELINE if pipeline else _spmd_main(spec, plan.decisions.offloaded, plan.decisions.compile_loss)
    parts = [
        _header(plan, program, plan_file),
        _imports(plan, steps),
        _constants(plan, spec),
        recipe_constant(recipe or Recipe()),
        body,
        _ARGS,
        main,
    ]
    return "\n\n\n".join(p.strip("\n") for p in parts) + "\n"


def torchrun_command(plan: Plan, program: str = "train.py") -> str:
    nodes = plan.cluster.get("nodes", 1)
    per_node = plan.world_size // nodes
    if nodes == 1:
        return f"torchrun --standalone --nproc-per-node {per_node} {program}"
    return (
        f"torchrun --nnodes {nodes} --nproc-per-node {per_node} --rdzv-backend c10d "
        f"--rdzv-endpoint $MASTER_ADDR:29500 --rdzv-id $JOB_ID {program}"
    )


def emit_sbatch(plan: Plan, program: str = "train.py") -> str:
    """A SLURM batch script that starts ``program`` on the plan's nodes: one task per node runs
    torchrun (``torchrun_command``), the first node of the allocation hosts the c10d rendezvous."""
    nodes = plan.cluster.get("nodes", 1)
    per_node = plan.world_size // nodes
    gpus = f"#SBATCH --gpus-per-node={per_node}\n" if plan.cluster.get("backend") == "nccl" else ""
    return f"""#!/bin/bash
# SLURM batch script emitted by autoshard for plan {plan_digest(plan)}: {nodes} node(s) x {per_node} ranks.
# Submit: sbatch {Path(program).with_suffix(".sbatch").name} [--steps 1000 --checkpoint-dir ckpt]
#SBATCH --job-name=autoshard-{plan_digest(plan)}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
{gpus}#SBATCH --exclusive
set -euo pipefail
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
JOB_ID=$SLURM_JOB_ID
export MASTER_ADDR JOB_ID
srun {torchrun_command(plan, program)} "$@"
"""


def plan_digest(plan: Plan) -> str:
    return hashlib.sha256(plan.to_json().encode()).hexdigest()[:12]


def blocks_expression(blocks: tuple[str, ...]) -> str:
    """``[f"h.{i}" for i in range(12)]`` when the blocks are one numbered run, else the list."""
    if not blocks:
        return "[]"
    match = [re.fullmatch(r"(.*\.)?(\d+)", b) for b in blocks]
    prefixes = {m.group(1) if m else None for m in match}
    if len(prefixes) == 1 and None not in prefixes and all(m for m in match):
        numbers = [int(m.group(2)) for m in match]
        if numbers == list(range(len(numbers))):
            prefix = prefixes.pop() or ""
            return f'[f"{prefix}{{i}}" for i in range({len(numbers)})]'
    return "[" + ", ".join(repr(b) for b in blocks) + "]"


def ms_text(seconds: float) -> str:
    """Milliseconds as a reader wants them: three significant digits below 100 ms ("1.58", "0.0426"), whole
    milliseconds with thousands separators from there ("13,100", never "1.31e+04"), "0" below a microsecond."""
    ms = seconds * 1e3
    if ms >= 100:
        return f"{ms:,.0f}"
    return f"{ms:.3g}" if ms >= 1e-3 else "0"


def _header(plan: Plan, program: str, plan_file: str) -> str:
    p, c, m = plan.predicted, plan.cluster, plan.model
    mem = p.memory
    return f'''#!/usr/bin/env python3
"""Training program emitted by autoshard from plan {plan_digest(plan)}.

Model      {m["spec"]}  ({m["params"]:,} parameters, {m["layers"]} blocks, fingerprint {m["hash"]})
Cluster    {c["name"]}: {c["nodes"]} node(s) x {c["devices_per_node"]} devices, {c["backend"]}
{_groups_lines(c)}Plan       {plan.mesh} | ZeRO-{plan.zero_stage} | global batch {plan.global_batch} = {plan.mesh.dp} dp ranks x {plan.num_microbatches} micro-batches x {plan.microbatch_size} | recompute {plan.recompute}
Predicted  step {ms_text(p.step_time_s)} ms = compute {ms_text(p.compute_s)} ms + exposed comm {ms_text(p.comm_exposed_s)} ms + bubble {ms_text(p.bubble_s)} ms
           peak {mem.peak_bytes / MIB:,.1f} MiB per rank (weights {mem.params_bytes / MIB:,.1f}, grads {mem.grads_bytes / MIB:,.1f}, optimizer {mem.optimizer_bytes / MIB:,.1f}, activations {mem.activations_bytes / MIB:,.1f}, transient {mem.transient_bytes / MIB:,.1f})
           {p.tokens_per_s:,.0f} tokens/s, MFU {p.mfu:.1%}{_offload_line(plan)}

Run:  {torchrun_command(plan, program)} [--steps 20]
  or: autoshard run {plan_file}
"""'''


def _groups_lines(cluster: dict) -> str:
    """A cluster of node groups: which node ranks (torchrun's --node-rank) each group's nodes must be launched
    as, since a pipeline stage runs on the group that holds its ranks; "" on a homogeneous cluster."""
    groups, first = cluster.get("groups") or (), 0
    parts = []
    for g in groups:
        last = first + g["nodes"] - 1
        nodes = f"node rank {first}" if last == first else f"node ranks {first}-{last}"
        parts.append(f"{g['name']} ({g['device']['name']}) as {nodes}")
        first = last + 1
    return f"Groups     {'; '.join(parts)}\n" if parts else ""


def _offload_line(plan: Plan) -> str:
    """The header's line for host offload: the state a node's host memory holds; nothing without offload."""
    if not plan.decisions.offloaded:
        return ""
    host = plan.predicted.host_memory_bytes_per_node
    size = f"{host / 2**30:,.1f} GiB" if host >= 2**30 else f"{host / 2**20:,.1f} MiB"
    return (
        f"\nOffload    parameters, gradients and optimizer state on the host (FSDP2 CPUOffloadPolicy): "
        f"{size} per node; the optimizer steps on the CPU"
    )


def _imports(plan: Plan, steps: tuple[Step, ...]) -> str:
    ops = ", ".join(sorted({step.op for step in steps}))
    local = "from autoshard.runtime import checkpoint"
    if plan.mesh.pp > 1:
        local += "\nfrom autoshard.runtime import pipeline_parallel as pp"
    return (
        f"import argparse\nimport math\n\n"
        f"from autoshard import runtime\n{local}\nfrom autoshard.runtime.parallel import {ops}\n"
        f"from autoshard.runtime.recipe import Recipe, build_scheduler, clip_grad_norm\n"
    )


def _placement_constant(plan: Plan) -> str:
    """The V placement's line, each rank's stages spelled out; "" for the looped placement (r, r + pp, ...)."""
    if plan.schedule not in V_SCHEDULES:
        return ""
    held = ", ".join(f"rank {r}: {r} and {2 * plan.mesh.pp - 1 - r}" for r in range(plan.mesh.pp))
    return f"PLACEMENT = 'v'  # stages in a V, rank r holds r and 2*PP-1-r ({held})\n"


# The source text of each tensor-parallel style (runtime.tensor_parallel.parallel_style builds the same row).
STYLE_SOURCE = {name: row.source for name, row in TP_STYLES.items()}


def _constants(plan: Plan, spec: Layout) -> str:
    pipeline = ""
    if plan.mesh.pp > 1:
        pipeline = (
            f"SCHEDULE = {plan.schedule!r}\n"
            f"VIRTUAL_STAGES = {plan.virtual_stages}  # pipeline stages per pp rank\n"
            f"{_placement_constant(plan)}"
            f"SPLIT_POINTS = {tuple(plan.split_points)!r}  # modules where stages 1.. begin\n"
        )
    return f"""
MODEL = {plan.model["spec"]!r}
MODEL_FINGERPRINT = {plan.model["hash"]!r}  # the program refuses a different model
SEQ_LEN = {spec.seq_len!r}  # {_seq_len_comment(spec)}
TOKENS_PER_SAMPLE = {spec.tokens_per_sample}
GLOBAL_BATCH = {plan.global_batch}
{_layout_constants(spec, pipeline=plan.mesh.pp > 1)}MICROBATCH_SIZE = {plan.microbatch_size}
NUM_MICROBATCHES = {plan.num_microbatches}  # GLOBAL_BATCH // (dp * MICROBATCH_SIZE)
PRECISION = {plan.precision!r}  # {_precision_comment(plan.precision)}
BLOCKS = {blocks_expression(plan.blocks)}  # repeated blocks: recompute and FSDP units
{pipeline}{_tp_constants(plan)}{_recompute_constants(plan)}{_expert_constants(plan)}{_float8_constants(plan)}\
{_predicted_constant(plan)}"""


def _predicted_constant(plan: Plan) -> str:
    """The plan's prediction, which each step's MFU and the run's closing table are measured against
    (``runtime.report.Prediction``)."""
    p = plan.predicted
    m = p.memory
    allocated = m.params_bytes + m.grads_bytes + m.optimizer_bytes + m.activations_bytes + m.transient_bytes
    peak_flops = float(plan.peak_tflops_per_rank) * 1e12
    return (
        f"PREDICTED = dict(step_time_s={p.step_time_s!r}, mfu={p.mfu!r}, peak_flops_per_s={peak_flops!r}, "
        f"devices={plan.world_size},\n"
        f"                 allocated_bytes={allocated}, memory_peak_bytes={p.memory_peak_bytes_per_rank})"
        f"  # the plan's step, per rank\n"
    )


# A word on the recipe's keys that need one (``ir.recipe.Recipe``'s fields, in their order).
RECIPE_COMMENTS = {
    "lr": "the peak learning rate; the program's --lr overrides it",
    "betas": "adam, adamw",
    "eps": "adam, adamw",
    "momentum": "sgd",
    "decay_all": "False: no weight decay on norms, biases, embeddings; True: on all",
    "schedule": "constant, linear or cosine decay to min_lr_ratio * lr",
    "warmup_steps": "linear warmup from lr / warmup_steps to lr",
    "min_lr_ratio": "the decay's floor, a fraction of lr",
    "max_grad_norm": "the whole model's gradient 2-norm clipped to this; None: no clipping",
    "steps": "the decay's length; None: the run's --steps",
}


def recipe_constant(recipe: Recipe) -> str:
    """``RECIPE = {...}``, one key a line (``Recipe.as_dict``: ``Recipe(**RECIPE)`` rebuilds it)."""
    lines = []
    for key, value in recipe.as_dict().items():
        comment = f"  # {RECIPE_COMMENTS[key]}" if key in RECIPE_COMMENTS else ""
        text = f'"{value}"' if isinstance(value, str) else repr(value)
        lines.append(f'    "{key}": {text},{comment}')
    return (
        "# The training recipe (runtime.recipe), written by autoshard compile --recipe FILE and its flags (an edit\n"
        "# here is lost at the next compile)\n"
        "RECIPE = {\n" + "\n".join(lines) + "\n}\n"
    )


def _seq_len_comment(spec: Layout) -> str:
    if spec.seq_len is None:
        return "handed to example_batch; None: the model file's own sequence length (no --seq-len)"
    return "tokens per sample, handed to example_batch (--seq-len)"


def _layout_constants(spec: Layout, pipeline: bool) -> str:
    """The layout's fields (``passes.lowering.lower.layout``) as the constants the loop hands to the runtime; a pipeline's
    loop reads the mesh and the data axis only, and its split the sequence axis where the plan has one."""
    sizes = dict(spec.mesh)
    mesh = "{" + ", ".join(f'"{name}": {ranks}' for name, ranks in spec.mesh) + "}"
    innermost = spec.mesh[-1][0]
    flatten = (
        "{" + ", ".join(f'"{name}": (' + ", ".join(f'"{d}"' for d in dims) + ")" for name, dims in spec.flatten) + "}"
    )
    joined = (
        "; ".join(
            f"{' x '.join(dims)} joined: the ranks holding the same parameters, gradients and the loss "
            f"averaged over them"
            for _, dims in spec.flatten
        )
        or "no dims joined"
    )
    others = [name for name, ranks in spec.mesh if name != spec.data_axis and ranks > 1]
    same = f"; the {' and '.join(others)} ranks of one {spec.data_axis} rank take the same ones" if others else ""
    text = (
        "# The device mesh and each rank's share of a global batch (passes.lowering.lower.layout)\n"
        f"MESH = {mesh}  # ranks along each dim, outermost first: {innermost} innermost (inside a node)\n"
        f"FLATTEN = {flatten}  # {joined}\n"
        f'DATA_AXIS = "{spec.data_axis}"  # its ranks take different samples{same}\n'
    )
    if pipeline and spec.sequence_axis is None:
        return text
    if spec.sequence_axis is None:
        sequence = "None  # no context parallelism: each rank takes whole samples"
    else:
        cp = sizes[spec.sequence_axis]
        chunks = "head-tail pairs of chunks" if cp_load_balanced(spec.tokens_per_sample, cp) else "contiguous chunks"
        sequence = (
            f'"{spec.sequence_axis}"  # context parallel: each sample\'s tokens split over its '
            f"{cp} ranks ({chunks}), attention as a ring"
        )
    if pipeline:  # the stages cut the tokens and run the ring (runtime.pipeline_parallel, "CP × PP")
        return text + f"SEQUENCE_AXIS = {sequence}\n"
    vocabulary = (
        "LOSS_PARALLEL = True  # the cross-entropy on the logits' vocabulary shards over tp (torch's loss_parallel)\n"
        if spec.loss_parallel
        else ""
    )
    return (
        text
        + f"SEQUENCE_AXIS = {sequence}\n"
        + f'LOSS_AXIS = "{spec.loss_axis}"  # the logged loss: the mean of its ranks\' losses\n'
        + vocabulary
    )


# The SPMD loop's call, and its form with loss parallelism (``runtime.train_step``: the loss and its backward
# under torch's loss_parallel)
_FORWARD_BACKWARD = "SEQUENCE_AXIS, TOKENS_PER_SAMPLE, PRECISION, scaler)"
_FORWARD_BACKWARD_LOSS_PARALLEL = (
    "SEQUENCE_AXIS, TOKENS_PER_SAMPLE, PRECISION, scaler,\n"
    "                                             loss_parallel=LOSS_PARALLEL)"
)


# The process group's start, and its form under host offload (gloo beside NCCL for the host's gradients)
_PARALLELIZE = "    model, optimizer = parallelize(model, mesh, ctx.device, recipe)\n"
_COMPILED_LOSS = (
    "    # The loss compiled (torch.compile, inductor): its fp32 upcast, log-softmax and nll fused, no fp32 copy of the\n"
    "    # logits kept for backward\n"
    "    loss_fn = runtime.compiled_loss(model_file.loss)\n"
)
_STEP_LOSS = "model_file.loss, mesh,"
_INIT = "timeout_s=args.timeout_s)\n"
_INIT_HOST = (
    "timeout_s=args.timeout_s,\n"
    "                                  host_collectives=True)  # offload: gloo for the gradients on the host\n"
)


def _spmd_main(spec: Layout, offloaded: bool = False, compile_loss: bool = False) -> str:
    """The SPMD loop; with loss parallelism its forward and backward take ``LOSS_PARALLEL``; with host offload its
    process group collectives on the host too (``runtime.init_distributed``); with the loss compiled
    (``runtime.compiled_loss``) the step calls the compiled loss."""
    main = _MAIN_SPMD
    if compile_loss:
        assert main.count(_PARALLELIZE) == 1 and main.count(_STEP_LOSS) == 1
        main = main.replace(_PARALLELIZE, _PARALLELIZE + _COMPILED_LOSS).replace(_STEP_LOSS, "loss_fn, mesh,")
    if offloaded:
        assert main.count(_INIT) == 1
        main = main.replace(_INIT, _INIT_HOST)
    if not spec.loss_parallel:
        return main
    assert main.count(_FORWARD_BACKWARD) == 1
    return main.replace(_FORWARD_BACKWARD, _FORWARD_BACKWARD_LOSS_PARALLEL)


def _expert_constants(plan: Plan) -> str:
    if plan.ep == 1:
        return ""
    return (
        f"EP = {plan.ep}  # expert parallel over EP adjacent dp ranks\n"
        f"EXPERTS = {blocks_expression(plan.experts)}  # mixture-of-experts groups split over EP ranks\n"
    )


def _float8_constants(plan: Plan) -> str:
    if not plan.float8_linears:
        return ""
    return (
        f'FLOAT8 = "{plan.decisions.float8}"  # torchao\'s float8 recipe (Float8LinearConfig.from_recipe_name)\n'
        f"# the linears made torchao Float8Linear: dims divisible by 16, not the output projection\n"
        f"FLOAT8_LINEARS = {linears_expression(plan.float8_linears, plan.blocks)}\n"
    )


def linears_expression(linears: tuple[str, ...], blocks: tuple[str, ...]) -> str:
    """``[f"{b}.{name}" for b in BLOCKS for name in (...)]`` when each block holds the same linears and nothing
    else is converted, else the list; one name a line where it is long."""
    if blocks:
        names = tuple(p.removeprefix(blocks[0] + ".") for p in linears if p.startswith(blocks[0] + "."))
        if names and tuple(f"{b}.{n}" for b in blocks for n in names) == tuple(linears):
            return (
                '[\n    f"{b}.{name}"\n    for b in BLOCKS\n    for name in ' + _quoted_lines(names, ("(", ")")) + "\n]"
            )
    return _quoted_lines(tuple(linears), ("[", "]"))


def _quoted_lines(names: tuple[str, ...], brackets: tuple[str, str]) -> str:
    """The names in double quotes between ``brackets``, on one line when short, else one a line."""
    quoted = [f'"{n}"' for n in names]
    one_line = brackets[0] + ", ".join(quoted) + ("," if len(quoted) == 1 and brackets[0] == "(" else "") + brackets[1]
    if len(one_line) <= 80:
        return one_line
    return brackets[0] + "\n" + "".join(f"        {q},\n" for q in quoted) + "    " + brackets[1]


def _precision_comment(precision: str) -> str:
    policy = precision_policy(precision)
    if policy.cast_dtype is not None:
        return (
            f"weights, gradients, optimizer state and compute in {policy.cast_dtype} (the model cast before "
            f"its fp32 initial weights are made: cast_params)"
        )
    if policy.autocast_dtype is None:
        return "weights, gradients and compute in the parameters' own dtype"
    return (
        f"{policy.param_dtype} compute (FSDP2 gathers {policy.param_dtype} weights; autocast elsewhere), "
        f"{policy.reduce_dtype} gradient reduction" + ", the loss scaled (GradScaler)" * policy.grad_scaler
    )


def _tp_constants(plan: Plan) -> str:
    """TP_STYLES (module path -> style, ``ir.decisions.TP_STYLES``), folded over BLOCKS when the blocks agree."""
    if not plan.tensor_parallel or plan.mesh.tp == 1:
        return ""
    per_block, rest = _split_styles(plan)

    def rows(styles: dict[str, str], indent: str) -> str:
        return "".join(f'{indent}"{k}": "{v}",  # {STYLE_SOURCE[v]}\n' for k, v in styles.items())

    head = "# Tensor-parallel styles, chosen and proven on the op graph (style: its torch ParallelStyle)\n"
    if not per_block:
        return head + "TP_STYLES = {\n" + rows(rest, "    ") + "}\n"
    text = head + "BLOCK_TP_STYLES = {  # the same in every block\n" + rows(per_block, "    ") + "}\n"
    text += 'TP_STYLES = {f"{block}.{name}": style for block in BLOCKS for name, style in BLOCK_TP_STYLES.items()}'
    if rest:
        text += " | {\n" + rows(rest, "    ") + "}"
    return text + "\n"


def _recompute_constants(plan: Plan) -> str:
    modes = recompute_modes(plan)
    if not modes:
        return ""
    if plan.recompute != "mixed":
        return f'RECOMPUTE = {{block: "{plan.recompute}" for block in BLOCKS}}  # block -> recompute mode\n'
    lines = "".join(f"    {path!r}: {mode!r},\n" for path, mode in modes.items())
    return f"RECOMPUTE = {{  # block -> recompute mode (none: keeps its activations)\n{lines}}}\n"


def _split_styles(plan: Plan) -> tuple[dict[str, str], dict[str, str]]:
    """(styles relative to a block, the same in every block; the other modules' styles by path)."""
    relative: list[dict[str, str]] = [{} for _ in plan.blocks]
    rest: dict[str, str] = {}
    for path, style in sorted(plan.tensor_parallel.items()):
        owner = next((i for i, b in enumerate(plan.blocks) if path.startswith(b + ".")), None)
        if owner is None:
            rest[path] = style
        else:
            relative[owner][path[len(plan.blocks[owner]) + 1 :]] = style
    if relative and relative[0] and all(r == relative[0] for r in relative):
        return relative[0], rest
    return {}, dict(sorted(plan.tensor_parallel.items()))


# Step arguments printed as the program's constants (the rest are printed as literals).
CONSTANT_OF_ARGUMENT = {
    "styles": "TP_STYLES",
    "tp_styles": "TP_STYLES",
    "modes": "RECOMPUTE",
    "blocks": "BLOCKS",
    "split_points": "SPLIT_POINTS",
    "virtual_stages": "VIRTUAL_STAGES",
    "schedule": "SCHEDULE",
    "num_microbatches": "NUM_MICROBATCHES",
    "precision": "PRECISION",
    "placement": "PLACEMENT",
    "sequence_axis": "SEQUENCE_AXIS",
    "tokens_per_sample": "TOKENS_PER_SAMPLE",
    "experts": "EXPERTS",
    "ep": "EP",
    "linears": "FLOAT8_LINEARS",
    "float8": "FLOAT8",
}


def step_lines(steps: tuple[Step, ...], model: str) -> str:
    """Each step as one call, its reason as the comment above it; ``model`` names the model variable."""
    lines = []
    for step in steps:
        args = [model]
        if step.op == "split_pipeline":
            model = "stages"  # from here on the steps act on this rank's stages
        result = RESULTS.get(step.op, model)
        if step.mesh_dim is not None:
            args.append("mesh" if step.mesh_dim == WHOLE_MESH else f'mesh["{step.mesh_dim}"]')
        args += [f"{key}={_argument_source(key, value)}" for key, value in step.arguments]
        args += [f"{name}={name}" for name in RUN_INPUTS.get(step.op, ())]
        lines += _comment(step.why) + _call(f"{result} = {step.op}(", args)
    return "\n".join(lines) + "\n"


def _call(opening: str, args: list[str], width: int = 110) -> list[str]:
    """``opening`` + the arguments + ")", broken after commas to stay within ``width`` (the argument
    lines aligned under the first argument)."""
    lines, line = [], opening
    for i, arg in enumerate(args):
        piece = arg + (", " if i < len(args) - 1 else ")")
        if len(line) + len(piece.rstrip()) > width and line.strip() != opening.strip():
            lines.append(line.rstrip())
            line = " " * len(opening) + piece
        else:
            line += piece
    return lines + [line.rstrip()]


def _argument_source(key: str, value) -> str:
    if key in CONSTANT_OF_ARGUMENT and value not in ((), {}, None):
        return CONSTANT_OF_ARGUMENT[key]
    return repr(value)


def _comment(text: str) -> list[str]:
    return ["# " + line for line in textwrap.wrap(text[0].upper() + text[1:] + ".", width=100)]


def _parallelize(plan: Plan, steps: tuple[Step, ...]) -> str:
    return f'''
def parallelize(model, mesh, device, recipe):
    """{_parallelize_doc(plan)}"""
{textwrap.indent(step_lines(steps, "model").rstrip(), "    ")}
    return model, optimizer
'''


def _parallelize_doc(plan: Plan) -> str:
    parts = []
    if plan.mesh.tp > 1 and plan.tensor_parallel:
        parts.append(f"tensor parallel over {plan.mesh.tp} ranks")
    if plan.recompute != "none":
        parts.append(f"recompute {plan.recompute}")
    if plan.mesh.dp_cp > 1:
        wrapper = plan.decisions.dp_runtime.wrapper
        parts.append(
            f"ZeRO-{plan.zero_stage} over {dp_ranks(plan)}"
            + {"DistributedDataParallel": " (DDP)", "replicate": " (FSDP2's replicate)"}.get(wrapper, " (FSDP2)")
            + (f", HSDP with {plan.dp_replicate} replicas" if plan.dp_replicate > 1 else "")
            + (f", experts split over {plan.ep} of them" if plan.ep > 1 else "")
        )
    else:
        parts.append("one data-parallel rank: no gradient synchronisation")
    return "Apply the plan's steps in order (passes.lowering.lower): " + ", ".join(parts) + "."


def _build_pipeline(plan: Plan, steps: tuple[Step, ...]) -> str:
    stages = plan.mesh.pp * plan.virtual_stages
    return f'''
def build_pipeline(model, mesh, device, recipe, example_microbatch, loss_fn):
    """{plan.schedule} pipeline over {plan.mesh.pp} ranks, {stages} stages cut at SPLIT_POINTS; this rank
    keeps its stages (torch.distributed.pipelining) and drops the rest of the model. The plan's steps in
    order (passes.lowering.lower)."""
{textwrap.indent(step_lines(steps, "model").rstrip(), "    ")}
    return stages, schedule, optimizer
'''


_ARGS = """
def parse_args():
    parser = argparse.ArgumentParser(description="Train with the plan in this file's header.")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, help="the peak learning rate (default: RECIPE's lr)")
    parser.add_argument("--seed", type=int, default=0, help="weights and data are drawn from this seed")
    parser.add_argument("--log-every", type=int, default=1, help="print every n-th step's line")
    parser.add_argument("--log-jsonl", help="append each step's figures here as one JSON object per line (rank 0)")
    parser.add_argument("--tensorboard", help="write each step's figures as TensorBoard scalars to this folder "
                        "(needs the tensorboard package)")
    parser.add_argument("--metrics-out", help="folder for losses and final weights (used by autoshard verify)")
    parser.add_argument("--fixed-randomness", action="store_true", help="every random op (dropout, stochastic "
                        "depth, rand masks, noise) at its expectation, as autoshard verify runs: each rank would "
                        "draw its own numbers")
    parser.add_argument("--init-from", help="start from these weights: a Hugging Face folder of *.safetensors "
                        "(save_pretrained's) or a DCP checkpoint, each rank reading its shards (a checkpoint in "
                        "--checkpoint-dir comes first)")
    parser.add_argument("--export-hf", help="at the end, write the weights here as Hugging Face safetensors")
    parser.add_argument("--checkpoint-dir", help="save DCP checkpoints here, and resume from the newest one")
    parser.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
    parser.add_argument("--timeout-s", type=int, default=300, help="a collective waiting longer ends the job, "
                        "naming the ranks that never joined it")
    parser.add_argument("--data", help="train on this flat token file (nanoGPT's .bin: tokens back to back, no "
                        "header) instead of the model file's dataset or, without one, example_batch draws")
    parser.add_argument("--data-dtype", choices=["uint16", "int32"], default="uint16", help="--data's token type")
    parser.add_argument("--data-workers", type=int, default=1, help="DataLoader processes per rank reading the "
                        "dataset ahead (0: read in the training process)")
    return parser.parse_args()
"""


_MAIN_SPMD = """
def main():
    args = parse_args()
    ctx = runtime.init_distributed(expected_world_size=math.prod(MESH.values()), timeout_s=args.timeout_s)
    mesh = runtime.build_mesh(ctx.device_type, MESH, FLATTEN)
    model_file = runtime.load_model_file(MODEL, expected_hash=MODEL_FINGERPRINT, seq_len=SEQ_LEN)
    # On the meta device: shapes only; init_weights makes this rank's shards, as one process would have drawn them
    model = runtime.build_meta_model(model_file, seed=args.seed, device=ctx.device,
                                     fixed_randomness=args.fixed_randomness)
    recipe = Recipe(**RECIPE).for_run(args.steps, lr=args.lr)  # a decay without steps of its own spans --steps
    model, optimizer = parallelize(model, mesh, ctx.device, recipe)
    scheduler = build_scheduler(optimizer, recipe)  # each step's learning rate: RECIPE's warmup and schedule
    # fp16's loss scaler: the loss scaled before backward, the gradients unscaled before clipping, a step with an
    # inf or nan gradient skipped (ShardedGradScaler agrees over sharded gradients); every other PRECISION's
    # passes the loss through and steps the optimizer as it is
    scaler = runtime.grad_scaler(PRECISION, model, ctx.device)
    # What each rank trains on: --data's token file, else the model file's dataset (a DataLoader over a
    # DistributedSampler on DATA_AXIS; a stream each rank reads itself), else example_batch draws; the same samples
    # one process sees per step
    batches = runtime.RankBatches(model_file, runtime.DataSource(args.data, args.data_dtype), GLOBAL_BATCH,
                                  TOKENS_PER_SAMPLE, mesh, DATA_AXIS, ctx.device, args.seed, args.data_workers)

    start = checkpoint.resume(args.checkpoint_dir, model, optimizer, data=batches,  # 0 without a checkpoint
                              scheduler=scheduler, scaler=scaler)
    if start == 0 and args.init_from:
        checkpoint.load_weights(args.init_from, model, optimizer)  # pretrained: each rank reads its shards

    log = runtime.StepLog(GLOBAL_BATCH * TOKENS_PER_SAMPLE, is_main=ctx.is_main, log_every=args.log_every,
                          prediction=PREDICTED, jsonl=args.log_jsonl, tensorboard=args.tensorboard,
                          last_step=args.steps - 1)  # each step: MFU against PREDICTED, memory, ETA
    for step in range(start, args.steps):
        log.start()
        inputs, targets = batches.take(step)  # this rank's samples of the step's global batch
        # Forward and backward of each of NUM_MICROBATCHES micro-batches (runtime.forward_backward): along
        # SEQUENCE_AXIS (context parallelism) each rank keeps its chunk of every sequence and attention runs as a
        # ring over the axis's ranks; gradients synchronised on the last micro-batch only; PRECISION's autocast
        step_loss = runtime.forward_backward(model, inputs, targets, model_file.loss, mesh, NUM_MICROBATCHES,
                                             SEQUENCE_AXIS, TOKENS_PER_SAMPLE, PRECISION, scaler)
        scaler.unscale_(optimizer)  # fp16: the gradients unscaled before clipping
        # Clipping: the whole model's gradient norm over every mesh axis (collectives on every rank)
        grad_norm = None if recipe.max_grad_norm is None else clip_grad_norm(model, recipe.max_grad_norm)
        lr = scheduler.get_last_lr()[0]  # this step's
        scaler.step(optimizer)  # optimizer.step(), unless fp16 found an inf or nan gradient
        scaler.update()
        scheduler.step()  # the next step's learning rate
        optimizer.zero_grad(set_to_none=True)
        log.end(step, runtime.mean_over(step_loss, mesh.get_group(LOSS_AXIS)), lr=lr, grad_norm=grad_norm)
        if args.checkpoint_dir and (step + 1) % args.checkpoint_every == 0:
            checkpoint.save(args.checkpoint_dir, step + 1, model, optimizer, data=batches, scheduler=scheduler,
                            scaler=scaler)

    runtime.finish(model, optimizer, log, args.metrics_out)  # final weights: each rank writes its shards
    if args.export_hf:
        checkpoint.export_hf(args.export_hf, model, optimizer)
    runtime.shutdown()  # destroy the process groups and exit 0, skipping gloo's fragile teardown


if __name__ == "__main__":
    runtime.faults.guard(main)  # a timed-out collective ends the job in one line naming the stuck ranks
"""


_MAIN_PIPELINE = """
def main():
    args = parse_args()
    ctx = runtime.init_distributed(expected_world_size=math.prod(MESH.values()), timeout_s=args.timeout_s)
    mesh = runtime.build_mesh(ctx.device_type, MESH, FLATTEN)
    model_file = runtime.load_model_file(MODEL, expected_hash=MODEL_FINGERPRINT, seq_len=SEQ_LEN)
    # On the meta device: shapes only; init_weights makes this rank's shards, as one process would have drawn them
    model = runtime.build_meta_model(model_file, seed=args.seed, device=ctx.device,
                                     fixed_randomness=args.fixed_randomness)
    first_inputs = runtime.global_batch(model_file, GLOBAL_BATCH, args.seed, 0)[0]
    example_microbatch = tuple(t[:MICROBATCH_SIZE].to(ctx.device) for t in first_inputs)
    recipe = Recipe(**RECIPE).for_run(args.steps, lr=args.lr)  # a decay without steps of its own spans --steps
    stages, schedule, optimizer = build_pipeline(model, mesh, ctx.device, recipe, example_microbatch, model_file.loss)
    scheduler = build_scheduler(optimizer, recipe)  # each step's learning rate: RECIPE's warmup and schedule
    hf_configs = checkpoint.hf_configs(model)  # a transformers model's config, written beside --export-hf
    del model  # the stages hold what this rank needs
    # What each rank trains on: --data's token file, else the model file's dataset (a DataLoader over a
    # DistributedSampler on DATA_AXIS; a stream each rank reads itself), else example_batch draws; the same samples
    # one process sees per step.
    # Only the first stage takes inputs and only the last takes targets: a rank holding neither reads nothing
    batches = runtime.RankBatches(model_file, runtime.DataSource(args.data, args.data_dtype), GLOBAL_BATCH,
                                  TOKENS_PER_SAMPLE, mesh, DATA_AXIS, ctx.device, args.seed, args.data_workers,
                                  reads=stages.reads)

    start = checkpoint.resume(args.checkpoint_dir, stages, optimizer, mesh, data=batches,  # 0 without a checkpoint
                              scheduler=scheduler)
    if start == 0 and args.init_from:
        checkpoint.load_weights(args.init_from, stages, optimizer, mesh)  # pretrained: each rank reads its shards

    log = runtime.StepLog(GLOBAL_BATCH * TOKENS_PER_SAMPLE, is_main=ctx.is_main, log_every=args.log_every,
                          prediction=PREDICTED, jsonl=args.log_jsonl, tensorboard=args.tensorboard,
                          last_step=args.steps - 1)  # each step: MFU against PREDICTED, memory, ETA
    for step in range(start, args.steps):
        log.start()
        inputs, targets = batches.take(step)  # this rank's samples of the step's global batch
        with runtime.autocast(PRECISION, ctx.device):
            loss = pp.pipeline_step(schedule, stages, inputs, targets)  # all micro-batches; mean over the global batch
        # Clipping: the whole model's gradient norm over every mesh axis (collectives on every rank)
        grad_norm = None if recipe.max_grad_norm is None else clip_grad_norm(stages, recipe.max_grad_norm)
        lr = scheduler.get_last_lr()[0]  # this step's
        optimizer.step()
        scheduler.step()  # the next step's learning rate
        optimizer.zero_grad(set_to_none=True)
        log.end(step, loss, lr=lr, grad_norm=grad_norm)
        if args.checkpoint_dir and (step + 1) % args.checkpoint_every == 0:
            checkpoint.save(args.checkpoint_dir, step + 1, stages, optimizer, mesh, data=batches, scheduler=scheduler)

    runtime.finish(stages, optimizer, log, args.metrics_out, mesh)  # final weights: each rank writes its shards
    if args.export_hf:
        checkpoint.export_hf(args.export_hf, stages, optimizer, mesh, configs=hf_configs)
    runtime.shutdown()  # destroy the process groups and exit 0, skipping gloo's fragile teardown


if __name__ == "__main__":
    runtime.faults.guard(main)  # a timed-out collective ends the job in one line naming the stuck ranks
"""
