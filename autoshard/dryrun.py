"""``autoshard dryrun plan.json``: one rank of the plan's world runs the program's setup and two training steps on
fake tensors, and torch's memory tracker says what it held at its peak, by part, beside the plan's prediction.

For each rank asked for (default: rank 0), in this one process:

1. a fake process group of the plan's world size (torch's ``FakeStore`` and "fake" backend: collectives
   return at once) and the program's mesh on it (``runtime.build_mesh``, device type "cpu");
2. the program's setup: ``runtime.build_meta_model``, then the plan's steps (``passes.lower``) as its
   ``parallelize`` calls them, those before ``init_weights`` on the meta device, the rest under
   ``FakeTensorMode``: the rank's shards, optimizer and every activation are fake tensors (shapes, no memory);
3. the program's SPMD loop (``runtime.take_samples``, ``split_microbatches``, ``take_sequence_shard``,
   ``grad_sync``, ``context_parallel``, ``autocast`` at the plan's precision) for ``steps`` steps under
   ``torch.distributed._tools.mem_tracker.MemTracker``, which counts every live tensor by what it is.

The tracker's parts map to the plan's (``cost.rank_memory``): parameters and buffers -> weights, gradients
-> grads, optimizer state -> optimizer, activations -> activations, temporaries -> transient. Nothing real is
allocated beyond the meta model's record, so an 8B or 70B plan's rank runs here.

What it does not see: kernels' workspaces and the caching allocator's fragmentation; fake tensors are CPU
tensors, so where a kernel saves other tensors on CUDA than on CPU (SDPA's flash backend keeps its logsumexp,
the CPU math path its attention weights), the activations follow the CPU kernels. The tracker's parts are
those alive at the moment of the peak: gradients still being reduced count as temporaries there.

Refused for now, with the reason (``refusal_reason``): pipeline plans (their schedule's sends over a fake
group move nothing), DDP (it compares parameter values across ranks at construction) and expert parallelism
(its all-to-all is sized by the routing's values).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autoshard.errors import AutoshardError
from autoshard.ir.plan import Plan

PARTS = ("weights", "grads", "optimizer", "activations", "transient")
# MemTracker's reference types -> the plan's memory parts
_PART_OF = {"Parameter": "weights", "Buffer": "weights", "Gradient": "grads", "Optstate": "optimizer",
            "Activation": "activations", "Temp": "transient", "Other": "transient"}
_PREDICTED_KEY = {"weights": "params_bytes", "grads": "grads_bytes", "optimizer": "optimizer_bytes",
                  "activations": "activations_bytes", "transient": "transient_bytes"}


@dataclass
class RankMemory:
    """One rank's measured peak by part, beside the plan's prediction (bytes)."""

    rank: int
    peak_bytes: int
    predicted_peak_bytes: int
    parts: dict[str, tuple[int, int]] = field(default_factory=dict)  # part -> (measured, predicted)

    def as_json(self) -> dict:
        return {"rank": self.rank, "peak_bytes": self.peak_bytes, "predicted_peak_bytes": self.predicted_peak_bytes,
                "parts": {part: list(pair) for part, pair in self.parts.items()}}

    @property
    def most_off(self) -> str:
        """The part whose measured bytes differ most from the prediction."""
        return max(self.parts, key=lambda part: abs(self.parts[part][0] - self.parts[part][1]))


def refusal_reason(plan: Plan) -> str | None:
    """Why a plan's rank cannot run on fake tensors over a fake group; None when it can."""
    if plan.mesh.pp > 1:
        return "a pipeline's schedule would send nothing between stages over a fake group"
    if plan.mesh.dp_cp > 1 and plan.decisions.dp_runtime.wrapper == "DistributedDataParallel":
        return "DDP checks every rank's parameters' values at construction, which fake tensors do not have"
    if plan.ep > 1:
        return "expert parallelism sizes its all-to-all from the routing's values, which fake tensors do not have"
    return None


def dryrun(plan: Plan, ranks: list[int] | None = None, steps: int = 2) -> list[RankMemory]:
    """Each rank of ``ranks`` (default: rank 0) through setup and ``steps`` steps (module doc)."""
    refusal = refusal_reason(plan)
    if refusal:
        raise AutoshardError(f"autoshard dryrun cannot run this plan yet: {refusal}; `autoshard estimate` prices "
                             f"its memory from the cost model")
    if plan.predicted is None:
        raise AutoshardError("the plan has no prediction to compare with (it does not fit); re-plan it")
    world = plan.world_size
    for rank in ranks or ():
        if not 0 <= rank < world:
            raise AutoshardError(f"--rank {rank} is not a rank of this plan's {world}; give 0 to {world - 1}")
    return [_one_rank(plan, rank, steps) for rank in ranks or [0]]


