"""The records a cluster is made of: a device (``DeviceSpec``), a link (``LinkSpec``), the host's per-op and
per-step overheads (``HostOverheads``), each field with its unit, its doc and its physical bounds (``BOUNDS``),
and the checks that read them from a cluster file with one-line errors (``spec_from_mapping``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import Field, dataclass, field, fields
from typing import Any

from autoshard.errors import AutoshardError

BACKENDS = ("nccl", "gloo")


MAX_DEVICES = (
    2**18
)  # 262,144: the largest clusters today have ~10^5 devices; plans in ~2 s of CPU on 2 cores (8.6 s at 2^20)


POSITIVE = ("> 0", lambda v: v > 0)


_NON_NEGATIVE = (">= 0", lambda v: v >= 0)


_FRACTION = ("in (0, 1]", lambda v: 0 < v <= 1)


_SHARE = ("in [0, 1]", lambda v: 0 <= v <= 1)


# Physical bounds (a rule's third part: lowest, highest, unit): every figure of a cluster lies far
# inside them, and outside them the cost model's sums leave the range of CP-SAT's 64-bit integers.
#   bandwidths    1e-3 .. 1e6 GB/s (1 MB/s: a slow WAN; 1 PB/s: 300x HBM3)
#   latencies     0 .. 1e7 µs (10 s); host overheads the same
#   peak          1e-3 .. 1e6 TFLOP/s (1 GFLOP/s: one old CPU core; 1 EFLOP/s on one device)
#   memory        1 .. 2^50 bytes (1 PiB; too little memory is "no plan fits", not an error here)
#   efficiency    1e-3 .. 1
BOUNDS = {
    "bandwidth": (1e-3, 1e6, "GB/s"),
    "latency": (0.0, 1e7, "µs"),
    "tflops": (1e-3, 1e6, "TFLOP/s"),
    "memory": (1, 2**50, "bytes (2^50 = 1 PiB)"),
    "efficiency": (1e-3, 1.0, ""),
    "cores": (0.0, 1e6, "cores"),
}


_BANDWIDTH = (*POSITIVE, BOUNDS["bandwidth"])


_LATENCY = (*_NON_NEGATIVE, BOUNDS["latency"])


_TFLOPS = (*POSITIVE, BOUNDS["tflops"])


_MEMORY = (*POSITIVE, BOUNDS["memory"])


_EFFICIENCY = (*_FRACTION, BOUNDS["efficiency"])


_HOST_US = _LATENCY


NON_EMPTY = ("a non-empty string", lambda v: bool(v.strip()))


_TYPES = {"str": str, "int": int, "float": float}


_TYPE_WORDS = {str: "a string", int: "an integer", float: "a number"}


def _spec(doc: str, rule: tuple | None = None) -> Any:
    """A dataclass field that carries its own documentation and validity rule."""
    return field(metadata={"doc": doc, "rule": rule})


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or CPU process) as the cost model sees it."""

    name: str = _spec("the device name, e.g. H100-SXM-80GB", NON_EMPTY)
    peak_tflops: float = _spec("the dense peak TFLOP/s in the training precision, e.g. 989 for H100 bf16", _TFLOPS)
    memory_bytes: int = _spec("the device memory in bytes, e.g. 85899345920 for 80 GiB", _MEMORY)
    memory_bandwidth_gbps: float = _spec("the memory bandwidth in GB/s, e.g. 3350 for H100 HBM3", _BANDWIDTH)
    matmul_efficiency: float = _spec("achieved/peak FLOP/s on large matmuls, e.g. 0.8", _EFFICIENCY)
    source: str = _spec("where the figures come from (datasheet, measurement)")
    # Optional, written only when > 0: a device without float8 matmuls (CPUs, A100) has none.
    float8_tflops: float = field(
        default=0.0,
        metadata={
            "doc": "optional: the dense peak float8 TFLOP/s of its matmuls, e.g. 1979 for H100 SXM (0: none, "
            "as on CPUs and A100)",
            "rule": (*_NON_NEGATIVE, (0.0, BOUNDS["tflops"][1], "TFLOP/s")),
            "optional": True,
            "written_unless": 0.0,
        },
    )

    # Optional, written only when they differ from the defaults: the host each device is attached to, as offload
    # (``cost.offload``) sees it. Defaults: a DGX H100 (``HOST_LINK_GBPS``, ``HOST_MEMORY_BYTES``,
    # ``HOST_MEMORY_BANDWIDTH_GBPS``; their sources beside them).
    host_link_gbps: float = field(
        default=55.0,
        metadata={
            "doc": "optional: the device's link to host memory in GB/s per direction, e.g. 55 for PCIe Gen5 x16 "
            "(64 GB/s raw, about 55 achieved by pinned copies)",
            "rule": _BANDWIDTH,
            "optional": True,
            "written_unless": 55.0,
        },
    )
    host_memory_bytes: int = field(
        default=2 * 2**40,
        metadata={
            "doc": "optional: the host memory of one node in bytes, shared by its devices, e.g. 2199023255552 "
            "(2 TiB, a DGX H100)",
            "rule": _MEMORY,
            "optional": True,
            "written_unless": 2 * 2**40,
        },
    )
    host_memory_bandwidth_gbps: float = field(
        default=400.0,
        metadata={
            "doc": "optional: one node's host memory bandwidth in GB/s, shared by its devices' CPU work, e.g. 400 "
            "(a DGX H100's two Xeon 8480C: 16 channels of DDR5-4800, 614 GB/s peak, about 65% achieved)",
            "rule": _BANDWIDTH,
            "optional": True,
            "written_unless": 400.0,
        },
    )

    def __post_init__(self):
        _check_dataclass(self)

    @property
    def has_float8(self) -> bool:
        """Whether its matmuls run in float8 (torch._scaled_mm: NVIDIA SM 8.9 and later)."""
        return self.float8_tflops > 0


