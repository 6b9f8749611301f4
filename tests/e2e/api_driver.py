"""Train a plan through the Python API: ``autoshard.parallelize`` and a training loop of the script's own.

Run by tests/e2e/test_context_parallel.py, a job of the session's torchrun launches (``one_launch.py``),
or alone under torchrun::

    api_driver.py PLAN_JSON [--steps 2] [--seed 0] [--lr 1e-3] [--metrics-out DIR] [--fixed-randomness]
                            [--init-from DIR] [--export-hf DIR]

The command line is an emitted program's (``zoo.program_case``), so ``verify``'s judge reads its metrics.
The loop is the one ``autoshard.parallelize``'s docstring describes: the samples of this rank's place
on the data axis, each micro-batch's tokens of its place on the sequence axis, forward and backward
under ``runtime.context_parallel`` (both nothing without context parallelism), the loss averaged over
the loss axis, all read from ``autoshard.layout(plan)``.
"""

from __future__ import annotations

import argparse

import torch

import autoshard
from autoshard import runtime


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("plan")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--metrics-out")
    p.add_argument("--fixed-randomness", action="store_true")
    p.add_argument("--init-from")
    p.add_argument("--export-hf")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    plan = autoshard.load_plan(args.plan)
    spec = autoshard.layout(plan)
    ctx = runtime.init_distributed(expected_world_size=plan.world_size)
    model_file = runtime.load_model_file(plan.model["spec"], expected_hash=plan.model["hash"], seq_len=spec.seq_len)
    model = runtime.build_model(model_file, seed=args.seed, device=ctx.device, fixed_randomness=args.fixed_randomness)
    model, optimizer, mesh = autoshard.parallelize(model, plan, lr=args.lr, init_from=args.init_from)

    micro = plan.num_microbatches
    log = runtime.StepLog(plan.global_batch * spec.tokens_per_sample, is_main=ctx.is_main, log_every=1)
    for step in range(args.steps):
        log.start()
        batch = runtime.global_batch(model_file, plan.global_batch, args.seed, step)
        inputs, targets = runtime.take_samples(batch, mesh, spec.data_axis, ctx.device)
        step_loss = torch.zeros((), device=ctx.device)
        for i, (x, y) in enumerate(runtime.split_microbatches(inputs, targets, micro)):
            x, y = runtime.take_sequence_shard(x, y, mesh, spec.sequence_axis, spec.tokens_per_sample)
            with runtime.grad_sync(model, enabled=i == micro - 1), \
                    runtime.context_parallel(mesh, spec.sequence_axis, spec.tokens_per_sample):
                with runtime.autocast(plan.precision, ctx.device):
                    loss = model_file.loss(model(*x), y) / micro
                loss.backward()
            step_loss += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log.end(step, runtime.mean_over(step_loss, mesh.get_group(spec.loss_axis)))
    runtime.finish(model, optimizer, log, args.metrics_out)
    if args.export_hf:
        runtime.checkpoint.export_hf(args.export_hf, model, optimizer)
    runtime.shutdown()


if __name__ == "__main__":
    main()
