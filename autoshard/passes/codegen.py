"""Codegen: Plan -> a readable training program, launchable with torchrun.

The program states the plan in its header, the decisions as constants, and applies them in
one ``parallelize`` function written with PyTorch's own calls (DDP, ZeroRedundancyOptimizer,
FSDP2 ``fully_shard``), only the branch this plan takes. Everything else it needs comes from
``autoshard.runtime``. The output depends only on the plan, so it is byte-stable.
"""

from __future__ import annotations

import hashlib
import re
import textwrap
from pathlib import Path

from autoshard.ir.decisions import TP_STYLES
from autoshard.ir.plan import Plan

MIB = 2**20


def emit_program(plan: Plan) -> str:
    """The whole program as Python source."""
    main = _MAIN_PIPELINE if plan.mesh.pp > 1 else _MAIN_SPMD
    body = _build_pipeline(plan) if plan.mesh.pp > 1 else _parallelize(plan)
    parts = [_header(plan), _imports(plan), _constants(plan), body, _ARGS, main]
    return "\n\n\n".join(p.strip("\n") for p in parts) + "\n"


def torchrun_command(plan: Plan, program: str = "train.py") -> str:
    nodes = plan.cluster.get("nodes", 1)
    per_node = plan.world_size // nodes
    if nodes == 1:
        return f"torchrun --standalone --nproc-per-node {per_node} {program}"
    return (f"torchrun --nnodes {nodes} --nproc-per-node {per_node} --rdzv-backend c10d "
            f"--rdzv-endpoint $MASTER_ADDR:29500 --rdzv-id $JOB_ID {program}")


def emit_sbatch(plan: Plan, program: str = "train.py") -> str:
    """A SLURM batch script that starts ``program`` on the plan's nodes: one task per node runs
    torchrun (``torchrun_command``), the first node of the allocation hosts the c10d rendezvous."""
    nodes = plan.cluster.get("nodes", 1)
    per_node = plan.world_size // nodes
    gpus = f"#SBATCH --gpus-per-node={per_node}\n" if plan.cluster.get("backend") == "nccl" else ""
    return f"""#!/bin/bash
# SLURM batch script emitted by autoshard for plan {plan_digest(plan)}: {nodes} node(s) x {per_node} ranks.
# Submit: sbatch {Path(program).with_suffix('.sbatch').name} [--steps 1000 --checkpoint-dir ckpt]
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


def _header(plan: Plan) -> str:
    p, c, m = plan.predicted, plan.cluster, plan.model
    mem = p.memory
    return f'''#!/usr/bin/env python3
"""Training program emitted by autoshard from plan {plan_digest(plan)}.

Model      {m["spec"]}  ({m["params"]:,} parameters, {m["layers"]} blocks, fingerprint {m["hash"]})
Cluster    {c["name"]}: {c["nodes"]} node(s) x {c["devices_per_node"]} devices, {c["backend"]}
Plan       {plan.mesh} | ZeRO-{plan.zero_stage} | global batch {plan.global_batch} = {plan.mesh.dp} dp ranks x {plan.num_microbatches} micro-batches x {plan.microbatch_size} | recompute {plan.recompute}
Predicted  step {p.step_time_s * 1e3:.3g} ms = compute {p.compute_s * 1e3:.3g} ms + exposed comm {p.comm_exposed_s * 1e3:.3g} ms + bubble {p.bubble_s * 1e3:.3g} ms
           peak {mem.peak_bytes / MIB:,.1f} MiB per rank (weights {mem.params_bytes / MIB:,.1f}, grads {mem.grads_bytes / MIB:,.1f}, optimizer {mem.optimizer_bytes / MIB:,.1f}, activations {mem.activations_bytes / MIB:,.1f}, transient {mem.transient_bytes / MIB:,.1f})
           {p.tokens_per_s:,.0f} tokens/s, MFU {p.mfu:.1%}

Run:  {torchrun_command(plan)} [--steps 20]
  or: autoshard run plan.json