COLLECTIVE_NAMES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "p2p", "all_to_all")


@dataclass(frozen=True)
class LinkSpec:
    """A link as the alpha-beta model sees it: per device, per direction.

    ``collectives`` optionally gives a collective its own (latency_us, bandwidth_gbps) on this
    link, as ``autoshard calibrate`` fits them: gloo's reduce-scatter and all-gather move 4-9×
    fewer bytes per second than its broadcast, so one α-β pair cannot price them all. Without an
    entry a collective uses the link's own pair (``for_collective``)."""

    bandwidth_gbps: float = _spec("the per-device, per-direction bandwidth in GB/s, e.g. 450 for NVLink 4", _BANDWIDTH)
    latency_us: float = _spec("the small-message latency in microseconds, e.g. 3", _LATENCY)
    source: str = _spec("where the figures come from (datasheet, measurement)")
    collectives: tuple[tuple[str, float, float], ...] = field(
        default=(),
        metadata={
            "doc": "optional: per collective {latency_us, bandwidth_gbps}, as calibrate fits them",
            "rule": None,
            "composite": True,
        },
    )

    def __post_init__(self):
        _check_dataclass(self)
        object.__setattr__(self, "collectives", _check_collectives(self.collectives, "LinkSpec"))

    def for_collective(self, name: str) -> LinkSpec:
        """This link as collective ``name`` sees it: its own fitted pair where there is one."""
        for collective, latency_us, bandwidth_gbps in self.collectives:
            if collective == name:
                return LinkSpec(bandwidth_gbps, latency_us, self.source)
        return self


