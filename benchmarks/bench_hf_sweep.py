"""Every causal LM registered in the installed transformers, planned and verified from its config folder.

    python benchmarks/bench_hf_sweep.py [--only REGEX] [--chunk I/N] [--kinds chosen,tp2,pp2,dp2-zero3]
                                        [-o runs/sweep.jsonl [--resume]]
    python benchmarks/bench_hf_sweep.py --kinds forward      (each shrunk model's eager loss, about 6 s each, no plan)
    python benchmarks/bench_hf_sweep.py --summarise A.jsonl B.jsonl ...   (the sweep's table from runs, a later run's
                                                                           case replacing an earlier one's)

For each ``*ForCausalLM`` of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: its config class's defaults, shrunk
(``autoshard.narrowing.narrowed_config``: 2 layers, or 2 of each kind where its layers differ, width 64, 4 heads and
2 key/value heads where it groups them (as many as heads where it has as many, 1 where it has 1), head dim 16, feed-forward 128, vocabulary 256, 4 experts and at most top-2 where
it has experts (in at most 2 routing groups, one dense layer before the first expert layer), sizes derived from these
kept consistent; ``is_decoder`` set where the family has it; every other
default as the library sets it, dropout included), written with ``save_pretrained`` into a folder; then ``autoshard plan hf:DIR`` on 2 CPU ranks
(``local-cpu``; 128 tokens per sample where it has no positions) for each kind (chosen: nothing pinned; tp2; pp2; dp2-zero3) and ``autoshard verify`` of the plan
(2 steps). Each case ends as one of:

    verified    verify says the program trains like one process
    refused     plan or verify said why in one line (exit 2): the reason is kept
    crashed     plan or the program failed any other way: its last line is kept
    wrong       verify ran both and they differ
    not built   the shrunk config does not build (the sweep's own limit, not autoshard's): the error is kept

Writes one JSON line per case (``-o``) as it goes, each with the code it ran (``tree``: the git tree of
``autoshard/``, "+changes" where the work tree differs from it; torch's and transformers' versions), then prints the
table (architecture x kind) and the refusals grouped by reason. The whole sweep takes hours on 2 cores: ``--chunk
I/N`` runs the I-th of N equal parts of the architectures, in the mapping's order, and ``--resume`` skips the cases
the output already holds at the same code, so that one sweep can stop and go on. ``--summarise`` says which code
its rows ran. Gemma 3n's vision tower is timm's (``pip install timm``, which brings torchvision: a CPU build only);
without it, Gemma 3n is not built.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = {"chosen": [], "tp2": ["--tp", "2"], "pp2": ["--pp", "2"], "dp2-zero3": ["--dp", "2", "--zero", "3"]}
TIMEOUT_S = 900
# tokens per sample of a model without position embeddings: the narrowed positions (``NARROW_SIZES``' 128), so that
# it (Mamba's, whose reference scan is a Python loop per token on CPUs) runs as many tokens as the others, not
# hf:DIR's 2,048 (FalconMamba's verify ran past 14 minutes at 2,048); a model with positions takes hf:DIR's own
# default from them (RoBERTa's numbering from the padding index + 1 leaves 126 of its 128)
SEQ_LEN = 128
POSITIONS = ("max_position_embeddings", "n_positions")


def code() -> dict:
    """What a case runs: the git tree of ``autoshard/`` (its hash, "+changes" where the work tree differs), torch's
    and transformers' versions."""
    import torch
    import transformers

    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    tree = git("rev-parse", "HEAD:autoshard")[:12] + ("+changes" if git("status", "--porcelain", "autoshard") else "")
    return {"tree": tree, "torch": torch.__version__, "transformers": transformers.__version__}


def done_cases(path: str, ran: dict) -> set[tuple[str, str]]:
    """(model type, kind) of the cases ``path`` holds that ran this code (``--resume``)."""
    if not Path(path).exists():
        return set()
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return {(row["model_type"], row["kind"]) for row in rows if all(row.get(k) == v for k, v in ran.items())}


