"""A model's measured profile, as a cluster file keeps it under ``profiles``.

``autoshard calibrate --model SPEC`` measures, for each micro-batch size b and recompute mode,
one micro-batch's forward and forward + backward on every rank at once (``model_probes``), and
one AdamW step, what the emitted program's step does besides (``step_loop_s``) and how much of that is the step's
sync of the ranks (``step_sync_s``), and a pipeline schedule's own
time on the model, per stage and micro-batch and per step (``pipeline_microbatch_s``, ``pipeline_step_s``), and DTensor's
host time per tensor-parallel module on the model and the share a recomputed forward runs again (``tp_module_s``,
``sequence_module_s``, ``tp_forward_share``), and with more than two ranks the pipeline's figures again over as many
stages as the ranks allow (``wide_pipeline_stages``, ``wide_pipeline_microbatch_s``, ``wide_pipeline_step_s``: a
pipeline of 4 stages on 4 ranks runs unlike two of 2 side by side, ``pipeline_fit``); the cost model scales its per-unit split
of the work to these totals (``cost.profile``). A profile is keyed by the
captured graph's signature (``cost.profile.graph_signature``). Pure data and its checked reader: no torch here.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autoshard.errors import AutoshardError

MODES = ("none", "selective", "full")
PIPELINE_FIELDS = ("pipeline_microbatch_s", "pipeline_step_s")  # optional: files before them stay as they were
TP_FIELDS = ("tp_module_s", "sequence_module_s", "tp_forward_share")  # optional likewise
WIDE_PIPELINE_FIELDS = ("wide_pipeline_microbatch_s", "wide_pipeline_step_s")  # optional, with wide_pipeline_stages


@dataclass(frozen=True)
class ModelProfile:
    """One model measured on one cluster's devices (module doc)."""

    model: str  # the model spec, for people
    signature: str  # ``graph_signature`` of its captured graph
    ranks: int  # how many ranks ran at once
    times: Mapping[int, Mapping[str, tuple[float, float]]]  # b -> mode -> (forward_s, forward_backward_s)
    source: str
    optimizer_s: float = 0.0  # one AdamW step over all the parameters; 0: not measured
    step_loop_s: float = 0.0  # the program's step outside forward, backward and optimizer.step(); 0: not measured
    # a pipeline schedule's own time for this model (``model_probes.pipeline_residual``), per stage and micro-batch
    # and per step; None: not measured (the cluster's host probes price it)
    pipeline_microbatch_s: float | None = None
    pipeline_step_s: float | None = None
    # DTensor's host time per tensor-parallel module of this model, of a style that shards a weight and of one that
    # shards none (``model_probes.tp_residual``); None: not measured (the cluster's host probes price it)
    tp_module_s: float | None = None
    sequence_module_s: float | None = None
    tp_forward_share: float | None = None  # the share of that host time a recomputed forward runs again
    # the pipeline figures again, fitted on one pipeline of this many stages (> 2; ``model_probes.wide_stages``)
    wide_pipeline_stages: int | None = None
    wide_pipeline_microbatch_s: float | None = None
    wide_pipeline_step_s: float | None = None
    # what of ``step_loop_s`` is the loss's all-reduce over every rank (the wait for the slowest included), which a
    # step whose ranks share no collective does not run (``cost.parts.step_loop_s``); 0: not measured
    step_sync_s: float = 0.0

    def __hash__(self) -> int:  # clusters are cache keys; ``times`` is a dict, the rest names it
        return hash((self.model, self.signature, self.ranks, self.source))

    def pipeline_fit(self, stages: int) -> tuple[float, float] | None:
        """A pipeline schedule's own time for a pipeline of ``stages`` stages, (per stage and micro-batch, per step): the
        fit on the timed pipeline whose stage count is nearest (2, or ``wide_pipeline_stages``; a tie takes 2); None
        when neither was measured (the host probes price it). What a schedule costs beyond the cost model's parts
        depends on how many ranks wait on one another: on 4 CPU ranks sharing 2 cores the 2-stage fit priced pp 4
        plans of the example GPT 25-45 % over their runs (2026-11-28, RESULTS)."""
        wide = self.wide_pipeline_stages
        if wide is not None and self.wide_pipeline_microbatch_s is not None and abs(stages - wide) < abs(stages - 2):
            return self.wide_pipeline_microbatch_s, self.wide_pipeline_step_s or 0.0
        if self.pipeline_microbatch_s is None:
            return None
        return self.pipeline_microbatch_s, self.pipeline_step_s or 0.0

    def totals(self, microbatch_size: int, recompute: str) -> tuple[float, float, float] | None:
        """(forward, backward, recompute) seconds of one micro-batch of b; None when the mode was not
        measured."""
        if recompute not in MODES or any(recompute not in modes for modes in self.times.values()):
            return None
        fwd, fwd_bwd = (self._at(microbatch_size, "none", i) for i in (0, 1))
        rerun = self._at(microbatch_size, recompute, 1) - fwd_bwd if recompute != "none" else 0.0
        return max(fwd, 0.0), max(fwd_bwd - fwd, 0.0), max(rerun, 0.0)

    def _at(self, b: int, mode: str, index: int) -> float:
        """The least-squares line t(b) = a + c·b through the measured sizes (one size: t ∝ b).

        A micro-batch's time is a fixed part (its ops' dispatch) and a part per sample; each measured size
        carries the machine's noise besides, and a line through all of them averages it where joining the
        points would pass it on. Measured on 2 CPU ranks (benchmarks/results/cpu-ranks-2026-11-27/cluster6.yaml,
        GPT): full recompute's fwd + bwd read 10.5, 18.6, 21.3 ms at b 1, 2, 4, so its rerun at b 2 read 11.2 ms
        against 3.0 and 9.0 on either side, and a zero-bubble schedule's split backward runs a rerun twice."""
        sizes = sorted(self.times)
        ys = [self.times[s][mode][index] for s in sizes]
        if len(sizes) == 1:
            return ys[0] * b / sizes[0]
        line = statistics.linear_regression(sizes, ys)
        return line.intercept + line.slope * b

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "signature": self.signature,
            "ranks": self.ranks,
            "times": {b: {m: list(v) for m, v in modes.items()} for b, modes in sorted(self.times.items())},
            "optimizer_s": self.optimizer_s,
            **({"step_loop_s": self.step_loop_s} if self.step_loop_s else {}),  # files before it stay as they were
            **({"step_sync_s": self.step_sync_s} if self.step_sync_s else {}),
            **{k: getattr(self, k) for k in PIPELINE_FIELDS + TP_FIELDS if getattr(self, k) is not None},
            **(
                {"wide_pipeline_stages": self.wide_pipeline_stages}
                | {k: getattr(self, k) for k in WIDE_PIPELINE_FIELDS if getattr(self, k) is not None}
                if self.wide_pipeline_stages is not None
                else {}
            ),
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, d: Any, where: str) -> ModelProfile:
        """Inverse of ``to_dict``; a mistake is one line naming the field and the fix."""
        fix = "fix: run `autoshard calibrate --model MODEL` again, or delete the profiles section"
        required = {"model", "signature", "ranks", "times", "optimizer_s", "source"}
        optional = {
            "step_loop_s",
            "step_sync_s",
            *PIPELINE_FIELDS,
            *TP_FIELDS,
            *WIDE_PIPELINE_FIELDS,
            "wide_pipeline_stages",
        }
        if not isinstance(d, Mapping) or not required <= set(d) <= required | optional:
            raise AutoshardError(
                f"{where}: a profile must have model, signature, ranks, times, optimizer_s and source (and may "
                f"have {', '.join(sorted(optional))}); {fix}"
            )
        for key in ("optimizer_s", *(optional - {"wide_pipeline_stages"})):
            seconds = d.get(key, 0.0)
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < 1e6:
                raise AutoshardError(f"{where}: profile {d.get('model')!r}: {key} must be seconds >= 0; {fix}")
        if (
            not all(isinstance(d[k], str) for k in ("model", "signature", "source"))
            or not isinstance(d["ranks"], int)
            or isinstance(d["ranks"], bool)
            or d["ranks"] < 1
        ):
            raise AutoshardError(
                f"{where}: profile {d.get('model')!r} has a malformed model, signature, ranks or source; {fix}"
            )
        wide = d.get("wide_pipeline_stages")
        if wide is not None and (isinstance(wide, bool) or not isinstance(wide, int) or wide < 3):
            raise AutoshardError(
                f"{where}: profile {d.get('model')!r}: wide_pipeline_stages must be a stage count >= 3; {fix}"
            )
        return cls(
            d["model"],
            d["signature"],
            d["ranks"],
            _times(d["times"], f"{where}: profile {d['model']!r}", fix),
            d["source"],
            float(d["optimizer_s"]),
            float(d.get("step_loop_s", 0.0)),
            *(float(d[k]) if k in d else None for k in PIPELINE_FIELDS + TP_FIELDS),
            wide,
            *(float(d[k]) if k in d and wide is not None else None for k in WIDE_PIPELINE_FIELDS),
            step_sync_s=float(d.get("step_sync_s", 0.0)),
        )


