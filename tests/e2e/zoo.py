"""The model zoo: models nobody here wrote, each planned four ways, every plan verified or refused.

    chosen      the planner's own pick for 2 CPU ranks
    tp2         tensor parallel over 2 ranks, on a cluster where sharding pays (so it really shards)
    pp2         two pipeline stages
    dp2-zero3   data parallel over 2 ranks with ZeRO-3 (FSDP2)

Each model is built at its library's defaults (dropout on). A case ends one of four ways: refused
at plan time (the one-line reason), verified (the emitted program trains like one process:
``verify.compare`` against fp32 and float64 one-process runs, dropout off in all three), failed
(trains differently: the worst defect), crashed. Every program runs in one torchrun launch
(``zoo_driver.py``): a process start and a process group for all of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

import autoshard
from autoshard.errors import AutoshardError
from autoshard.ir.recipe import Recipe
from autoshard.launch import run_torchrun, write_program
from autoshard.runtime import load_model_file
from autoshard.runtime.report import read_weights
from autoshard.verify import compare, likely_cause, reference_microbatches, train_reference

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "e2e" / "zoo_driver.py"
FAST_LINK = str(ROOT / "tests" / "clusters" / "fast_link_cpu.yaml")
STEPS, GLOBAL_BATCH, LR, SEED, RANKS = 2, 8, 1e-3, 0, 2

MODELS = {  # name: model spec
    "gpt2": "tests/models/hf_gpt2.py:build_with_dropout",
    "llama": "tests/models/hf_llama.py:build",
    "mistral": "tests/models/hf_causal_zoo.py:build_mistral",
    "qwen2": "tests/models/hf_causal_zoo.py:build_qwen2",
    "qwen3": "tests/models/hf_causal_zoo.py:build_qwen3",
    "phi3": "tests/models/hf_causal_zoo.py:build_phi3",
    "gemma": "tests/models/hf_causal_zoo.py:build_gemma",
    "gpt-neox": "tests/models/hf_causal_zoo.py:build_gpt_neox",
    "opt": "tests/models/hf_opt.py:build_with_dropout",
    "bert": "tests/models/hf_bert.py:build_with_dropout",
    "t5": "tests/models/hf_t5.py:build_with_dropout",
    "vit": "tests/models/hf_vit.py:build_with_dropout",
    "mixtral": "tests/models/hf_mixtral.py:build",
    "qwen2-moe": "tests/models/hf_causal_zoo.py:build_qwen2_moe",
    "nanogpt": "tests/models/nanogpt_upstream.py:build",
    "bn-cnn": "tests/models/bn_cnn.py:build",
    "swin": "tests/models/hf_vision_zoo.py:build_swin",
    "resnet": "tests/models/hf_vision_zoo.py:build_resnet",
    "clip": "tests/models/hf_clip.py:build",
    "whisper": "tests/models/hf_whisper.py:build",
    "mamba": "tests/models/hf_causal_zoo.py:build_mamba",
    "jamba": "tests/models/hf_causal_zoo.py:build_jamba",
}
CASES = {  # name: (cluster, pins)
    "chosen": ("local-cpu", {}),
    "tp2": (FAST_LINK, {"tp": 2, "dp": 1, "pp": 1}),
    "pp2": ("local-cpu", {"pp": 2, "dp": 1, "tp": 1}),
    "dp2-zero3": ("local-cpu", {"dp": 2, "zero": 3, "tp": 1, "pp": 1}),
}


@dataclass
class Outcome:
    status: str  # "verified", "refused", "failed", "crashed", "not run"
    detail: str = ""
    plan: autoshard.Plan | None = None

    @property
    def summary(self) -> str:
        if self.status == "verified":
            mesh = self.plan.mesh
            sharded = sum(s != "replicate" for s in self.plan.tensor_parallel.values())
            what = f"dp{mesh.dp} tp{mesh.tp} pp{mesh.pp} z{self.plan.zero_stage}" + (
                f" ep{self.plan.ep}" if self.plan.ep > 1 else ""
            )
            return f"ok ({what}{f', {sharded} TP modules' if mesh.tp > 1 else ''})"
        return f"{self.status}: {self.detail.splitlines()[0] if self.detail else ''}"


def plan_cases(models: dict[str, str], cases: dict[str, tuple], workdir: Path) -> dict[tuple, Outcome]:
    """Plan every (model, case); a refusal is an outcome, a plan becomes a program under ``workdir``."""
    out = {}
    for model, spec in models.items():
        for case in cases:
            out[model, case] = plan_case(spec, cases[case])
            if out[model, case].plan is not None:
                write_program(out[model, case].plan, workdir / model / case / "train.py")
    return out


def plan_case(spec: str, case: tuple) -> Outcome:
    """One (cluster, pins) case of ``spec`` planned for RANKS ranks: "not run" with its plan, or "refused" with the
    planner's one line."""
    cluster, pins = case
    try:
        plan = autoshard.plan(spec, cluster=cluster, global_batch=GLOBAL_BATCH, devices_per_node=RANKS, **pins)
    except AutoshardError as exc:
        return Outcome("refused", str(exc))
    return Outcome("not run", plan=plan)


