"""Stage cuts: split [prefix, block_0, ..., block_{L-1}, suffix] into S pipeline stages.

Stage s holds blocks [c_s, c_{s+1}) with 0 = c_0 < c_1 < ... < c_S = L (every stage at least
one block, as split points are block paths); stage 0 also holds the prefix, stage S − 1 the
suffix. With per-block time t_k, prefix time t_pre and suffix time t_suf::

    time(i, j) = Σ_{i≤k<j} t_k + t_pre·[i = 0] + t_suf·[j = L]
    mem(s, i, j) = fixed(i, j) + in_flight(s) · act(i, j)     (both sums over the same units)

    minimise   max_s time(c_s, c_{s+1})
    subject to mem(s, c_s, c_{s+1}) ≤ cap   for every stage s

solved exactly by dynamic programming over cut positions (``best_cuts``)::

    D[0][j] = time(0, j)                                        if mem(0, 0, j) ≤ cap
    D[s][j] = min_{s ≤ i < j} max(D[s−1][i], time(i, j))        over i with mem(s, i, j) ≤ cap
    answer  = D[S−1][L]

Node groups (a heterogeneous cluster, ``Cluster.groups``). Stage s runs on the group of its pp rank, so its
unit times t_k^(s), t_pre^(s), t_suf^(s) and its memory cap C_s are its group's (``PartitionProblem.stage_times``,
``stage_caps``)::

    time(s, i, j) = Σ_{i≤k<j} t_k^(s) + t_pre^(s)·[i = 0] + t_suf^(s)·[j = L]
    D[s][j] = min_{s ≤ i < j} max(D[s−1][i], time(s, i, j))   over i with mem(s, i, j) ≤ C_s

the same programme, exact, with a matrix per group: a faster group's stages take more blocks, a group with
less memory fewer.

Legal cuts. A stage begins where torch's split begins it: at each call of the block's module.
So no stage may begin at block k when k runs more than once per forward (weights shared
across depth, as in ALBERT or a looped GPT: every call would begin a stage), nor when a block
before k runs again after k begins (the boundary would be crossed twice). A ``torch.no_grad()``
region is inlined into the traced graph between calls that set the grad mode and put it back
(``runtime.grad_regions``), so no stage may begin inside one: no stage begins at a block whose
ops a region runs when the region began before the block's call (``_region_refusals``, from
the modules its body runs in; a region inside a block's module ends in that block, a rotary
table's is the prefix's, a frozen first half's refuses the cuts inside it). ``cut_refusals``
names those k with the reason; the dynamic programme takes only ranges [i, j) with i not
refused (``PartitionProblem.forbidden_starts``), and ``max_stages`` = 1 + the legal cuts bounds
the pipeline degrees the planner proposes and the pins it accepts.

Times are integer picoseconds so that equal blocks tie exactly; among equal optima the
smallest i wins at every step (the later stages take more blocks, leaving the early stages,
which hold the most micro-batches in flight under 1F1B, the fewest). O(S·L²) with numpy.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from autoshard.cost.units import stage_ranges
from autoshard.ir.graph import OpGraph
from autoshard.ir.names import block_of

PS_PER_S = 10**12
_INF = np.iinfo(np.int64).max // 4


@dataclass(frozen=True)
class PartitionProblem:
    """Per-unit figures: ``*_time_ps`` integer picoseconds, ``*_bytes`` bytes (module doc)."""

    block_time_ps: tuple[int, ...]
    prefix_time_ps: int = 0
    suffix_time_ps: int = 0
    block_fixed_bytes: tuple[float, ...] = ()
    prefix_fixed_bytes: float = 0.0
    suffix_fixed_bytes: float = 0.0
    block_act_bytes: tuple[float, ...] = ()
    prefix_act_bytes: float = 0.0
    suffix_act_bytes: float = 0.0
    in_flight: tuple[float, ...] = ()  # per stage; empty: no memory constraint
    cap_bytes: float = float("inf")
    forbidden_starts: frozenset[int] = frozenset()  # blocks no stage may begin at (``cut_refusals``)
    # node groups (module doc): per stage its (block times, prefix, suffix) ps and its cap; empty: the ones above
    stage_times: tuple[tuple[tuple[int, ...], int, int], ...] = ()
    stage_caps: tuple[float, ...] = ()

    def times_of(self, s: int) -> tuple[tuple[int, ...], int, int]:
        """Stage ``s``'s (block times, prefix time, suffix time) in ps."""
        if self.stage_times:
            return self.stage_times[s]
        return self.block_time_ps, self.prefix_time_ps, self.suffix_time_ps

    def cap_of(self, s: int) -> float:
        return self.stage_caps[s] if self.stage_caps else self.cap_bytes

    @property
    def blocks(self) -> int:
        return len(self.block_time_ps)

    def stage_time_ps(self, i: int, j: int, s: int = 0) -> int:
        blocks, prefix, suffix = self.times_of(s)
        return sum(blocks[i:j]) + prefix * (i == 0) + suffix * (j == self.blocks)

    def stage_bytes(self, s: int, i: int, j: int) -> float:
        if not self.in_flight:
            return 0.0
        first, last = i == 0, j == self.blocks
        fixed = sum(self.block_fixed_bytes[i:j]) + self.prefix_fixed_bytes * first + self.suffix_fixed_bytes * last
        act = sum(self.block_act_bytes[i:j]) + self.prefix_act_bytes * first + self.suffix_act_bytes * last
        return fixed + self.in_flight[s] * act


