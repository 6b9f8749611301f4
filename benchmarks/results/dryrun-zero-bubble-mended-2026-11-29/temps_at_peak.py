"""Which temporaries the dry run's tracker holds at a rank's peak, by the op that made them, the innermost module
running then and whether it ran in a backward:

    python benchmarks/results/dryrun-zero-bubble-mended-2026-11-29/temps_at_peak.py PLAN [RANK]

The dry run itself, with its tracker subclassed to tag each storage with the op that first made it."""

import collections
import sys

from autoshard import dryrun
from autoshard.ir.plan import load_plan

AT_PEAK: dict[str, tuple] = {}


def tagging_tracker():
    from copy import deepcopy

    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType

    class Tagging(MemTracker):
        op = None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Tagging.op = str(func)
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _track(self, reftype, t):
            super()._track(reftype, t)
            for storage in get_untyped_storages(t):
                winfo = self._WINFO.get(storage, (None, None))[0]
                if winfo is not None and not hasattr(winfo, "made_by"):
                    inner = tuple(sorted(self._mod_tracker.parents)[-1:])
                    winfo.made_by = (Tagging.op, tuple(t.shape), inner, self._mod_tracker.is_bw)

        def _update_peak_stats(self, peak_state) -> None:
            for device, snapshot in self._curr_mem_snap.items():
                if self._peak_mem.get(device, 0) < snapshot[_TOTAL_KEY]:
                    self._peak_mem[device] = snapshot[_TOTAL_KEY]
                    self._peak_mem_snap[device] = deepcopy(snapshot)
                    temps = collections.Counter()
                    for winfo, _ in list(self._WINFO.values()):
                        if winfo.reftype == _MemRefType.TEMP:
                            temps[getattr(winfo, "made_by", ("?",))] += winfo.mem_consumed
                    AT_PEAK["peak"] = (Tagging.op, sorted(self._mod_tracker.parents), temps)

    return Tagging()


def main() -> None:
    dryrun._peak_tracker = tagging_tracker
    plan = load_plan(sys.argv[1])
    (report,) = dryrun.dryrun(plan, [int(sys.argv[2]) if len(sys.argv) > 2 else 0])
    op, modules, temps = AT_PEAK["peak"]
    print(f"peak at {op} in {modules[-1] if modules else '-'}; temporaries (bytes, op, shape, module, in a backward):")
    for made_by, nbytes in temps.most_common(14):
        print(f"  {nbytes:9d} {made_by}")
    print(f"transient measured / predicted: {report.parts['transient']}; activations: {report.parts['activations']}")


if __name__ == "__main__":
    main()
