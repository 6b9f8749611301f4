"""Plans byte-identical before and after a change: every golden plan re-planned from its command and compared.

``python benchmarks/plan_corpus.py [KIND ...]`` runs each ``tests/test_golden_programs.py`` ``PLAN_COMMANDS``
entry (20 plan kinds: DDP, ZeRO-1/3, HSDP, dp x tp at ZeRO-0/1/2 with and without sequence parallelism, cp, ep,
bf16 and float8 on a GPU cluster, per-block recompute, four pipeline schedules, tp x pp with and without sequence
parallelism, pp x cp, compiled blocks) with ``autoshard plan``, in
parallel, and compares the bytes with the committed ``tests/golden/<kind>.plan.json``. A refactor that must not
change plans shows "identical" on every row; a change to the planner or the cost model names the plan sections
that moved, so the golden plans are remade (``python tests/test_golden_programs.py KIND``) knowingly.
Exit 1 when a plan differs. The CPU clusters' ``local-cpu`` preset sizes a rank's memory from this machine's,
so compare on one machine.

``--hash-seeds 1,2,3`` plans each kind once per ``PYTHONHASHSEED`` and compares the plans with each other rather
than with the golden ones: a plan that depends on the order a set of strings iterates in (each process's own)
differs there. Those processes also share the two cores, so each plans beside another's load.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_golden_programs import GOLDEN, PLAN_COMMANDS  # noqa: E402


def replan(kind: str, out_dir: Path, hash_seeds: tuple[str, ...] = ()) -> tuple[str, str]:
    """(kind, "identical" | the top-level plan sections whose bytes moved | the planner's error): against the
    golden plan, or with ``hash_seeds`` against the plan of the first seed."""
    outs = []
    for seed in hash_seeds or (None,):
        out = out_dir / f"{kind}.{seed}.plan.json"
        env = os.environ | ({"PYTHONHASHSEED": seed} if seed is not None else {})
        done = subprocess.run(
            [sys.executable, "-m", "autoshard", "plan", *shlex.split(PLAN_COMMANDS[kind]), "-o", str(out)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env=env,
        )
        if done.returncode != 0:
            return kind, f"plan failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}"
        outs.append(out.read_bytes())
    reference = outs[0] if hash_seeds else (GOLDEN / f"{kind}.plan.json").read_bytes()
    moved = set()
    for got in outs[1:] if hash_seeds else outs:
        if got != reference:
            old, new = json.loads(reference), json.loads(got)
            moved |= {key for key in old.keys() | new.keys() if old.get(key) != new.get(key)}
    return kind, ("differs in " + ", ".join(sorted(moved))) if moved else "identical"


def main(argv: list[str]) -> int:
    seeds: tuple[str, ...] = ()
    if "--hash-seeds" in argv:
        at = argv.index("--hash-seeds")
        seeds, argv = tuple(argv[at + 1].split(",")), argv[:at] + argv[at + 2 :]
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    unknown = [k for k in argv if k not in PLAN_COMMANDS]
    if unknown:
        print(
            f"error: unknown plan kind {', '.join(unknown)}; one of {', '.join(sorted(PLAN_COMMANDS))}", file=sys.stderr
        )
        return 2
    kinds = argv or sorted(PLAN_COMMANDS)
    with tempfile.TemporaryDirectory() as tmp, concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        rows = list(pool.map(lambda k: replan(k, Path(tmp), seeds), kinds))
    against = f"against PYTHONHASHSEED={seeds[0]}'s plan" if seeds else "against the golden plan"
    print(f"| plan kind | re-planned from its command, {against} |\n|---|---|")
    for kind, verdict in rows:
        print(f"| {kind} | {verdict} |")
    same = sum(verdict == "identical" for _, verdict in rows)
    print(f"\n{same} of {len(rows)} byte-identical")
    return 0 if same == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
