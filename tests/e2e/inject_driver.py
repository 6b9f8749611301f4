"""Run a program (a file with a ``main()``: an emitted program) with one bug injected into its ranks, patched at the
torch level for the program's run only (tests and benchmarks only; nothing in ``autoshard`` reads it).

    inject_driver.py BUG PROGRAM [PROGRAM_ARGS...]      a job of a shared launch (``one_launch.job``)

BUG, where RANK is the rank that carries it:

    none               the program as it is
    linear:RANK:EPS    every ``nn.Linear`` output of rank RANK scaled by 1 + EPS (a global module forward hook)
    loss-grad:RANK:F   rank RANK's loss gradient times F: ``torch.autograd.backward`` of a one-element tensor with
                       no gradient given (``loss.backward()``, a pipeline's last stage's loss) gets F instead of 1
    step:RANK:F        rank RANK's optimizer steps F times as far: global optimizer step hooks move each parameter
                       (its local shard) by (F - 1)·Δ after the outermost ``step`` (Δ: what that step moved it)
    same-samples       every data-parallel rank reads the samples of the first (``runtime.data.take_shard``'s
                       index 0): a data-parallel rank that does not read its own share

The patch is undone when the program returns, so the next job of the launch runs clean.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

BUGS = ("none", "linear", "loss-grad", "step", "same-samples")


def parse(bug: str) -> tuple[str, int, float]:
    """(kind, rank, amount) of a BUG argument (module doc)."""
    kind, *rest = bug.split(":")
    if kind not in BUGS or (len(rest) != 2 if kind in ("linear", "loss-grad", "step") else rest):
        raise SystemExit(f"error: bug {bug!r} must be none, same-samples or KIND:RANK:AMOUNT with KIND in {BUGS[1:4]}")
    return (kind, int(rest[0]), float(rest[1])) if rest else (kind, -1, 0.0)


@contextlib.contextmanager
def injected(bug: str):
    """``bug`` in force on this process while the block runs (module doc)."""
    kind, rank, amount = parse(bug)
    here = int(os.environ.get("RANK", "0"))
    if kind == "same-samples":
        with _same_samples():
            yield
    elif kind == "none" or rank != here:
        yield
    else:
        with {"linear": _scaled_linears, "loss-grad": _scaled_loss_grad, "step": _longer_steps}[kind](amount):
            yield


@contextlib.contextmanager
def _scaled_linears(eps: float):
    def hook(module, args, output):
        return output * (1 + eps) if isinstance(module, torch.nn.Linear) else None

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def _scaled_loss_grad(factor: float):
    original = torch.autograd.backward

    def backward(tensors, grad_tensors=None, *args, **kwargs):
        single = isinstance(tensors, torch.Tensor)
        tensors = [tensors] if single else list(tensors)
        grads = [grad_tensors] if single or grad_tensors is None else list(grad_tensors)
        grads = grads * len(tensors) if grad_tensors is None else grads
        grads = [torch.full_like(t, factor) if g is None and t.numel() == 1 else g for t, g in zip(tensors, grads)]
        return original(tensors, grads, *args, **kwargs)

    torch.autograd.backward = backward
    try:
        yield
    finally:
        torch.autograd.backward = original


def _local(p: torch.Tensor) -> torch.Tensor:
    return p._local_tensor if hasattr(p, "_local_tensor") else p  # a DTensor's shard on this rank


@contextlib.contextmanager
def _longer_steps(factor: float):
    state = {"depth": 0, "before": {}}

    def params(optimizer):
        return [p for group in optimizer.param_groups for p in group["params"]]

    def pre(optimizer, args, kwargs):
        if state["depth"] == 0:
            state["before"] = {id(p): _local(p).detach().clone() for p in params(optimizer)}
        state["depth"] += 1

    def post(optimizer, args, kwargs):
        state["depth"] -= 1
        if state["depth"] > 0:
            return
        with torch.no_grad():
            for p in params(optimizer):
                local = _local(p)
                local.add_(local - state["before"][id(p)], alpha=factor - 1)

    handles = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _same_samples():
    from autoshard.runtime import data

    original = data.take_shard
    data.take_shard = lambda batch, index, count, device: original(batch, 0, count, device)
    try:
        yield
    finally:
        data.take_shard = original


def main() -> None:
    bug, program, *args = sys.argv[1:]
    spec = importlib.util.spec_from_file_location("injected_program", program)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.argv = [program, *args]
    with injected(bug):
        module.main()


if __name__ == "__main__":
    main()
