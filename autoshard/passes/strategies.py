"""Strategies: the configurations the planner may choose from, with the user's pins applied.

A configuration fixes the mesh (dp, tp, pp), the ZeRO stage, the micro-batch size (and so
the number of micro-batches m = B / (dp·b)) and the recompute mode. Data parallelism and
ZeRO are planned here; tensor and pipeline degrees are fixed at 1 until those passes land,
and pinning them is refused with a clear message.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.cost.step import Config
from autoshard.errors import AutoshardError
from autoshard.ir.plan import RECOMPUTE_MODES, Mesh

ZERO_STAGES = (0, 1, 2, 3)
MAX_MICROBATCH_CHOICES = 12  # the largest divisors of the per-rank batch are tried


@dataclass(frozen=True)
class Pins:
    """Decisions the user fixed by hand; None means "choose"."""

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    zero: int | None = None
    microbatch_size: int | None = None
    recompute: str | None = None
    schedule: str | None = None

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "microbatch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise AutoshardError(f"--{name.replace('_', '-')} {value} must be a positive integer")
        if self.zero is not None and self.zero not in ZERO_STAGES:
            raise AutoshardError(f"--zero {self.zero} must be 0, 1, 2 or 3")
        if self.recompute is not None and self.recompute not in RECOMPUTE_MODES:
            raise AutoshardError(f"--recompute {self.recompute} must be one of {', '.join(RECOMPUTE_MODES)}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(k for k, v in self.__dict__.items() if v is not None)


def candidate_configs(world_size: int, global_batch: int, pins: Pins) -> list[Config]:
    """Every configuration that honours the pins, in a fixed order (for deterministic plans)."""
    refuse_unsupported(pins)
    mesh = Mesh(dp=choose_dp(world_size, global_batch, pins), tp=1, pp=1)
    per_rank = global_batch // mesh.dp
    stages = (pins.zero,) if pins.zero is not None else ZERO_STAGES
    recomputes = (pins.recompute,) if pins.recompute else RECOMPUTE_MODES
    return [
        Config(mesh=mesh, zero_stage=z, microbatch_size=b, num_microbatches=per_rank // b, recompute=r)
        for z in stages
        for b in microbatch_sizes(per_rank, pins.microbatch_size)
        for r in recomputes
    ]


def refuse_unsupported(pins: Pins) -> None:
    for name in ("tp", "pp"):
        value = getattr(pins, name)
        if value is not None and value != 1:
            raise AutoshardError(f"--{name} {value}: tensor and pipeline parallelism are not supported yet; "
                                 f"drop --{name} (or pin --{name} 1)")
    if pins.schedule not in (None, "none"):
        raise AutoshardError(f"--schedule {pins.schedule}: pipeline schedules are not supported yet; drop --schedule")


def choose_dp(world_size: int, global_batch: int, pins: Pins) -> int:
    """With tp = pp = 1 every rank is a DP rank, and each must get whole samples."""
    dp = pins.dp if pins.dp is not None else world_size
    if dp != world_size:
        raise AutoshardError(f"--dp {dp} with tp=pp=1 must equal the cluster's {world_size} devices; "
                             f"pin --dp {world_size} or change --nodes/--devices-per-node")
    if global_batch % dp:
        near = max(dp, global_batch // dp * dp)
        raise AutoshardError(f"global batch {global_batch} is not divisible by dp={dp}; use --global-batch {near} "
                             f"or {near + dp}")
    return dp


def microbatch_sizes(per_rank_batch: int, pinned: int | None) -> list[int]:
    """Divisors of the per-rank batch, largest first (fewest micro-batches)."""
    if pinned is not None:
        if per_rank_batch % pinned:
            raise AutoshardError(f"--microbatch-size {pinned} does not divide the per-rank batch {per_rank_batch}; "
                                 f"pick a divisor such as {largest_divisor_at_most(per_rank_batch, pinned)}")
        return [pinned]
    divisors = [b for b in range(per_rank_batch, 0, -1) if per_rank_batch % b == 0]
    return divisors[:MAX_MICROBATCH_CHOICES]


def largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)
