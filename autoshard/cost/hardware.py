"""Hardware presets and cluster files: where a ``Cluster`` comes from.

``load_cluster(name_or_path, nodes=None, devices_per_node=None)`` takes a preset name
(``PRESETS``) or a path to a YAML file; ``nodes`` / ``devices_per_node`` (the CLI's
``--nodes`` / ``--devices-per-node``) override the preset or file. All ``*_gbps`` are GB/s.

Presets (figures from docs/reference-numbers.md, each marked in ``source``):

    dgx-a100-80gb  A100 SXM 80GB: 312 TFLOP/s bf16, 1.83 TB/s achieved (2.04 TB/s datasheet),
                   80 GiB; NVLink 3 at the measured all-reduce busbw 235 GB/s, 3 µs; HDR IB
                   25 GB/s per GPU, 6 µs. 1 node × 8.
    dgx-h100       H100 SXM 80GB: 989 TFLOP/s bf16, 1979 float8 (datasheet, dense), 3.0 TB/s achieved
                   (3.35 TB/s datasheet), 80 GiB; NVLink 4 450 GB/s, 3 µs; 50 GB/s per GPU NIC, 6 µs.
                   1 node × 8.
    local-cpu      this machine's CPU processes over gloo, 1 node × 2; memory per process =
                   host memory / devices_per_node; speeds are rough defaults (calibrate).

Device figures are what kernels achieve, as ``autoshard calibrate`` measures them: matmul
efficiency from a large bf16 matmul, memory bandwidth from a device-to-device copy (read +
write bytes over time). Where only H100 was measured (docs/reference-numbers.md: 790-800 of 989 TFLOP/s;
3.0 of 3.35 TB/s), the A100 preset takes the same ratios of its datasheet figures.

Latencies are fitted to nccl-tests small messages (docs/reference-numbers.md) with the tree all-reduce of
``autoshard.cost.comm`` (2⌈log2 p⌉·α): 32 KiB over 8×H200 in one node ≈ 18 µs → α ≈ 3 µs;
8 B over 32 A100 ranks on HDR IB ≈ 55-58 µs → α ≈ 5.7 µs, rounded to 6 (which also gives
1 MiB ≈ 141 µs against the measured 143 µs).

Cluster file (YAML)::

    name: my-cluster              # required unless a preset is given
    nodes: 2
    devices_per_node: 8
    backend: nccl                 # nccl (GPUs) or gloo (CPUs)
    device: {name: H100-SXM-80GB, peak_tflops: 989, memory_bytes: 85899345920,
             memory_bandwidth_gbps: 3350, matmul_efficiency: 0.8,
             float8_tflops: 1979,    # optional: float8 matmuls (absent or 0: none, e.g. A100)
             host_link_gbps: 55, host_memory_bytes: 2199023255552,
             host_memory_bandwidth_gbps: 400}   # optional: the host, for --offload (defaults: a DGX H100)
    intra_node: {bandwidth_gbps: 450, latency_us: 3}   # per device per direction
    inter_node: {bandwidth_gbps: 50, latency_us: 8}    # per device's share of the NICs

Each section may carry a ``source`` (default ``"cluster file <path>"``). Or start from a
preset and override any field; a section you override keeps the preset's other fields::

    preset: dgx-h100
    nodes: 4
    inter_node: {bandwidth_gbps: 25}

Node groups (a heterogeneous cluster): instead of ``nodes``, ``device`` and ``intra_node``, a list of
groups in rank order, each with its name, nodes and a preset or its own sections; the top-level
``inter_node`` is the link between groups (``ir.topology.NodeGroup``, docs/usage.md "Node groups")::

    name: h100-a100
    devices_per_node: 8
    backend: nccl
    inter_node: {bandwidth_gbps: 25, latency_us: 6}
    groups:
      - {name: h100, nodes: 2, preset: dgx-h100}
      - {name: a100, nodes: 2, preset: dgx-a100-80gb, device: {memory_bytes: 42949672960}}

Every mistake (syntax, a non-mapping document, a missing or unknown field, a wrong type, a
non-positive bandwidth) is an ``AutoshardError`` naming the file, the field and the fix.

Reading is bounded: only a regular file (not a device such as /dev/zero, a pipe or a socket) of
at most ``MAX_CLUSTER_FILE_BYTES`` (1 MiB) is read; a document whose aliases expand to more than
``MAX_YAML_NODES`` (100,000) values, or that contains itself, is refused before it is built (a
"billion laughs" file); a key given twice in one mapping is refused, naming it (YAML would keep
the last); a number of more than ``MAX_NUMBER_DIGITS`` (30) digits is refused before Python
converts it. Every figure must then lie within its physical bounds (``ir.topology.BOUNDS``).
See ``examples/cluster.yaml``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import yaml

from autoshard.errors import AutoshardError
from autoshard.ir.topology import CLUSTER_KEYS, Cluster, DeviceSpec, LinkSpec

GIB = 2**30
_NUMBERS = "docs/reference-numbers.md"

_NVLINK_LATENCY_SOURCE = (
    "α fitted to nccl-tests all-reduce 32 KiB ≈ 18 µs on 8×H200 = 2·log2(8)·α (docs/reference-numbers.md)"
)
_IB_LATENCY_SOURCE = (
    "α fitted to nccl-tests all-reduce 8 B ≈ 55-58 µs on 32 A100 over HDR IB = 2·log2(32)·α (docs/reference-numbers.md)"
)

# NVIDIA H100 SXM (and H200, the same Hopper die) datasheet: 1,979 dense FP8 Tensor Core TFLOP/s ("3,958*"
# with sparsity), twice the 989 of bf16. A100 has no float8 Tensor Cores (float8_tflops 0).
H100_SXM_FLOAT8_TFLOPS = 1979.0

A100_SXM_80GB = DeviceSpec(
    name="A100-SXM-80GB",
    peak_tflops=312.0,
    memory_bytes=80 * GIB,
    memory_bandwidth_gbps=1830.0,
    matmul_efficiency=0.8,
    source=f"NVIDIA datasheet via {_NUMBERS} (312 TFLOP/s bf16, ~2.0 TB/s (2039 GB/s), 80 GB); matmul_efficiency "
    "and memory_bandwidth_gbps assumed at the measured H100 ratios (790-800/989 TFLOP/s; copy 3.0/3.35 "
    "TB/s: 0.896 × 2039 ≈ 1830 GB/s); calibrate. Host (DGX A100 user guide): PCIe Gen4 x16 per GPU (32 GB/s raw, "
    "about 25 achieved by pinned copies), 1 TiB of DDR4 (2 TiB optional), two EPYC 7742 with 16 channels of "
    "DDR4-3200 (410 GB/s peak, about 65 % achieved as on the H100 preset: 265 GB/s)",
    host_link_gbps=25.0,
    host_memory_bytes=2**40,
    host_memory_bandwidth_gbps=265.0,
)
H100_SXM_80GB = DeviceSpec(
    name="H100-SXM-80GB",
    peak_tflops=989.0,
    memory_bytes=80 * GIB,
    memory_bandwidth_gbps=3000.0,
    matmul_efficiency=0.8,
    source=f"NVIDIA datasheet via {_NUMBERS} (~989 TFLOP/s bf16, ~3.35 TB/s, 80 GB); matmul_efficiency "
    "from 8192³ bf16 matmul measured 790-800 TFLOP/s and memory_bandwidth_gbps from a device-to-device "
    "copy measured ≈ 3.0 TB/s (read + write) on one H100 (docs/reference-numbers.md); float8_tflops: "
    "1979 dense FP8 Tensor Core TFLOP/s (3958 with sparsity), NVIDIA H100 SXM datasheet",
    float8_tflops=H100_SXM_FLOAT8_TFLOPS,
)
NVLINK3 = LinkSpec(
    bandwidth_gbps=235.0,
    latency_us=3.0,
    source="NCCL all-reduce busbw ≈ 235 GB/s for large messages on 8×A100 in one node (ml-engineering, "
    "docs/reference-numbers.md), ≈ 80% of NVLink 3's 300 GB/s per GPU per direction (Narayanan et al. SC21 §5); "
    f"{_NVLINK_LATENCY_SOURCE}",
)
NVLINK4 = LinkSpec(
    bandwidth_gbps=450.0,
    latency_us=3.0,
    source="NVLink 4 450 GB/s per GPU per direction, NVIDIA DGX H100 datasheet (measured all-reduce busbw "
    f"464-481 GB/s for 1-16 GiB on 8×H200, nccl-tests); {_NVLINK_LATENCY_SOURCE}",
)
HDR_IB_PER_GPU = LinkSpec(
    bandwidth_gbps=25.0,
    latency_us=6.0,
    source=f"8 × 200 Gb/s HDR IB per DGX A100 ≈ 25 GB/s per GPU, Narayanan et al. SC21 §5; {_IB_LATENCY_SOURCE}",
)
NDR_PER_GPU = LinkSpec(
    bandwidth_gbps=50.0,
    latency_us=6.0,
    source=f"8 × 400 Gb/s NICs per DGX H100 ≈ 50 GB/s per GPU, NVIDIA datasheet; latency assumed as HDR: "
    f"{_IB_LATENCY_SOURCE}",
)

_ROUGH = "rough default; run `autoshard calibrate`"


def host_memory_bytes() -> int:
    """Physical memory of this machine: /proc/meminfo MemTotal, else sysconf."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024  # the figure is in kB (KiB)
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _local_cpu(devices_per_node: int = 2) -> Cluster:
    device = DeviceSpec(
        name="cpu-process",
        peak_tflops=0.05,
        memory_bytes=host_memory_bytes() // devices_per_node,
        memory_bandwidth_gbps=10.0,
        matmul_efficiency=1.0,
        source=f"fp32, one process; peak_tflops and memory_bandwidth_gbps are a {_ROUGH}; "
        "memory_bytes = host MemTotal / devices_per_node",
    )
    intra = LinkSpec(2.0, 50.0, f"gloo over loopback / shared memory, {_ROUGH}")
    inter = LinkSpec(1.0, 100.0, f"gloo over TCP between hosts (~10 GbE), {_ROUGH}")
    return Cluster("local-cpu", 1, devices_per_node, device, intra, inter, "gloo")


