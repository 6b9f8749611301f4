"""One calibration of R ranks with the GPT profile; its measurements fitted twice: the TP probe layouts' collectives
priced on the calibrated link (now) and on the free link that chose them (before). Writes OUT.now.yaml, OUT.before.yaml."""

import pickle
import sys
import time

from autoshard import calibrate as C
from autoshard import model_probes as mp


def main():
    R, out = int(sys.argv[1]), sys.argv[2]
    models = [mp.profile_request("examples/gpt.py:build", (1, 2, 4, 8))]
    t = time.time()
    cal = C.calibrate(R, quick=False, models=models, repeats=1)
    pickle.dump(cal.measurements, open(out + ".measurements.pkl", "wb"))
    cmd = f"autoshard calibrate --devices-per-node {R} --model examples/gpt.py:build (fit_ab.py)"
    now = C._calibration(cal.measurements, False, time.time() - t, models)
    C.write_cluster_file(__import__("pathlib").Path(out + ".now.yaml"), now, cmd)
    free = mp.probe_layouts
    mp.probe_layouts = lambda graph, priced_on=None: free(graph)
    before = C._calibration(cal.measurements, False, time.time() - t, models)
    C.write_cluster_file(
        __import__("pathlib").Path(out + ".before.yaml"), before, cmd + " before: layouts priced on the free link"
    )
    for name, c in (("now", now), ("before", before)):
        p = c.cluster.profiles[0]
        print(name, "tau", p.tp_module_s, "sigma", p.sequence_module_s, "share", p.tp_forward_share)


if __name__ == "__main__":
    main()
