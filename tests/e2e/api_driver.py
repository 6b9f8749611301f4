"""Train a plan through the Python API: ``autoshard.parallelize`` and ``Parallelized.train_step`` in a loop of
the script's own.

Run by tests/e2e/test_context_parallel.py and test_pretrained.py, jobs of the session's torchrun launches
(``one_launch.py``), or alone under torchrun::

    api_driver.py PLAN_JSON [--steps 2] [--seed 0] [--lr 1e-3] [--metrics-out DIR] [--fixed-randomness]
                            [--init-from DIR] [--export-hf DIR] [--data-loader]

The command line is an emitted program's (``zoo.program_case``), so ``verify``'s judge reads its metrics.
Each step hands ``train_step`` the step's global batch, which it slices as the plan says (dp samples,
micro-batches, cp tokens, or the pipeline's schedule); ``--data-loader`` reads this rank's share with
``Parallelized.data_loader`` instead (``train_step(..., local=True)``). The optimizer is the plan's recipe's.
"""

from __future__ import annotations

import argparse

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
    p.add_argument("--data-loader", action="store_true")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    plan = autoshard.load_plan(args.plan)
    spec = autoshard.layout(plan)
    ctx = runtime.init_distributed(expected_world_size=plan.world_size)
    model_file = runtime.load_model_file(plan.model["spec"], expected_hash=plan.model["hash"], seq_len=spec.seq_len)
    model = runtime.build_model(model_file, seed=args.seed, device=ctx.device, fixed_randomness=args.fixed_randomness)
    p = autoshard.parallelize(model, plan, lr=args.lr, init_from=args.init_from)
    del model  # p holds what this rank trains (a pipeline: its stages)
    mesh = p.mesh if plan.mesh.pp > 1 else None  # weights out of pipeline stages map through the mesh
    shares = p.data_loader(seed=args.seed) if args.data_loader else None

    log = runtime.StepLog(plan.global_batch * spec.tokens_per_sample, is_main=ctx.is_main, log_every=1)
    for step in range(args.steps):
        log.start()
        if shares is not None:
            loss = p.train_step(*shares.take(step), local=True)  # this rank's samples
        else:
            loss = p.train_step(*runtime.global_batch(model_file, plan.global_batch, args.seed, step))
        p.optimizer.step()
        p.optimizer.zero_grad(set_to_none=True)
        log.end(step, loss)
    runtime.finish(p.model, p.optimizer, log, args.metrics_out, mesh)
    if args.export_hf:
        runtime.checkpoint.export_hf(args.export_hf, p.model, p.optimizer, mesh)
    runtime.shutdown()


if __name__ == "__main__":
    main()
