"""Time capture + annotate + find_blocks of a large model on the meta device.

    python benchmarks/bench_capture.py                     # GPT-3 175B (benchmarks/models.py)
    python benchmarks/bench_capture.py --model benchmarks/models.py:gpt_1t

Prints parameters, nodes, blocks and the seconds of each pass; the goal for GPT-3 175B is
under 15 s on a 2-core CPU machine. Nothing is allocated: the model lives on meta.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autoshard.modelfile import load_model_file  # noqa: E402
from autoshard.passes.capturing.annotate import annotate  # noqa: E402
from autoshard.passes.capturing.blocks import find_blocks  # noqa: E402
from autoshard.passes.capturing.capture import capture  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=f"{ROOT / 'benchmarks' / 'models.py'}:gpt3_175b")
    parser.add_argument("--batch-size", type=int, default=2)
    args = parser.parse_args()

    model_file = load_model_file(args.model)
    times = {}
    start = time.perf_counter()
    graph = capture(model_file, args.batch_size)
    times["capture"] = time.perf_counter() - start
    annotate(graph)
    times["annotate"] = time.perf_counter() - start - times["capture"]
    find_blocks(graph)
    times["total"] = time.perf_counter() - start
    times["find_blocks"] = times["total"] - times["capture"] - times["annotate"]

    signatures = {b.signature for b in graph.blocks}
    name = args.model.rsplit("/", 1)[-1]
    print(f"model        {name}  (batch {graph.batch_size} x {graph.tokens_per_sample} tokens)")
    print(f"params       {graph.param_count:,} ({graph.param_count / 1e9:.1f}B)")
    print(f"nodes        {len(graph.nodes):,}")
    print(f"blocks       {len(graph.blocks)} ({len(signatures)} distinct signature(s))")
    print(f"fwd FLOPs    {graph.flops_fwd:.3e}")
    print("seconds      " + "  ".join(f"{k} {v:.2f}" for k, v in times.items()))


if __name__ == "__main__":
    main()