@dataclass(frozen=True)
class HostOverheads:
    """What the host spends around the device's work, measured by ``autoshard calibrate`` (its
    ``host_probes``); all zero when not measured (the presets). On CPU ranks (gloo) the host *is*
    the device, so these add to the roofline; on GPUs they overlap it (``cost.units``)."""

    op_forward_us: float = _spec("host time per op of the forward (one OpGraph node), e.g. 12", _HOST_US)
    op_backward_us: float = _spec("host time per op in the backward, e.g. 30", _HOST_US)
    selective_op_us: float = _spec(
        "extra per block op under selective recompute (its policy runs at every op "
        "of the forward and of the recompute), e.g. 40",
        _HOST_US,
    )
    checkpoint_block_us: float = _spec("extra per block and micro-batch under full recompute, e.g. 100", _HOST_US)
    fsdp_unit_zero2_us: float = _spec(
        "FSDP2 (ZeRO-2) host time per unit and micro-batch beyond its collectives, e.g. 2000", _HOST_US
    )
    fsdp_unit_zero3_us: float = _spec("the same for ZeRO-3 (resharded after forward), e.g. 3000", _HOST_US)
    fsdp_zero2_us_per_mib: float = _spec(
        "FSDP2 (ZeRO-2) host time per MiB of a unit's parameters and micro-batch "
        "beyond its collectives (copies in and out), e.g. 500",
        _HOST_US,
    )
    fsdp_zero3_us_per_mib: float = _spec("the same for ZeRO-3, e.g. 800", _HOST_US)
    ddp_tensor_us: float = _spec(
        "DDP's hooks per parameter tensor and micro-batch beyond the all-reduce, e.g. 50", _HOST_US
    )
    zero1_tensor_us: float = _spec(
        "ZeroRedundancyOptimizer's step per parameter tensor beyond AdamW and the "
        "weights' all-gather bytes: its broadcast's latency as issued (async) and its "
        "loop, e.g. 300",
        _HOST_US,
    )
    optimizer_tensor_us: float = _spec("AdamW step time per parameter tensor beyond its bytes, e.g. 60", _HOST_US)
    sharded_optimizer_tensor_us: float = _spec("the same for FSDP2's sharded (DTensor) parameters, e.g. 300", _HOST_US)
    pipeline_microbatch_us: float = _spec(
        "pipeline schedule time per stage and micro-batch beyond its ops and transfers, e.g. 1500", _HOST_US
    )
    pipeline_step_us: float = _spec(
        "pipeline schedule time per step beyond its micro-batches and bubble (loss "
        "and tied-weight bookkeeping), e.g. 5000",
        _HOST_US,
    )
    tp_module_us: float = _spec(
        "DTensor's host time per tensor-parallel module and micro-batch (forward and "
        "backward) beyond its collectives, e.g. 400",
        _HOST_US,
    )
    source: str = _spec("where the figures come from (autoshard calibrate)")
    # Written by calibrate since it was added; a file without it shares nothing (the default).
    shared_cores: float = field(
        default=0.0,
        metadata={
            "doc": "how many of the node's ranks run at full speed at once when they share its CPU cores: "
            "the cores / threads per rank, e.g. 2 (0: every rank has its own device, as GPUs)",
            "rule": (*_NON_NEGATIVE, BOUNDS["cores"]),
            "optional": True,
        },
    )

    # Written by calibrate since it was added; a file without it prices no split backward's own cost (the default).
    weight_group_us: float = field(
        default=0.0,
        metadata={
            "doc": "a zero-bubble schedule's split backward: its weight pass's host time per parameter group and "
            "micro-batch (one autograd call each) beyond one backward call's, e.g. 100",
            "rule": _HOST_US,
            "optional": True,
        },
    )

    # Written by calibrate since it was added; a file without it prices no such module's own cost (the default).
    sequence_module_us: float = field(
        default=0.0,
        metadata={
            "doc": "DTensor's host time per tensor-parallel module that shards no weight (a norm on a sequence or "
            "head shard, a sequence gather or scatter) and micro-batch, forward and backward, beyond its "
            "collectives, e.g. 1000",
            "rule": _HOST_US,
            "optional": True,
        },
    )

    # Written by calibrate since it was added; a file without it prices a tensor-parallel collective as the link's
    # alone (the default).
    collective_wait_us: float = field(
        default=0.0,
        metadata={
            "doc": "what a tensor-parallel collective issued between compute costs beyond its own time measured back "
            "to back (the ranks meet, the backend's worker wakes), per collective, e.g. 1500 on CPU ranks",
            "rule": _HOST_US,
            "optional": True,
        },
    )

    # Written by calibrate since it was added; a file without it prices no recomputed forward's DTensor time (the
    # default).
    tp_forward_share: float = field(
        default=0.0,
        metadata={
            "doc": "the share of DTensor's host time per tensor-parallel module (tp_module_us, sequence_module_us) "
            "spent in its forward, paid again by a forward that recompute reruns, e.g. 0.35",
            "rule": _SHARE,
            "optional": True,
        },
    )

    # Written by calibrate since it was added; a file without it prices no FSDP2 host time on a micro-batch that
    # synchronises no gradient (the default).
    fsdp_accumulate_unit_us: float = field(
        default=0.0,
        metadata={
            "doc": "FSDP2's host time per unit on a micro-batch that synchronises no gradient (its weights kept "
            "gathered, its gradients summed whole: ZeRO-0 and 1 beside tp or pp before a step's last micro-batch, "
            "and a pipeline stage's), e.g. 500",
            "rule": _HOST_US,
            "optional": True,
        },
    )

    def __post_init__(self):
        _check_dataclass(self)

    @classmethod
    def none(cls) -> HostOverheads:
        return cls(**{f.name: 0.0 for f in fields(cls) if f.name != "source"}, source="not measured")

    @property
    def measured(self) -> bool:
        return any(getattr(self, f.name) for f in fields(self) if f.name != "source")


