"""Class tables (mean error / MAPE per mesh and schedule) of `bench_plans.py --reprice` outputs, side by side:

python classes.py A.table.txt [B.table.txt ...]
"""

import collections
import re
import statistics
import sys


def load(path):
    cls = collections.defaultdict(list)
    for line in open(path):
        m = re.match(
            r"(dp\d tp\d pp\d) (z\d) (b\d) (\S+)\s*(.*?)\s+measured\s+([\d.]+) ms\s+predicted\s+([\d.]+) ms\s+([+-][\d.]+)%",
            line,
        )
        if not m:
            continue
        mesh, z, b, rec, rest, me, pr, err = m.groups()
        sch = re.sub(r" v\d", "", rest) or "-"
        if "zb" in sch or "dualpipev" in sch:
            sch += " full" if rec == "full" else " not full"
        cls[(mesh, z if mesh.startswith("dp") and "tp1 pp1" in mesh else "", sch)].append(float(err))
    return cls


tabs = [load(p) for p in sys.argv[1:]]
for k in sorted(tabs[0]):
    print(
        f"{' '.join(k):40s} {len(tabs[0][k]):3d}",
        "  ".join(f"{statistics.fmean(t[k]):+6.1f}/{statistics.fmean(map(abs, t[k])):5.1f}" for t in tabs),
    )