def _times(raw: Any, where: str, fix: str) -> dict[int, dict[str, tuple[float, float]]]:
    if not isinstance(raw, Mapping) or not raw:
        raise AutoshardError(f"{where}: times must map micro-batch sizes to modes; {fix}")
    out: dict[int, dict[str, tuple[float, float]]] = {}
    for b, modes in raw.items():
        b = int(b) if isinstance(b, str) and b.isdigit() else b  # JSON (plan.json) keys are strings
        if (
            isinstance(b, bool)
            or not isinstance(b, int)
            or b < 1
            or not isinstance(modes, Mapping)
            or not modes
            or not set(modes) <= set(MODES)
            or "none" not in modes
        ):
            raise AutoshardError(
                f"{where}: times[{b!r}] must be a positive micro-batch size mapping none (and "
                f"selective, full) to [forward_s, forward_backward_s]; {fix}"
            )
        out[b] = {m: _pair(v, f"{where}: times[{b}][{m}]", fix) for m, v in modes.items()}
    return out


def _pair(v: Any, where: str, fix: str) -> tuple[float, float]:
    ok = (
        isinstance(v, (list, tuple))
        and len(v) == 2
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < 1e6 for x in v)
    )
    if not ok:
        raise AutoshardError(f"{where} must be [forward_s, forward_backward_s], two seconds >= 0; {fix}")
    return float(v[0]), float(v[1])
