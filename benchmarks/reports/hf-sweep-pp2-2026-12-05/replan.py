"""Plan the pp2 kind of every registered architecture again (plan only, no verify) at the current tree, to compare
with the pp2 sweep's outcomes at 586cc594c20b: python benchmarks/reports/hf-sweep-pp2-2026-12-05/replan.py OUT.jsonl"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench_hf_sweep import architectures, code, write_folder  # noqa: E402

ran = code()
with tempfile.TemporaryDirectory(prefix="autoshard-replan-") as tmp, open(sys.argv[1], "w") as out:
    for model_type, architecture in architectures():
        folder = Path(tmp) / model_type
        why = write_folder(model_type, architecture, folder)
        if why:
            row = {"outcome": "not built", "detail": why}
        else:
            argv = ["plan", f"hf:{folder}", "--cluster", "local-cpu", "--devices-per-node", "2", "--global-batch", "4"]
            proc = subprocess.run(
                [sys.executable, "-m", "autoshard", *argv, "--pp", "2", "-o", str(folder / "pp2.plan.json")],
                capture_output=True,
                text=True,
                timeout=600,
            )
            lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
            row = {"outcome": "planned" if proc.returncode == 0 else "refused", "detail": (lines or [""])[-1][:400]}
        row = {"architecture": architecture, "model_type": model_type, "kind": "pp2 plan", **row, **ran}
        print(json.dumps(row), flush=True)
        out.write(json.dumps(row) + "\n")