def best_cuts(problem: PartitionProblem, stages: int) -> tuple[int, ...] | None:
    """(c_1, ..., c_{S−1}) minimising the slowest stage under the memory cap; None if none fits."""
    n = problem.blocks
    if not 1 <= stages <= n:
        return None
    matrices: dict[tuple, np.ndarray] = {}

    def time(s: int) -> np.ndarray:  # one matrix per distinct unit times (per node group)
        key = problem.times_of(s)
        if key not in matrices:
            matrices[key] = _range_matrix(*key, np.int64)
        return matrices[key]

    fits = _fits(problem)
    best = np.where(fits(0)[0], time(0)[0], _INF)
    choice = []
    for s in range(1, stages):
        cand = np.maximum(best[:, None], time(s))
        cand = np.where(fits(s) & (best[:, None] < _INF), cand, _INF)
        choice.append(np.argmin(cand, axis=0))
        best = cand.min(axis=0)
    if best[n] >= _INF:
        return None
    return _trace(choice, n)


def bottleneck_ps(problem: PartitionProblem, cuts: tuple[int, ...]) -> int:
    return max(problem.stage_time_ps(i, j, s) for s, (i, j) in enumerate(stage_ranges(cuts, problem.blocks)))


def _range_matrix(per_block, prefix, suffix, dtype) -> np.ndarray:
    """M[i, j] = Σ_{i≤k<j} x_k + prefix·[i=0] + suffix·[j=L] for i < j (0 elsewhere)."""
    n = len(per_block)
    sums = np.concatenate([[0], np.cumsum(np.asarray(per_block, dtype=dtype))]).astype(dtype)
    m = sums[None, :] - sums[:, None]
    m[0, :] += prefix
    m[:, n] += suffix
    return np.where(_upper(n), m, 0)


def _upper(n: int) -> np.ndarray:
    """i < j, the ranges that hold at least one block."""
    idx = np.arange(n + 1)
    return idx[:, None] < idx[None, :]


def _fits(problem: PartitionProblem):
    """s -> the boolean matrix of ranges [i, j) that stage s may hold: i < j, i a legal start, mem ≤ cap."""
    upper = _upper(problem.blocks)
    if problem.forbidden_starts:
        upper = upper & ~np.isin(np.arange(problem.blocks + 1), sorted(problem.forbidden_starts))[:, None]
    if not problem.in_flight:
        return lambda s: upper
    fixed = _range_matrix(problem.block_fixed_bytes, problem.prefix_fixed_bytes, problem.suffix_fixed_bytes, np.float64)
    act = _range_matrix(problem.block_act_bytes, problem.prefix_act_bytes, problem.suffix_act_bytes, np.float64)
    return lambda s: upper & (fixed + problem.in_flight[s] * act <= problem.cap_of(s))