"""'''


def _imports(plan: Plan) -> str:
    torch_imports = ["from torch.distributed.device_mesh import init_device_mesh"]
    if plan.zero_stage >= 2 and plan.mesh.pp == 1 and plan.mesh.dp > 1:
        torch_imports.append("from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard")
    if plan.zero_stage == 1 and plan.mesh.dp > 1:
        torch_imports.append("from torch.distributed.optim import ZeroRedundancyOptimizer")
    if plan.zero_stage <= 1 and plan.mesh.dp > 1:
        torch_imports.append("from torch.nn.parallel import DistributedDataParallel as DDP")
    if plan.tensor_parallel and plan.mesh.pp == 1:
        sources = [STYLE_SOURCE[s] for s in set(plan.tensor_parallel.values())]
        names = sorted({src.split("(")[0] for src in sources if not src.startswith("runtime.")}
                       | {"parallelize_module"})
        torch_imports.append(f"from torch.distributed.tensor.parallel import {', '.join(names)}")
        if any("Replicate()" in src for src in sources):
            torch_imports.append("from torch.distributed.tensor import Replicate")
    lines = "\n".join(sorted(torch_imports))
    local = "from autoshard.runtime import checkpoint"
    if plan.mesh.pp > 1:
        local += "\nfrom autoshard.runtime import pipeline_parallel as pp"
        if plan.tensor_parallel:
            local += "\nfrom autoshard.runtime import tensor_parallel_stages as tps"
    return (f"import argparse\n\nimport torch\n{lines}\n\n"
            f"from autoshard import runtime\n{local}\n")


# The source text of each tensor-parallel style (runtime.tensor_parallel.parallel_style builds the same row).
STYLE_SOURCE = {name: row.source for name, row in TP_STYLES.items()}


def _constants(plan: Plan) -> str:
    pipeline = ""
    if plan.mesh.pp > 1:
        pipeline = (f"SCHEDULE = {plan.schedule!r}\n"
                    f"VIRTUAL_STAGES = {plan.virtual_stages}  # pipeline stages per pp rank\n"
                    f"SPLIT_POINTS = {list(plan.split_points)!r}  # modules where stages 1.. begin\n"
                    f"{_stage_tp_constants(plan)}")
    return f'''
MODEL = {plan.model["spec"]!r}
MODEL_FINGERPRINT = {plan.model["hash"]!r}  # the program refuses a different model
TOKENS_PER_SAMPLE = {plan.model.get("tokens_per_sample", 1)}
GLOBAL_BATCH = {plan.global_batch}
PP, DP, TP = {plan.mesh.pp}, {plan.mesh.dp}, {plan.mesh.tp}  # mesh ("pp", "dp", "tp"), tp innermost (inside a node)
MICROBATCH_SIZE = {plan.microbatch_size}
NUM_MICROBATCHES = {plan.num_microbatches}  # GLOBAL_BATCH // (DP * MICROBATCH_SIZE)
BLOCKS = {blocks_expression(plan.blocks)}  # repeated blocks: recompute and FSDP units
{pipeline}'''


def _parallelize(plan: Plan) -> str:
    body = _tensor_parallel_lines(plan) + _recompute_lines(plan) + _zero_lines(plan)
    return f'''
def parallelize(model, mesh, device, lr):
    """{_parallelize_doc(plan)}"""
{textwrap.indent(body.rstrip(), "    ")}
    return model, optimizer
'''


def _parallelize_doc(plan: Plan) -> str:
    tp = f"Tensor parallel over {plan.mesh.tp} ranks, styles chosen on the op graph. " if plan.mesh.tp > 1 else ""
    if plan.mesh.dp == 1:
        return tp + "One data-parallel rank: no gradient synchronisation."
    what = {
        0: f"DDP all-reduces gradients in {plan.ddp_bucket_cap_mb:g} MiB buckets, overlapped with backward.",
        1: f"ZeRO-1: DDP all-reduces gradients ({plan.ddp_bucket_cap_mb:g} MiB buckets); "
           f"ZeroRedundancyOptimizer shards AdamW's state over {plan.mesh.dp} ranks.",
        2: f"ZeRO-2: FSDP2 shards gradients and optimizer state over {plan.mesh.dp} ranks; "
           "weights stay gathered from forward to backward.",
        3: f"ZeRO-3: FSDP2 shards weights, gradients and optimizer state over {plan.mesh.dp} ranks; "
           "each block is gathered just before use.",
    }[plan.zero_stage]
    return tp + what


def _recompute_lines(plan: Plan) -> str:
    if plan.recompute == "none":
        return ""
    why = {"full": "keep only each block's input; recompute the block in backward",
           "selective": "keep matmul and attention outputs; recompute the cheap ops",
           "mixed": "each block its own mode, the least recompute that fits (full: keep only the input; "
                    "selective: keep matmul and attention outputs)"}[plan.recompute]
    if plan.recompute == "mixed":
        lines = "".join(f"    {path!r}: {mode!r},\n" for path, mode in plan.recompute_blocks.items())
        return (f"# Recompute ({plan.recompute}): {why}.\nRECOMPUTE = {{\n{lines}}}\n"
                f"runtime.apply_recompute(model, BLOCKS, RECOMPUTE)\n")
    return f'# Recompute ({plan.recompute}): {why}.\nruntime.apply_recompute(model, BLOCKS, "{plan.recompute}")\n'


def _tensor_parallel_lines(plan: Plan) -> str:
    """parallelize_module per repeated block (one loop when the blocks agree), then the rest."""
    if not plan.tensor_parallel:
        return ""
    per_block, rest = _split_styles(plan)
    lines = ["# Tensor parallelism: column-parallel then row-parallel, as chosen on the op graph."]
    if per_block:
        lines.append("for path in BLOCKS:")
        lines.append('    parallelize_module(model.get_submodule(path), mesh["tp"], {')
        lines += [f'        "{k}": {STYLE_SOURCE[v]},' for k, v in per_block.items()]
        lines.append("    })")
    if rest:
        lines.append('parallelize_module(model, mesh["tp"], {')
        lines += [f'    "{k}": {STYLE_SOURCE[v]},' for k, v in rest.items()]
        lines.append("})")
    return "\n".join(lines) + "\n"


def _split_styles(plan: Plan) -> tuple[dict[str, str], dict[str, str]]:
    """(styles relative to a block, the same in every block; the other modules' styles by path)."""
    relative: list[dict[str, str]] = [{} for _ in plan.blocks]
    rest: dict[str, str] = {}
    for path, style in sorted(plan.tensor_parallel.items()):
        owner = next((i for i, b in enumerate(plan.blocks) if path.startswith(b + ".")), None)
        if owner is None:
            rest[path] = style
        else:
            relative[owner][path[len(plan.blocks[owner]) + 1:]] = style
    if relative and all(r == relative[0] for r in relative):
        return relative[0], rest
    return {}, dict(sorted(plan.tensor_parallel.items()))


def _zero_lines(plan: Plan) -> str:
    if plan.mesh.dp == 1:
        return "optimizer = torch.optim.AdamW(model.parameters(), lr=lr)\n"
    return _SYNC_BATCH_NORM + _zero_dp_lines(plan)


# SyncBatchNorm (GlooSyncBatchNorm on CPUs): BatchNorm statistics of the dp ranks' whole batch, as one process's.
_SYNC_BATCH_NORM = ('model = runtime.model.sync_batch_norm(model, mesh.get_group("dp"))  '
                    '# BatchNorm over all dp ranks\' samples; no change without BatchNorm\n')


def _zero_dp_lines(plan: Plan) -> str:
    if plan.zero_stage >= 2:
        reshard = plan.zero_stage == 3
        return f'''# bf16 compute with fp32 gradient reduction on GPUs; plain fp32 on CPUs
policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if device.type == "cuda" else MixedPrecisionPolicy()
for path in BLOCKS:
    fully_shard(model.get_submodule(path), mesh=mesh["dp"], reshard_after_forward={reshard}, mp_policy=policy)
fully_shard(model, mesh=mesh["dp"], reshard_after_forward={reshard}, mp_policy=policy)
optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
'''
    ddp = (f'model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,\n'
           f'            process_group=mesh.get_group("dp"), bucket_cap_mb={plan.ddp_bucket_cap_mb:g}, gradient_as_bucket_view=True)  # bucket size chosen by the cost model\n')
    if plan.zero_stage == 1:
        return ddp + ("optimizer = ZeroRedundancyOptimizer(model.parameters(), "
                      "optimizer_class=torch.optim.AdamW, lr=lr,\n"
                      '                                   process_group=mesh.get_group("dp"))\n')
    return ddp + "optimizer = torch.optim.AdamW(model.parameters(), lr=lr)\n"


def _stage_tp_constants(plan: Plan) -> str:
    """TP inside pipeline stages: the styles as data (module path relative to a block -> style)."""
    if not plan.tensor_parallel:
        return ""
    per_block, rest = _split_styles(plan)
    lines = ["BLOCK_TP_STYLES = {  # the same in every block: column-parallel then row-parallel, chosen on the op graph"]
    lines += [f'    "{k}": "{v}",' for k, v in per_block.items()]
    lines.append("}")
    lines.append("OTHER_TP_STYLES = {" + ", ".join(f'"{k}": "{v}"' for k, v in rest.items()) + "}")
    return "\n".join(lines) + "\n"


def _stage_tp_lines(plan: Plan) -> str:
    if not plan.tensor_parallel:
        return ""
    return (f"    # Tensor parallel over {plan.mesh.tp} ranks: each keeps its shard of these modules, and the\n"
            "    # Megatron f/g collectives are custom ops, so the split below traces them into the stages.\n"
            "    styles = {f\"{block}.{name}\": style for block in BLOCKS for name, style in BLOCK_TP_STYLES.items()}\n"
            "    shard_dims = tps.shard_for_tracing(model, mesh.get_group(\"tp\"), styles | OTHER_TP_STYLES)\n")


def _build_pipeline(plan: Plan) -> str:
    fsdp = ""
    if plan.mesh.dp > 1:
        fsdp = (f"\n    # ZeRO-{plan.zero_stage}: FSDP2 on each stage module over the {plan.mesh.dp} dp ranks.\n"
                f'    pp.apply_fsdp_to_stages(parts, mesh["dp"], reshard_after_forward={plan.zero_stage == 3})')
    stages = plan.mesh.pp * plan.virtual_stages
    tp_args = ",\n                                     shard_dims, mesh.get_group(\"tp\")" if plan.tensor_parallel else ""
    return f'''
def build_pipeline(model, model_file, mesh, device, lr, example_microbatch):
    """{plan.schedule} pipeline over {plan.mesh.pp} ranks, {stages} stages cut at SPLIT_POINTS; this rank
    keeps its stages (torch.distributed.pipelining) and drops the rest of the model."""
{_stage_tp_lines(plan)}    parts = pp.build_pipeline_stages(model, example_microbatch, SPLIT_POINTS, mesh.get_local_rank("pp"), PP,
                                     VIRTUAL_STAGES, device, mesh.get_group("pp"){tp_args}){fsdp}
    optimizer = checkpoint.StageOptimizers(parts.modules, torch.optim.AdamW, lr=lr)  # one AdamW per stage
    schedule = pp.build_schedule(parts, NUM_MICROBATCHES, model_file.loss, SCHEDULE)
    return parts, schedule, optimizer
'''


_ARGS = '''
def parse_args():
    parser = argparse.ArgumentParser(description="Train with the plan in this file's header.")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0, help="weights and data are drawn from this seed")
    parser.add_argument("--log-every", type=int, default=1)
    parser.add_argument("--metrics-out", help="folder for losses and final weights (used by autoshard verify)")
    parser.add_argument("--no-dropout", action="store_true", help="turn every dropout off (autoshard verify "
                        "compares runs with dropout off: each rank would draw its own masks)")
    parser.add_argument("--checkpoint-dir", help="save DCP checkpoints here, and resume from the newest one")
    parser.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
    parser.add_argument("--timeout-s", type=int, default=300, help="a collective waiting longer ends the job, "
                        "naming the ranks that never joined it")
    return parser.parse_args()
'''


_MAIN_SPMD = '''
def main():
    args = parse_args()
    ctx = runtime.init_distributed(expected_world_size=PP * DP * TP, timeout_s=args.timeout_s)
    mesh = init_device_mesh(ctx.device_type, (PP, DP, TP), mesh_dim_names=("pp", "dp", "tp"))
    model_file = runtime.load_model_file(MODEL, expected_hash=MODEL_FINGERPRINT)
    model = runtime.build_model(model_file, seed=args.seed, device=ctx.device, dropout=not args.no_dropout)
    model, optimizer = parallelize(model, mesh, ctx.device, args.lr)

    start = checkpoint.resume(args.checkpoint_dir, model, optimizer)  # 0 without a checkpoint

    dp_rank = mesh.get_local_rank("dp")  # the TP ranks of one dp rank see the same data
    log = runtime.StepLog(GLOBAL_BATCH * TOKENS_PER_SAMPLE, is_main=ctx.is_main, log_every=args.log_every)
    for step in range(start, args.steps):
        log.start()
        batch = runtime.global_batch(model_file, GLOBAL_BATCH, args.seed, step)
        inputs, targets = runtime.take_shard(batch, dp_rank, DP, ctx.device)
        step_loss = torch.zeros((), device=ctx.device)
        for i, (x, y) in enumerate(runtime.split_microbatches(inputs, targets, NUM_MICROBATCHES)):
            with runtime.grad_sync(model, enabled=i == NUM_MICROBATCHES - 1):
                with ctx.autocast():
                    loss = model_file.loss(model(*x), y) / NUM_MICROBATCHES
                loss.backward()
            step_loss += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log.end(step, runtime.mean_over(step_loss, mesh.get_group("dp")))
        if args.checkpoint_dir and (step + 1) % args.checkpoint_every == 0:
            checkpoint.save(args.checkpoint_dir, step + 1, model, optimizer)

    runtime.finish(model, log, args.metrics_out)
    runtime.shutdown()  # destroy the process groups and exit 0, skipping gloo's fragile teardown


if __name__ == "__main__":
    runtime.faults.guard(main)  # a timed-out collective ends the job in one line naming the stuck ranks
'''


_MAIN_PIPELINE = '''
def main():
    args = parse_args()
    ctx = runtime.init_distributed(expected_world_size=PP * DP * TP, timeout_s=args.timeout_s)
    mesh = init_device_mesh(ctx.device_type, (PP, DP, TP), mesh_dim_names=("pp", "dp", "tp"))
    model_file = runtime.load_model_file(MODEL, expected_hash=MODEL_FINGERPRINT)
    model = runtime.build_model(model_file, seed=args.seed, device=ctx.device, dropout=not args.no_dropout)
    first_inputs = runtime.global_batch(model_file, GLOBAL_BATCH, args.seed, 0)[0]
    example_microbatch = tuple(t[:MICROBATCH_SIZE].to(ctx.device) for t in first_inputs)
    parts, schedule, optimizer = build_pipeline(model, model_file, mesh, ctx.device, args.lr, example_microbatch)
    del model  # the stages hold what this rank needs

    start = checkpoint.resume(args.checkpoint_dir, parts, optimizer, mesh)  # 0 without a checkpoint

    dp_rank = mesh.get_local_rank("dp")
    log = runtime.StepLog(GLOBAL_BATCH * TOKENS_PER_SAMPLE, is_main=ctx.is_main, log_every=args.log_every)
    for step in range(start, args.steps):
        log.start()
        batch = runtime.global_batch(model_file, GLOBAL_BATCH, args.seed, step)
        inputs, targets = runtime.take_shard(batch, dp_rank, DP, ctx.device)
        loss = pp.pipeline_step(schedule, parts, inputs, targets)  # all micro-batches; mean over the global batch
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log.end(step, loss)
        if args.checkpoint_dir and (step + 1) % args.checkpoint_every == 0:
            checkpoint.save(args.checkpoint_dir, step + 1, parts, optimizer, mesh)

    runtime.finish_with_state(pp.full_state_dict(parts), log, args.metrics_out)
    runtime.shutdown()  # destroy the process groups and exit 0, skipping gloo's fragile teardown


if __name__ == "__main__":
    runtime.faults.guard(main)  # a timed-out collective ends the job in one line naming the stuck ranks
'''