def spec_dict(spec: DeviceSpec | LinkSpec) -> dict[str, Any]:
    d = {
        f.name: getattr(spec, f.name)
        for f in fields(spec)
        if not f.metadata.get("composite")
        and ("written_unless" not in f.metadata or getattr(spec, f.name) != f.metadata["written_unless"])
    }
    if getattr(spec, "collectives", ()):
        d["collectives"] = {name: {"latency_us": lat, "bandwidth_gbps": bw} for name, lat, bw in spec.collectives}
    return d


def _check_collectives(value: Any, where: str, bounded: bool = False) -> tuple[tuple[str, float, float], ...]:
    """``collectives`` as sorted (name, latency_us, bandwidth_gbps); a mapping (from a file) or tuples."""
    fix = "fix: give each of " + ", ".join(COLLECTIVE_NAMES) + " as {latency_us: >= 0, bandwidth_gbps: > 0}, or drop it"
    if isinstance(value, Mapping):
        items = []
        for name, pair in value.items():
            if not isinstance(pair, Mapping) or set(pair) != {"latency_us", "bandwidth_gbps"}:
                raise AutoshardError(f"{where}: collectives.{name} must be {{latency_us, bandwidth_gbps}}; {fix}")
            items.append((name, pair["latency_us"], pair["bandwidth_gbps"]))
        value = items
    out = []
    for item in value:
        name, latency_us, bandwidth_gbps = item
        if name not in COLLECTIVE_NAMES:
            raise AutoshardError(f"{where}: unknown collective {name!r}; {fix}")
        lat = check_value(
            latency_us, float, _LATENCY, where, f"collectives.{name}.latency_us", "microseconds", bounded=bounded
        )
        bw = check_value(
            bandwidth_gbps, float, _BANDWIDTH, where, f"collectives.{name}.bandwidth_gbps", "GB/s", bounded=bounded
        )
        out.append((name, lat, bw))
    return tuple(sorted(out))


def spec_from_mapping(kind: type, values: Any, where: str, section: str, default_source: str | None):
    plain = [f for f in fields(kind) if not f.metadata.get("composite")]
    composite = tuple(f.name for f in fields(kind) if f.metadata.get("composite"))
    example = "{" + ", ".join(f"{f.name}: ..." for f in plain if f.name != "source") + "}"
    check_mapping(values, where, section, f"a mapping like {example}")
    names = {f.name: f.metadata["doc"] for f in fields(kind)}
    if default_source is not None and "source" not in values:
        values = {**values, "source": default_source}
    optional = composite + tuple(f.name for f in plain if f.metadata.get("optional"))  # optional: the default
    check_keys(values, names, where, section + ".", optional=optional)
    checked = {
        f.name: _check_field(values[f.name], f, where, f"{section}.{f.name}")
        for f in plain
        if f.name in values or f.name not in optional
    }
    extra = {
        name: _check_collectives(values[name], f"{where}: {section}", bounded=True)
        for name in composite
        if name in values
    }
    return kind(**checked, **extra)