def program_case(name: str, program: Path, out: Path, lr: float = LR, fixed_randomness: bool = True) -> dict:
    """One case for ``zoo_driver.py``: the program, run for STEPS steps from SEED, its metrics into ``out``;
    random ops fixed (``--fixed-randomness``) as verify runs them, unless told otherwise."""
    return {
        "name": name,
        "program": str(program),
        "metrics_out": str(out),
        "args": [
            "--steps",
            str(STEPS),
            "--seed",
            str(SEED),
            "--lr",
            repr(lr),
            "--metrics-out",
            str(out),
            *(["--fixed-randomness"] if fixed_randomness else []),
        ],
    }


def run_programs(outcomes: dict[tuple, Outcome], workdir: Path) -> str:
    """Every planned case in one launch; returns the crash block ("" when none crashed)."""
    cases = [
        program_case(f"{m}/{c}", workdir / m / c / "train.py", workdir / m / c / "out")
        for (m, c), o in outcomes.items()
        if o.plan is not None
    ]
    (workdir / "cases.json").write_text(json.dumps(cases))
    proc = run_torchrun(DRIVER, RANKS, [str(workdir / "cases.json")], quiet=True)
    return "" if proc.returncode == 0 else (proc.crash or proc.stdout[-2000:])


def judge(models: dict[str, str], outcomes: dict[tuple, Outcome], workdir: Path, crash: str) -> None:
    """Each planned case against one process (fp32 and float64), in place."""
    for (model, case), outcome in outcomes.items():
        if outcome.plan is not None:
            why = "an earlier case crashed the launch" if crash else ""
            outcomes[model, case] = settle(models[model], outcome.plan, workdir / model / case / "out", why)


def settle(spec: str, plan, out: Path, why_not_run: str) -> Outcome:
    """A planned case's outcome from what its program left in ``out``: crashed (the traceback's last lines), not run
    (``why_not_run``), or its verdict against one process (``_verdict``)."""
    if not (out / "metrics.json").exists():
        errors = sorted(out.glob("error-rank*.txt"))
        if errors:
            return Outcome("crashed", _last_lines(errors[0].read_text()), plan)
        return Outcome("not run", why_not_run, plan)
    return Outcome(*_verdict(spec, plan, out), plan)


def _last_lines(traceback_text: str) -> str:
    """The exception line, then the frame that raised it."""
    lines = traceback_text.strip().splitlines()
    return " / ".join([lines[-1], *[line.strip() for line in lines[-3:-1]]])


def _verdict(spec: str, plan, out: Path) -> tuple[str, str]:
    model_file = load_model_file(spec)
    losses = json.loads((out / "metrics.json").read_text())["losses"]
    params = read_weights(out)
    micro = reference_microbatches(model_file, plan)
    recipe = Recipe()  # the programs' (and autoshard.parallelize's) default, at their --lr
    ref32 = train_reference(
        model_file, plan.global_batch, STEPS, SEED, LR, fixed_randomness=True, microbatches=micro, recipe=recipe
    )
    ref64 = train_reference(
        model_file,
        plan.global_batch,
        STEPS,
        SEED,
        LR,
        fixed_randomness=True,
        microbatches=micro,
        dtype=torch.float64,
        recipe=recipe,
    )
    report = compare(STEPS, losses, ref32.losses, params, ref32.params, LR, exact=ref64)
    if report.ok:
        return "verified", ""
    cause = likely_cause(report, plan, model_file, SEED)
    return "failed", report.failure + (f" (likely cause: {cause})" if cause else "")


def run_zoo(models: dict[str, str], cases: dict[str, tuple], workdir: Path) -> dict[tuple, Outcome]:
    outcomes = plan_cases(models, cases, workdir)
    crash = run_programs(outcomes, workdir)
    judge(models, outcomes, workdir, crash)
    return outcomes


def table(outcomes: dict[tuple, Outcome], models: dict[str, str], cases: dict[str, tuple]) -> str:
    """Markdown: a row per model, a column per case."""
    lines = ["| model | " + " | ".join(cases) + " |", "|---|" + "---|" * len(cases)]
    for model in models:
        cells = [outcomes[model, case].summary.replace("|", "/")[:160] for case in cases]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_and_judge(plans: dict, models: dict[str, str], ranks: int, folder: Path) -> None:
    """Run each plan's program (``folder/<name>/train.py``, already written) in one torchrun launch of
    ``ranks`` (``zoo_driver.py``) and require every one to train like one process (``_verdict``);
    ``models`` names each case's model spec."""
    cases = [program_case(name, folder / name / "train.py", folder / name / "out") for name in plans]
    (folder / "cases.json").write_text(json.dumps(cases))
    proc = run_torchrun(DRIVER, ranks, [str(folder / "cases.json")], quiet=True)
    for name, plan in plans.items():
        out = folder / name / "out"
        errors = sorted(out.glob("error-rank*.txt"))
        assert not errors, f"{name} crashed: {_last_lines(errors[0].read_text())}"
        assert (out / "metrics.json").exists(), f"{name} did not run: {proc.crash or proc.stdout[-2000:]}"
        status, detail = _verdict(models[name], plan, out)
        assert status == "verified", f"{name}: {detail}"