def architectures() -> list[tuple[str, str]]:
    """(model type, causal-LM class name) of every registered architecture, in the mapping's order."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items())


def small_config(model_type: str, architecture: str):
    """The config class's defaults narrowed (``autoshard.narrowing.narrowed_config``: width 64, 2 layers, ...);
    raises where the library refuses the result."""
    from transformers import CONFIG_MAPPING

    from autoshard.narrowing import narrowed_config

    config = narrowed_config(CONFIG_MAPPING[model_type]())
    config.architectures = [architecture]
    if getattr(config, "is_decoder", None) is False:  # an encoder family's causal LM, as transformers asks for it
        config.is_decoder = True
    return config


def write_folder(model_type: str, architecture: str, folder: Path) -> str:
    """The shrunk config saved into ``folder``, built once on meta to check it builds: "" or why not."""
    try:
        import torch
        import transformers

        config = small_config(model_type, architecture)
        with torch.device("meta"):
            transformers.AutoModelForCausalLM.from_config(config)
        folder.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(str(folder))
        return ""
    except Exception as exc:  # noqa: BLE001 (any failure of the library on its own defaults is reported)
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
        return f"{type(exc).__name__}: {first}"[:300]


# The "forward" kind: the folder read as hf:DIR reads it, the model built and its loss computed on example_batch(2)
# eagerly on the CPU, nothing planned: a minute-scale check of the shrink across every architecture
FORWARD = """
import sys, torch
from autoshard.modelfile import load_model_file
model_file = load_model_file("hf:" + sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None)
torch.manual_seed(0)
inputs, targets = model_file.example_batch(2)
loss = model_file.loss(model_file.build()(*inputs), targets)
if not torch.isfinite(loss):
    raise SystemExit(f"error: a non-finite loss ({loss.item()})")