def check_mapping(value: Any, where: str, what: str, fix: str) -> None:
    if not isinstance(value, Mapping):
        raise AutoshardError(
            f"{where}: {what} must be a mapping, got {short_value(value)} ({type(value).__name__}); fix: write {fix}"
        )


def check_keys(
    values: Mapping[str, Any], known: Mapping[str, str], where: str, prefix: str, optional: tuple[str, ...] = ()
) -> None:
    """No unknown keys, no missing ones but ``optional``; ``known`` maps each key to what it holds."""
    unknown = sorted(str(k) for k in values if k not in known)
    if unknown:
        raise AutoshardError(
            f"{where}: unknown field '{prefix}{unknown[0]}'; fix: remove it, or use one of {', '.join(known)}"
        )
    missing = [k for k in known if k not in values and k not in optional]
    if missing:
        raise AutoshardError(f"{where}: missing field '{prefix}{missing[0]}'; fix: add it: {known[missing[0]]}")


def check_backend(backend: Any, where: str) -> str:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise AutoshardError(
            f"{where}: backend must be one of {', '.join(BACKENDS)}, got {short_value(backend)}; "
            "fix: use nccl for GPUs, gloo for CPUs"
        )
    return backend


def _check_dataclass(spec: DeviceSpec | LinkSpec) -> None:
    """Validate every plain field from its metadata; store ints given for floats as floats. The
    physical bounds are a cluster's (``check_bounds``): links the cost model derives (a NIC shared
    by 8, a scaled link) may lie outside them."""
    for f in fields(spec):
        if f.metadata.get("composite"):
            continue
        value = _check_field(getattr(spec, f.name), f, type(spec).__name__, f.name, bounded=False)
        object.__setattr__(spec, f.name, value)


def check_bounds(spec: DeviceSpec | LinkSpec | HostOverheads, where: str, section: str) -> None:
    """Every figure of a cluster's section within its physical bounds (``BOUNDS``)."""
    for f in fields(spec):
        if not f.metadata.get("composite"):
            _check_field(getattr(spec, f.name), f, where, f"{section}.{f.name}")
    for name, latency_us, bandwidth_gbps in getattr(spec, "collectives", ()):
        check_value(latency_us, float, _LATENCY, where, f"{section}.collectives.{name}.latency_us", "microseconds")
        check_value(bandwidth_gbps, float, _BANDWIDTH, where, f"{section}.collectives.{name}.bandwidth_gbps", "GB/s")


def _check_field(value: Any, f: Field, where: str, dotted: str, bounded: bool = True) -> Any:
    return check_value(value, _TYPES[f.type], f.metadata["rule"], where, dotted, f.metadata["doc"], bounded)


def check_value(
    value: Any, kind: type, rule: tuple | None, where: str, dotted: str, doc: str, bounded: bool = True
) -> Any:
    """``value`` as ``kind`` (ints widen to floats, whole floats narrow to ints), or an error."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, kind) or (kind is float and not math.isfinite(value)):
        raise AutoshardError(
            f"{where}: {dotted} must be {_TYPE_WORDS[kind]}, got {short_value(value)} "
            f"({type(value).__name__}); fix: give {doc}"
        )
    if rule is not None and not rule[1](value):
        raise AutoshardError(f"{where}: {dotted} must be {rule[0]}, got {short_value(value)}; fix: give {doc}")
    if bounded and rule is not None and len(rule) > 2 and not rule[2][0] <= value <= rule[2][1]:
        low, high, unit = rule[2]
        high_text = f"{high:,}" if isinstance(high, int) else f"{high:g}"
        raise AutoshardError(
            f"{where}: {dotted} must be between {low:g} and {high_text}{' ' + unit if unit else ''} "
            f"(physical bounds), got {short_value(value)}; fix: give {doc}"
        )
    return value


def short_value(value: Any) -> str:
    if isinstance(value, int) and value.bit_length() > 200:  # repr of 4300+ digits raises; none is useful
        return f"an integer of {int(value.bit_length() * 0.30103) + 1} digits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