def _trace(choice: list[np.ndarray], n: int) -> tuple[int, ...]:
    cuts, j = [], n
    for arg in reversed(choice):
        j = int(arg[j])
        cuts.append(j)
    return tuple(reversed(cuts))


def cut_refusals(graph: OpGraph) -> dict[int, str]:
    """k -> why no pipeline stage can begin at block k (1 ≤ k < L), for the blocks where none can."""
    return dict(graph.derived("cut_refusals", lambda: _cut_refusals(graph)))


def _cut_refusals(graph: OpGraph) -> dict[int, str]:
    paths = [block.path for block in graph.blocks]
    runs = _block_runs(graph)
    calls = Counter(runs)
    first = {path: runs.index(path) for path in paths}
    last = {path: len(runs) - 1 - runs[::-1].index(path) for path in paths}
    if graph.hidden_backward:  # Reformer's reversible layers: the Function's forward runs them without gradients
        why = (
            f"{graph.hidden_backward[0]} runs inside an autograd Function, whose own backward a traced pipeline "
            f"stage would not run"
        )
        return {k: why for k in range(1, len(paths))}
    refusals = _region_refusals(graph, paths)
    for k in range(1, len(paths)):
        if k in refusals:
            continue
        path = paths[k]
        late = [p for p in paths[:k] if last[p] > first[path]]
        if calls[path] > 1:
            refusals[k] = (
                f"{path} runs {calls[path]} times per forward (one module, shared weights) and torch's "
                f"split would begin a stage at each call"
            )
        elif late:
            refusals[k] = f"{late[0]} runs again after {path} begins, so the stage boundary would be crossed twice"
    return refusals


GRAD_MODE_REGION = "higher_order.wrap_with_set_grad_enabled"


def _region_refusals(graph: OpGraph, paths: list[str]) -> dict[int, str]:
    """k -> why, for each block k a grad-mode region spans the beginning of: its body runs block k's ops and began
    before block k's call (it runs an earlier block's ops too, or was entered outside block k: a frozen middle of
    the model). ``body_modules``: the modules its body runs in, recorded at capture."""
    index = {path: k for k, path in enumerate(paths)}
    refusals: dict[int, str] = {}
    for node in graph.nodes:
        if node.target != GRAD_MODE_REGION:
            continue
        where = node.module_path or "the model's forward"
        spans = sorted({index[b] for m in node.attrs.get("body_modules", ()) if (b := block_of(m)) in index})
        inside = [k for k in spans if k > 0 and (k > spans[0] or block_of(node.module_path) != paths[k])]
        for k in inside:
            refusals.setdefault(
                k,
                f"a torch.no_grad() region in {where} runs blocks {paths[spans[0]]} to {paths[spans[-1]]}, and a stage "
                f"must not begin inside it",
            )
    return refusals


def gradient_stopping_regions(graph: OpGraph) -> list[str]:
    """Module paths of the ``torch.no_grad()`` regions that read a parameter or an activation made from one."""
    trainable = {p.name for p in graph.params if not p.is_buffer}
    needs_grad: set[str] = set()
    found = []
    for node in graph.nodes:
        reads = any(name in needs_grad or graph.placeholder_params.get(name) in trainable for name in node.inputs)
        if node.target == GRAD_MODE_REGION and node.attrs.get("arg0") is False:
            if reads:
                found.append(node.module_path or "the model's forward")
            continue  # what leaves the region needs no gradient
        if reads:
            needs_grad.add(node.name)
    return found


def _block_runs(graph: OpGraph) -> list[str]:
    """The blocks in the order they run, one entry per call (a maximal run of the block's nodes)."""
    runs: list[str] = []
    previous = None
    for node in graph.nodes:
        path = block_of(node.module_path)
        if path is not None and path != previous:
            runs.append(path)
        previous = path
    return runs


def max_stages(graph: OpGraph, refusals: dict[int, str] | None = None) -> int:
    """The most pipeline stages the model splits into: 1 + the blocks a stage may begin at (0 with no blocks)."""
    refusals = cut_refusals(graph) if refusals is None else refusals
    return max(0, len(graph.blocks) - len(refusals))