"""
FORWARD_TIMEOUT_S = 120


def run_case(folder: Path, kind: str) -> dict:
    """plan then verify one kind (``forward``: the forward alone): {"outcome", "detail", "seconds"}."""
    start = time.perf_counter()
    if kind == "forward":
        ran = _python(["-c", FORWARD, str(folder), *_seq_len(folder)[1:]], FORWARD_TIMEOUT_S)
        outcome = ("verified", "") if ran.returncode == 0 else ("crashed", _failure(ran)[1])
        return {"outcome": outcome[0], "detail": outcome[1], "seconds": round(time.perf_counter() - start, 1)}
    plan = folder / f"{kind}.plan.json"
    planned = _autoshard(
        ["plan", f"hf:{folder}", "--cluster", "local-cpu", "--devices-per-node", "2", *_seq_len(folder)]
        + ["--global-batch", "8", *KINDS[kind], "-o", str(plan)]
    )
    if planned.returncode != 0 or not plan.exists():
        outcome = _failure(planned)
    else:
        verified = _autoshard(["verify", str(plan), "--steps", "2"])
        outcome = ("verified", "") if verified.returncode == 0 else _failure(verified)
    return {"outcome": outcome[0], "detail": outcome[1], "seconds": round(time.perf_counter() - start, 1)}


def _seq_len(folder: Path) -> list[str]:
    """``--seq-len SEQ_LEN`` for a config without position embeddings (nor its text model's); [] for one with."""
    config = json.loads((folder / "config.json").read_text())
    parts = [config, *(v for v in config.values() if isinstance(v, dict))]
    return [] if any(name in part for part in parts for name in POSITIONS) else ["--seq-len", str(SEQ_LEN)]


def _autoshard(argv: list[str]) -> subprocess.CompletedProcess:
    return _python(["-m", "autoshard", *argv], TIMEOUT_S)


def _python(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 124, "", f"timed out after {timeout_s} s")


def _failure(proc: subprocess.CompletedProcess) -> tuple[str, str]:
    lines = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
    last = next((line for line in reversed(lines) if line.startswith(("error:", "FAILED"))), lines[-1] if lines else "")
    if proc.returncode == 2:
        return "refused", last.removeprefix("error: ")
    if "FAILED" in last and "the emitted program failed" not in last:
        return "wrong", last
    crash = next((line for line in lines if re.match(r"rank \d+ failed:", line)), last)
    return "crashed", crash[:300]


def table(rows: list[dict], kinds: list[str]) -> str:
    """Architecture x kind, then the totals, then the refusals and crashes grouped by their line."""
    by_arch: dict[str, dict[str, dict]] = defaultdict(dict)
    for row in rows:
        by_arch[row["architecture"]][row["kind"]] = row
    lines = ["| architecture | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
    for arch, cells in by_arch.items():
        lines.append(f"| {arch} | " + " | ".join(_cell(cells.get(k)) for k in kinds) + " |")
    totals = defaultdict(int)
    for row in rows:
        totals[row["outcome"]] += 1
    lines += ["", ", ".join(f"{n} {outcome}" for outcome, n in sorted(totals.items())) + f" of {len(rows)} cases"]
    reasons: dict[tuple[str, str], list[str]] = defaultdict(list)
    for row in rows:
        if row["outcome"] != "verified":
            reasons[row["outcome"], _reason(row["detail"])].append(f"{row['architecture']} {row['kind']}")
    for (outcome, reason), cases in sorted(reasons.items(), key=lambda item: (item[0][0], -len(item[1]))):
        lines.append(f"- {outcome} ({len(cases)}): {reason} — {', '.join(cases[:8])}{' ...' if len(cases) > 8 else ''}")
    return "\n".join(lines)


def _cell(row: dict | None) -> str:
    return "" if row is None else f"{row['outcome']} ({row['seconds']:.0f} s)"


def _reason(detail: str) -> str:
    """A refusal's line without the names and numbers that differ between models (for grouping)."""
    return re.sub(r"'[^']*'|\b\d+\b", "…", detail)[:160]


def summarise(paths: list[str], kinds: list[str]) -> str:
    """The sweep's table from the JSON lines of several runs (chunks, re-runs), each case as the last file that ran
    it says, over the architectures registered now; then how many of them verify on the chosen plan, and those not
    run."""
    latest: dict[tuple[str, str], dict] = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            row = json.loads(line)
            latest[row["model_type"], row["kind"]] = row
    registered = architectures()
    rows = [latest[m, k] for m, _ in registered for k in kinds if (m, k) in latest]
    chosen = [latest[m, "chosen"] for m, _ in registered if (m, "chosen") in latest]
    verified = sum(row["outcome"] == "verified" for row in chosen)
    missing = [m for m, _ in registered if not any((m, k) in latest for k in kinds)]
    ran = defaultdict(int)
    for row in rows:
        ran[" ".join(f"{k} {row.get(k, '(not recorded)')}" for k in ("tree", "torch", "transformers"))] += 1
    return "\n".join(
        [
            table(rows, kinds),
            "",
            *(f"code: {what} ({n} cases)" for what, n in sorted(ran.items())),
            f"{len(registered)} architectures registered; {len(chosen)} run on the chosen plan, {verified} verified "
            f"there ({100 * verified / len(registered):.1f} % of those registered)",
            f"not run ({len(missing)}): {', '.join(missing)}",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--summarise", nargs="+", metavar="JSONL", help="print the table of these runs, run nothing")
    parser.add_argument("--only", metavar="REGEX", help="only the model types this matches")
    parser.add_argument("--chunk", default="1/1", metavar="I/N", help="the I-th of N parts of the architectures")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("-o", "--output", help="append one JSON line per case here")
    parser.add_argument("--resume", action="store_true", help="skip the cases --output holds at the same code")
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    if args.summarise:
        print(summarise(args.summarise, kinds))
        return
    index, parts = (int(x) for x in args.chunk.split("/"))
    chosen = [a for a in architectures() if not args.only or re.search(args.only, a[0])]
    chosen = chosen[(index - 1) * len(chosen) // parts : index * len(chosen) // parts]
    if args.resume and not args.output:
        parser.error("--resume needs -o: the file whose cases to skip")
    ran = code()
    done = done_cases(args.output, ran) if args.resume else set()
    rows = []
    start_s = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="autoshard-sweep-") as tmp:
        for model_type, architecture in chosen:
            todo = [kind for kind in kinds if (model_type, kind) not in done]
            folder = Path(tmp) / model_type
            why = write_folder(model_type, architecture, folder) if todo else ""
            for kind in todo:
                result = {"outcome": "not built", "detail": why, "seconds": 0.0} if why else run_case(folder, kind)
                row = {"architecture": architecture, "model_type": model_type, "kind": kind, **result, **ran}
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.output:
                    with open(args.output, "a") as f:
                        f.write(json.dumps(row) + "\n")
    print(table(rows, kinds))
    print(f"\n{len(rows)} cases in {time.perf_counter() - start_s:.0f} s")


if __name__ == "__main__":
    main()