PRESETS: dict[str, Cluster] = {
    "dgx-a100-80gb": Cluster("dgx-a100-80gb", 1, 8, A100_SXM_80GB, NVLINK3, HDR_IB_PER_GPU, "nccl"),
    "dgx-h100": Cluster("dgx-h100", 1, 8, H100_SXM_80GB, NVLINK4, NDR_PER_GPU, "nccl"),
    "local-cpu": _local_cpu(),
}
# Presets whose device memory is a share of the host's: recomputed when devices_per_node changes.
HOST_MEMORY_PRESETS = frozenset({"local-cpu"})


def load_cluster(name_or_path: str, nodes: int | None = None, devices_per_node: int | None = None) -> Cluster:
    """A preset by name, or a YAML cluster file; ``nodes`` / ``devices_per_node`` override either."""
    _check_flag("--nodes", nodes)
    _check_flag("--devices-per-node", devices_per_node)
    if name_or_path in PRESETS:
        d, where, default_source = PRESETS[name_or_path].to_dict(), f"preset {name_or_path}", None
        host_share = name_or_path in HOST_MEMORY_PRESETS
    elif _looks_like_path(name_or_path):
        d, host_share = read_cluster_file(Path(name_or_path))
        where = default_source = f"cluster file {name_or_path}"
    else:
        raise AutoshardError(
            f"unknown cluster {name_or_path!r}; fix: use a preset ({', '.join(PRESETS)}) "
            "or a path to a cluster YAML file (see examples/cluster.yaml)"
        )
    if "groups" in d:
        return _cluster_of_groups(d, where, nodes, devices_per_node)
    if nodes is not None:
        d["nodes"] = nodes
    if devices_per_node is not None:
        d["devices_per_node"] = devices_per_node
    if host_share and _is_count(d.get("devices_per_node")) and _is_count(d.get("nodes", 1)):
        ranks = d.get("nodes", 1) * d["devices_per_node"]  # every node of a host preset runs on this machine
        d["device"] = {**d["device"], "memory_bytes": host_memory_bytes() // ranks}
    return Cluster.from_dict(d, where=where, default_source=default_source)


def _cluster_of_groups(d: dict[str, Any], where: str, nodes: int | None, devices_per_node: int | None) -> Cluster:
    """A cluster file with node groups: each group's ``preset`` merged under its own sections (as a file's
    preset is), ``--devices-per-node`` applied to every group; ``--nodes`` refused (each group counts its own)."""
    if nodes is not None:
        raise AutoshardError(
            f"{where}: --nodes does not apply to a cluster of node groups; fix: set nodes in each group of the file"
        )
    if devices_per_node is not None:
        d["devices_per_node"] = devices_per_node
    groups = d["groups"]
    if isinstance(groups, list):
        host_ranks = _host_share_ranks(groups, d.get("devices_per_node"))
        d["groups"] = [_group_over_preset(g, where, host_ranks) for g in groups]
    return Cluster.from_dict(d, where=where, default_source=where)


def _host_share_ranks(groups: list[Any], devices_per_node: Any) -> int | None:
    """Ranks of every group of a host-memory preset (``local-cpu``): all of them run on this one machine, so they
    share its memory, Σ_g nodes_g · devices_per_node ranks of host / that count each; None where a count is not
    one (``Cluster.from_dict`` says which)."""
    host = [g for g in groups if isinstance(g, dict) and g.get("preset") in HOST_MEMORY_PRESETS]
    if not _is_count(devices_per_node) or not all(_is_count(g.get("nodes")) for g in host):
        return None
    return sum(g["nodes"] for g in host) * devices_per_node


def _group_over_preset(group: Any, where: str, host_ranks: int | None) -> Any:
    """A group's mapping with its ``preset``'s device, intra_node and inter_node under its own sections; a
    host-memory preset's device memory the host's share of each of the ``host_ranks`` ranks on it."""
    if not isinstance(group, dict) or "preset" not in group:
        return group
    group = dict(group)
    preset = group.pop("preset")
    if not isinstance(preset, str) or preset not in PRESETS:
        raise AutoshardError(
            f"{where}: a group's preset must be one of {', '.join(PRESETS)}, got {preset!r}; "
            "fix: name a preset, or drop it and give device and intra_node"
        )
    base = {key: PRESETS[preset].to_dict()[key] for key in ("device", "intra_node", "inter_node")}
    merged = _merge_preset(base, group, where, f"{where} over preset {preset}")
    memory_given = isinstance(group.get("device"), dict) and "memory_bytes" in group["device"]
    if preset in HOST_MEMORY_PRESETS and not memory_given and host_ranks:
        merged["device"] = {**merged["device"], "memory_bytes": host_memory_bytes() // host_ranks}
    return merged


def read_cluster_file(path: Path) -> tuple[dict[str, Any], bool]:
    """The file as a cluster mapping (preset merged in), and whether memory is a host share."""
    where = f"cluster file {path}"
    raw = _read_yaml(path, where)
    if "groups" in raw and "preset" in raw:
        raise AutoshardError(
            f"{where}: a cluster of node groups takes no top-level preset; fix: name a preset in each group"
        )
    preset = raw.pop("preset", None)
    if preset is None:
        return raw, False
    if not isinstance(preset, str) or preset not in PRESETS:
        raise AutoshardError(
            f"{where}: preset must be one of {', '.join(PRESETS)}, got {preset!r}; "
            "fix: name a preset, or drop 'preset' and give every field"
        )
    merged = _merge_preset(PRESETS[preset].to_dict(), raw, where, f"{where} over preset {preset}")
    memory_given = isinstance(raw.get("device"), dict) and "memory_bytes" in raw["device"]
    return merged, preset in HOST_MEMORY_PRESETS and not memory_given


MAX_CLUSTER_FILE_BYTES = 1 << 20  # 1 MiB: a calibrated cluster file with profiles is ~10 KB
MAX_YAML_NODES = 100_000  # values in the document with every alias expanded (a cluster file has ~100)


class _ClusterLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses duplicate keys and documents whose aliases expand beyond
    ``MAX_YAML_NODES`` values (a "billion laughs" file is a few lines that expand to 10⁹)."""

    def get_single_data(self):
        node = self.get_single_node()
        if node is None:
            return None
        _check_expanded_size(node)
        return self.construct_document(node)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                    seen.add(key)
                except TypeError:  # an unhashable key: the base class says so
                    continue
                if duplicate:
                    raise _DuplicateKey(key, key_node.start_mark)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):
        digits = sum(c.isdigit() for c in self.construct_scalar(node))
        if digits > MAX_NUMBER_DIGITS:  # int() of 4300+ digits raises; no field needs 30
            raise _HugeNumber(node.start_mark, digits)
        return super().construct_yaml_int(node)

    def construct_yaml_float(self, node):
        digits = sum(c.isdigit() for c in self.construct_scalar(node))
        if digits > MAX_NUMBER_DIGITS:
            raise _HugeNumber(node.start_mark, digits)
        return super().construct_yaml_float(node)


_ClusterLoader.add_constructor("tag:yaml.org,2002:int", _ClusterLoader.construct_yaml_int)
_ClusterLoader.add_constructor("tag:yaml.org,2002:float", _ClusterLoader.construct_yaml_float)
MAX_NUMBER_DIGITS = 30


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key, mark):
        super().__init__()
        self.key, self.problem_mark = key, mark


class _HugeNumber(yaml.YAMLError):
    def __init__(self, mark, digits: int):
        super().__init__()
        self.problem_mark, self.digits = mark, digits


class _TooManyNodes(yaml.YAMLError):
    pass


def _load_document(text: str) -> Any:
    """The one YAML document of ``text`` through ``_ClusterLoader`` (safe: plain data only)."""
    loader = _ClusterLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _check_expanded_size(root: yaml.Node) -> None:
    """Count the document's values with aliases expanded, without expanding them: each node once,
    its count the sum of its children's. A node inside itself (``&a [*a]``) is refused too."""
    sizes: dict[int, int] = {}  # id(node) -> expanded count; -1 while its children are counted
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        if done:
            sizes[id(node)] = 1 + sum(sizes[id(c)] for c in _children(node))
            if sizes[id(node)] > MAX_YAML_NODES:
                raise _TooManyNodes()
            continue
        state = sizes.get(id(node))
        if state is not None:
            if state < 0:  # reached again below itself
                raise _TooManyNodes()
            continue
        sizes[id(node)] = -1
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node))


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _read_text(path: Path, where: str) -> str:
    """The file's text, read only if it is a regular file of at most ``MAX_CLUSTER_FILE_BYTES``."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise AutoshardError(
            f"{where} does not exist; fix: check the path, or use a preset ({', '.join(PRESETS)})"
        ) from None
    except OSError as e:
        raise AutoshardError(
            f"{where} cannot be read ({type(e).__name__}); fix: give a readable UTF-8 YAML file"
        ) from None
    if stat.S_ISDIR(info.st_mode):
        raise AutoshardError(f"{where} cannot be read (IsADirectoryError); fix: give a readable UTF-8 YAML file")
    if not stat.S_ISREG(info.st_mode):
        raise AutoshardError(
            f"{where} is not a regular file (a device, pipe or socket); fix: give a YAML file "
            "(see examples/cluster.yaml)"
        )
    if info.st_size > MAX_CLUSTER_FILE_BYTES:
        raise AutoshardError(
            f"{where} is {info.st_size:,} bytes, more than a cluster file holds "
            f"({MAX_CLUSTER_FILE_BYTES:,}); fix: give the cluster's YAML file (see examples/cluster.yaml)"
        )
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CLUSTER_FILE_BYTES + 1)  # the file may grow after stat
        if len(data) > MAX_CLUSTER_FILE_BYTES:
            raise AutoshardError(
                f"{where} is more than {MAX_CLUSTER_FILE_BYTES:,} bytes, more than a cluster "
                "file holds; fix: give the cluster's YAML file (see examples/cluster.yaml)"
            )
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise AutoshardError(
            f"{where} cannot be read ({type(e).__name__}); fix: give a readable UTF-8 YAML file"
        ) from None


def _read_yaml(path: Path, where: str) -> dict[str, Any]:
    text = _read_text(path, where)
    try:
        raw = _load_document(text)
    except _DuplicateKey as e:
        raise AutoshardError(
            f"{where}: duplicate key {_short_key(e.key)}{_yaml_position(e)}; fix: give each field once"
        ) from None
    except _HugeNumber as e:
        raise AutoshardError(
            f"{where}: a number with {e.digits} digits{_yaml_position(e)}; fix: give every "
            f"number in at most {MAX_NUMBER_DIGITS} digits (e.g. 85899345920 or 4.5e+11)"
        ) from None
    except _TooManyNodes:
        raise AutoshardError(
            f"{where}: not a cluster file (its aliases expand to more than {MAX_YAML_NODES:,} "
            "values); fix: write the fields out as in examples/cluster.yaml, without * aliases"
        ) from None
    except yaml.YAMLError as e:
        raise AutoshardError(
            f"{where}: YAML syntax error{_yaml_position(e)}: {_yaml_problem(e)}; "
            "fix: correct the YAML (see examples/cluster.yaml)"
        ) from None
    except RecursionError:
        raise AutoshardError(
            f"{where}: not a cluster file (YAML nested too deeply); "
            "fix: write a flat mapping as in examples/cluster.yaml"
        ) from None
    if not isinstance(raw, dict):
        raise AutoshardError(
            f"{where}: the document must be a mapping of cluster fields, got "
            f"{type(raw).__name__}; fix: write 'name: ...', 'nodes: ...' etc. "
            "as in examples/cluster.yaml"
        )
    known = ("preset",) + CLUSTER_KEYS
    unknown = sorted(str(k) for k in raw if k not in known)
    if unknown:
        raise AutoshardError(f"{where}: unknown field '{unknown[0]}'; fix: remove it, or use one of {', '.join(known)}")
    return raw


def _merge_preset(base: dict[str, Any], raw: dict[str, Any], where: str, source: str) -> dict[str, Any]:
    """``raw`` over ``base``; an overridden section keeps the preset's other fields."""
    merged = {**base, **raw}
    for key in ("device", "intra_node", "inter_node", "host"):
        if key not in raw:
            continue
        if not isinstance(raw[key], dict):
            raise AutoshardError(
                f"{where}: {key} must be a mapping, got {type(raw[key]).__name__}; "
                f"fix: write {key}: {{field: value, ...}}"
            )
        merged[key] = {**base.get(key, {}), "source": source, **raw[key]}
    return merged


def _yaml_position(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    return f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""


def _short_key(key: Any) -> str:
    text = repr(key) if isinstance(key, (str, int, float, bool)) or key is None else type(key).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def _yaml_problem(e: yaml.YAMLError) -> str:
    return " ".join(str(getattr(e, "problem", None) or e).split())


def _looks_like_path(name: str) -> bool:
    return name.endswith((".yaml", ".yml")) or os.sep in name or os.path.exists(name)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_flag(flag: str, value: int | None) -> None:
    if value is not None and not _is_count(value):
        raise AutoshardError(f"{flag} {value!r} must be a positive integer; fix: pass e.g. {flag} 2")
