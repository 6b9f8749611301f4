#!/usr/bin/env python3
"""Training program emitted by autoshard from plan 6aacf992e843.

Model      examples/gpt.py:build  (236,928 parameters, 4 blocks, fingerprint e24db38cfafd48b5)
Cluster    local-cpu: 1 node(s) x 4 devices, gloo
Plan       dp=1 tp=1 pp=2 cp=2 | ZeRO-0 | global batch 8 = 1 dp ranks x 4 micro-batches x 2 | recompute none
Predicted  step 9.48 ms = compute 5.55 ms + exposed comm 2.43 ms + bubble 1.51 ms
           peak 3.9 MiB per rank (weights 0.9, grads 0.5, optimizer 0.9, activations 1.1, transient 0.3)
           53,991 tokens/s, MFU 40.8%

Run:  torchrun --standalone --nproc-per-node 4 train.py [--steps 20]
  or: autoshard run plan.json
"""


import argparse
import math

from autoshard import runtime
from autoshard.runtime import checkpoint
from autoshard.runtime import pipeline_parallel as pp
from autoshard.runtime.parallel import apply_replicate, build_optimizer, build_schedule, init_weights, split_pipeline, use_cp_attention
from autoshard.runtime.recipe import Recipe, build_scheduler, clip_grad_norm


MODEL = 'examples/gpt.py:build'
MODEL_FINGERPRINT = 'e24db38cfafd48b5'  # the program refuses a different model
SEQ_LEN = None  # handed to example_batch; None: the model file's own sequence length (no --seq-len)
TOKENS_PER_SAMPLE = 64
GLOBAL_BATCH = 8
# The device mesh and each rank's share of a global batch (passes.lowering.lower.layout)
MESH = {"pp": 2, "dp": 1, "cp": 2, "tp": 1}  # ranks along each dim, outermost first: tp innermost (inside a node)
FLATTEN = {"dp_cp": ("dp", "cp")}  # dp x cp joined: the ranks holding the same parameters, gradients and the loss averaged over them
DATA_AXIS = "dp"  # its ranks take different samples; the pp and cp ranks of one dp rank take the same ones
SEQUENCE_AXIS = "cp"  # context parallel: each sample's tokens split over its 2 ranks (head-tail pairs of chunks), attention as a ring
MICROBATCH_SIZE = 2
NUM_MICROBATCHES = 4  # GLOBAL_BATCH // (dp * MICROBATCH_SIZE)
PRECISION = 'fp32'  # weights, gradients and compute in the parameters' own dtype
BLOCKS = [f"h.{i}" for i in range(4)]  # repeated blocks: recompute and FSDP units
SCHEDULE = '1f1b'
VIRTUAL_STAGES = 1  # pipeline stages per pp rank
SPLIT_POINTS = ('h.2',)  # modules where stages 1.. begin
PREDICTED = dict(step_time_s=0.00948314, mfu=0.408428, peak_flops_per_s=50000000000.0, devices=4,
                 allocated_bytes=3909632, memory_peak_bytes=4105113)  # the plan's step, per rank


# The training recipe (runtime.recipe), written by autoshard compile --recipe FILE and its flags (an edit
# here is lost at the next compile)
RECIPE = {
    "optimizer": "adamw",
    "lr": 0.001,  # the peak learning rate; the program's --lr overrides it
    "betas": [0.9, 0.999],  # adam, adamw
    "eps": 1e-08,  # adam, adamw
    "momentum": 0.0,  # sgd
    "weight_decay": 0.01,
    "decay_all": False,  # False: no weight decay on norms, biases, embeddings; True: on all
    "schedule": "constant",  # constant, linear or cosine decay to min_lr_ratio * lr
    "warmup_steps": 0,  # linear warmup from lr / warmup_steps to lr
    "min_lr_ratio": 0.0,  # the decay's floor, a fraction of lr
    "max_grad_norm": None,  # the whole model's gradient 2-norm clipped to this; None: no clipping
    "steps": None,  # the decay's length; None: the run's --steps
}


def build_pipeline(model, mesh, device, recipe, example_microbatch, loss_fn):
    """1f1b pipeline over 2 ranks, 2 stages cut at SPLIT_POINTS; this rank
    keeps its stages (torch.distributed.pipelining) and drops the rest of the model. The plan's steps in
    order (passes.lowering.lower)."""
    # Context parallel: each cp rank holds a head-tail pair of chunks of every sample (64 tokens in 4
    # chunks: rank r chunks r and 3 - r), so that causal attention's work is even; a transformers model
    # attends through SDPA without building a mask (its positions would read as packed sequences), a
    # padding mask refused; no change to a model calling SDPA itself.
    model = use_cp_attention(model)
    # 2 stages cut at the split points by tracing one micro-batch; rank r keeps stage r and drops the rest
    # of the model; context parallel: traced on this cp rank's tokens of each sample (use_cp_attention
    # says which), which every stage boundary carries, and each step runs the schedule with attention as a
    # ring over the cp ranks.
    stages = split_pipeline(model, mesh, split_points=SPLIT_POINTS, virtual_stages=VIRTUAL_STAGES, tp_styles={},
                            sequence_axis=SEQUENCE_AXIS, tokens_per_sample=TOKENS_PER_SAMPLE,
                            example_microbatch=example_microbatch, device=device)
    # ZeRO-0: FSDP2's replicate (DDP on DTensor parameters and pipeline stages) all-reduces each unit's
    # gradients over 2 dp x cp ranks after the last micro-batch's backward (each stage module a unit).
    stages = apply_replicate(stages, mesh["dp_cp"], blocks=(), precision=PRECISION)
    # This rank's shards made on its device and filled with the initial weights one process draws from the
    # same seed (the model file's initialisation replayed, runtime.init_replay); nothing whole is made.
    stages = init_weights(stages, mesh, device=device)
    # The recipe's optimizer, one per stage module (each stage's state dict maps through its own module).
    optimizer = build_optimizer(stages, mesh["dp_cp"], zero_stage=0, recipe=recipe)
    # Schedule 1f1b over 4 micro-batches; gradients are their mean.
    schedule = build_schedule(stages, schedule=SCHEDULE, num_microbatches=NUM_MICROBATCHES, loss_fn=loss_fn)
    return stages, schedule, optimizer


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
