"""``autoshard verify``: the emitted program trains exactly like one process.

The program runs on local CPU ranks (gloo, fp32) for K steps; a single process trains the
same model from the same seed on the same global batches with the same optimizer. They
agree when, for every step t and every parameter element w::

    |loss_par(t) − loss_ref(t)| ≤ 1e-6 + 1e-5·|loss_ref(t)|        (LOSS_ATOL, LOSS_RTOL)
    |w_par − w_ref|             ≤ 0.02·lr + 1e-5·|w_ref|           (WEIGHT_ATOL_PER_LR, WEIGHT_RTOL)

Only fp32 summation order differs between one process and several. The weights' absolute
tolerance is 2% of one AdamW step, and it is needed: an element whose true gradient is
zero or near AdamW's eps (a key projection's bias under softmax; a weight whose gradient is
1e-8) gets rounding noise n as (part of) its gradient, and AdamW moves it by
lr·n/(|g| + eps), up to about 1% of a step, with different noise on each side. Measured at
lr 1e-3: 7.2e-6 for DP on the example GPT after 1, 3 and 10 steps (it does not accumulate),
1.12e-5 for TP=2 (a gradient of 1.4e-8); every other element within 6e-6.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from autoshard.errors import AutoshardError
from autoshard.ir.plan import Plan
from autoshard.launch import check_runs_here, run_torchrun, write_program
from autoshard.modelfile import ModelFile
from autoshard.runtime.data import global_batch
from autoshard.runtime.model import build_model, load_model_file

LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-6
WEIGHT_RTOL, WEIGHT_ATOL_PER_LR = 1e-5, 0.02
DEFAULT_LR = 1e-3


@dataclass(frozen=True)
class VerifyReport:
    steps: int
    parallel_losses: list[float]
    reference_losses: list[float]
    max_loss_diff: float
    max_param_diff: float
    worst_param: str
    failure: str  # "" when the run agrees

    @property
    def ok(self) -> bool:
        return not self.failure


def verify(plan: Plan, steps: int = 5, seed: int = 0, lr: float = DEFAULT_LR) -> VerifyReport:
    if steps < 1:
        raise AutoshardError(f"--steps {steps} must be at least 1")
    check_runs_here(plan)
    model_file = load_model_file(plan.model["spec"], expected_hash=plan.model["hash"])
    with tempfile.TemporaryDirectory(prefix="autoshard-verify-") as tmp:
        parallel = run_parallel(plan, Path(tmp), steps, seed, lr)
        if isinstance(parallel, str):
            return VerifyReport(steps, [], [], float("nan"), float("nan"), "", parallel)
        par_losses, par_params = parallel
    ref_losses, ref_params = train_reference(model_file, plan.global_batch, steps, seed, lr)
    return compare(steps, par_losses, ref_losses, par_params, ref_params, lr)


def run_parallel(plan: Plan, workdir: Path, steps: int, seed: int, lr: float):
    """Losses and final weights of the emitted program, or the reason it failed."""
    program = write_program(plan, workdir / "train.py")
    out = workdir / "metrics"
    args = ["--steps", str(steps), "--seed", str(seed), "--lr", repr(lr), "--metrics-out", str(out)]
    proc = run_torchrun(program, plan.world_size, args, quiet=True)
    if proc.returncode != 0:
        return f"the emitted program failed (exit {proc.returncode}): {_error_line(proc.stdout)}"
    metrics = json.loads((out / "metrics.json").read_text())
    return metrics["losses"], torch.load(out / "params.pt", weights_only=True)


def _error_line(output: str) -> str:
    """The last line that names an error (torchrun ends with banners that do not)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or line.startswith("error:")]
    return (errors or lines or ["no output"])[-1][:400]


def train_reference(model_file: ModelFile, batch_size: int, steps: int, seed: int, lr: float):
    """One process, the whole global batch per step, plain AdamW: the ground truth."""
    model = build_model(model_file, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        inputs, targets = global_batch(model_file, batch_size, seed, step)
        loss = model_file.loss(model(*inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def weight_atol(lr: float) -> float:
    return WEIGHT_ATOL_PER_LR * lr


def compare(steps: int, par_losses: list[float], ref_losses: list[float], par_params: dict, ref_params: dict,
            lr: float = DEFAULT_LR) -> VerifyReport:
    loss_diffs = [abs(a - b) for a, b in zip(par_losses, ref_losses)]
    failure = ""
    if len(par_losses) != len(ref_losses):
        failure = f"the program logged {len(par_losses)} losses for {steps} steps"
    missing = sorted(set(ref_params) - set(par_params))
    if missing and not failure:
        failure = f"the program's final weights lack {missing[0]} (and {len(missing) - 1} more)"
    worst, worst_diff = "", 0.0
    for name, ref in ref_params.items():
        if name in par_params:
            diff = (par_params[name].float() - ref.float()).abs().max().item() if ref.numel() else 0.0
            if diff > worst_diff or not worst:
                worst, worst_diff = name, diff
            if not failure and not torch.allclose(par_params[name].float(), ref.float(), rtol=WEIGHT_RTOL,
                                                  atol=weight_atol(lr)):
                failure = f"weights of {name} differ by up to {diff:.3g} (rtol {WEIGHT_RTOL}, atol {weight_atol(lr):g})"
    for step, (a, b) in enumerate(zip(par_losses, ref_losses)):
        if not failure and abs(a - b) > LOSS_ATOL + LOSS_RTOL * abs(b):
            failure = f"loss at step {step} differs: {a:.8g} parallel vs {b:.8g} one process"
    return VerifyReport(steps, par_losses, ref_losses, max(loss_diffs, default=0.0), worst_diff, worst, failure)