def _one_rank(plan: Plan, rank: int, steps: int) -> RankMemory:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autoshard.passes.lower import layout

    spec = layout(plan)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=spec.world_size)
    try:
        peak = _setup_and_train(plan, spec, steps)
    finally:
        dist.destroy_process_group()
    predicted = plan.predicted.memory
    parts = {part: (peak.get(part, 0), int(getattr(predicted, _PREDICTED_KEY[part]))) for part in PARTS}
    return RankMemory(rank, sum(peak.values()), int(predicted.peak_bytes), parts)


def _setup_and_train(plan: Plan, spec, steps: int) -> dict[str, int]:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from autoshard import runtime
    from autoshard.passes.lower import lower

    device = torch.device("cpu")
    mesh = runtime.build_mesh("cpu", dict(spec.mesh), dict(spec.flatten))
    model_file = runtime.load_model_file(plan.model["spec"], expected_hash=plan.model["hash"], seq_len=spec.seq_len)
    model = runtime.build_meta_model(model_file, seed=0, device=device)
    lowered = lower(plan)
    first_made = next(i for i, step in enumerate(lowered) if step.op == "init_weights")
    model = runtime.apply_steps(model, lowered[:first_made], mesh, device=device, lr=1e-3)["model"]
    tracker = MemTracker()
    with FakeTensorMode(allow_non_fake_inputs=True):
        applied = runtime.apply_steps(model, lowered[first_made:], mesh, device=device, lr=1e-3)
        model, optimizer = applied["model"], applied["optimizer"]
        tracker.track_external(model, optimizer)
        with tracker:
            for step in range(steps):
                _train_step(plan, spec, model_file, model, optimizer, mesh, device, step, tracker)
    return _parts(tracker.get_tracker_snapshot("peak"))


def _train_step(plan: Plan, spec, model_file, model, optimizer, mesh, device, step: int, tracker) -> None:
    """The emitted SPMD loop's body (``passes.codegen``), one step. The tracker's per-module records are
    cleared before each forward (it takes one forward per module; its peak stays)."""
    import torch

    from autoshard import runtime

    batch = runtime.global_batch(model_file, plan.global_batch, 0, step)
    inputs, targets = runtime.take_samples(batch, mesh, spec.data_axis, device)
    count = plan.num_microbatches
    for i, (x, y) in enumerate(runtime.split_microbatches(inputs, targets, count)):
        x, y = runtime.take_sequence_shard(x, y, mesh, spec.sequence_axis, spec.tokens_per_sample)
        tracker.reset_mod_stats()
        with runtime.grad_sync(model, enabled=i == count - 1), \
                runtime.context_parallel(mesh, spec.sequence_axis, spec.tokens_per_sample):
            with runtime.autocast(plan.precision, device):
                loss = model_file.loss(model(*x), y) / count
            loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    del loss
    torch.distributed.barrier()


def _parts(snapshot: dict) -> dict[str, int]:
    """MemTracker's peak snapshot ({device: {reference type: bytes, "Total": bytes}}) by the plan's parts."""
    parts = dict.fromkeys(PARTS, 0)
    for by_type in snapshot.values():
        for kind, nbytes in by_type.items():
            name = getattr(kind, "value", kind)
            if name in _PART_OF:
                parts[_PART_OF[name]] += int(nbytes)
    return parts


def summary_lines(plan: Plan, results: list[RankMemory]) -> list[str]:
    """A table per rank: each part measured and predicted, and the part that differs most."""
    lines = []
    for result in results:
        lines.append(f"rank {result.rank}: peak {_gib(result.peak_bytes)} measured on fake tensors, "
                     f"{_gib(result.predicted_peak_bytes)} predicted ({_ratio(result.peak_bytes, result.predicted_peak_bytes)})")
        for part in PARTS:
            measured, predicted = result.parts[part]
            lines.append(f"  {part:<12} {_gib(measured):>11} measured  {_gib(predicted):>11} predicted  "
                         f"{_ratio(measured, predicted)}")
        lines.append(f"  most off: {result.most_off}")
    return lines


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _ratio(measured: int, predicted: int) -> str:
    if predicted == 0:
        return "(none predicted)" if measured else ""
    return f"{(measured - predicted) / predicted:+.1%}"

