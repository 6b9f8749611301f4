import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.e2e.jobs_driver import keep_collector_off_imports

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The capture cache (passes.capturing.capture_cache) of this test session, not the user's; CLI subprocesses inherit it.
os.environ.setdefault("AUTOSHARD_CACHE_DIR", tempfile.mkdtemp(prefix="autoshard-test-cache-"))
# One pytest-xdist worker per core already fills the machine: a search's forked pricing worker would only add forks
# (passes.planning.price_ahead; tests/test_two_cores.py makes it fork and checks it).
os.environ.setdefault("AUTOSHARD_PRICE_AHEAD", "0")


@pytest.fixture(scope="module")
def in_repo_module():
    """``in_repo`` for a module's fixtures (captured graphs shared by its tests)."""
    here = os.getcwd()
    os.chdir(ROOT)
    yield ROOT
    os.chdir(here)


@pytest.fixture
def in_repo(monkeypatch):
    """Run in the repo root so model specs like examples/gpt.py:build resolve."""
    monkeypatch.chdir(ROOT)
    return ROOT


def pytest_itemcollected(item):
    """Under pytest-xdist (``scripts/test.sh``: ``-n auto --dist loadgroup``) each test module runs on one worker,
    so its module-scoped fixtures (captures, estimates) are made once; but the tests that ask for the session's
    shared torchrun launch of one world size (tests/e2e/one_launch.py) are one group across modules, so that launch
    is made once. (Marked as each test is collected:
    pytest-xdist reads the groups in its own ``pytest_collection_modifyitems``.)"""
    item.add_marker(pytest.mark.xdist_group(_group(item)))


def _group(item) -> str:
    own = getattr(getattr(item, "module", None), "XDIST_GROUP", None)  # a module that must not run beside another's
    if own is not None:
        return own
    if "launches" in getattr(item, "fixturenames", ()):
        return f"launch-{_launch_size(item)}"
    return item.nodeid.split("::")[0]


def _launch_size(item) -> str:
    """The world size of the shared launch ``item`` asks for (the largest, if several)."""
    cases = getattr(item.module, "LAUNCHES", None)
    if cases is None:
        return "any"
    params = getattr(getattr(item, "callspec", None), "params", {})
    asked = cases.case_of(item.originalname, params) if cases.case_of else list(cases.ranks_of)
    asked = [asked] if isinstance(asked, str) else list(asked or [])
    sizes = [cases.ranks_of[name] for name in asked if name in cases.ranks_of]
    return str(max(sizes)) if sizes else "any"


def pytest_configure(config):
    """A folder where each pytest-xdist worker leaves its shared launches' timing lines for the summary; the
    machine's CPU counters at the start (``machine_lines``)."""
    if not hasattr(config, "workerinput"):
        os.environ["AUTOSHARD_LAUNCH_TIMINGS"] = tempfile.mkdtemp(prefix="autoshard-launch-timings-")
        MACHINE_START.update(_machine_cpu_s())


MACHINE_START: dict[str, float] = {}  # the machine's CPU seconds by kind when the session started
PROC_STAT_KINDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")  # /proc/stat's "cpu" line


def _machine_cpu_s() -> dict[str, float]:
    """The whole machine's CPU seconds by kind since boot (/proc/stat), {} where there is none."""
    try:
        ticks = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return {}
    return {kind: int(t) / os.sysconf("SC_CLK_TCK") for kind, t in zip(PROC_STAT_KINDS, ticks)}


def machine_lines() -> list[str]:
    """The machine the suite ran on and its CPU over the run, everything on it counted: the same suite has read
    17.7 to 24.7 minutes on this kind of machine within a day (benchmarks/reports/ci-time-2026-12-04); steal is time
    the host gave to others."""
    now = _machine_cpu_s()
    if not (now and MACHINE_START):
        return []
    model = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")), "unknown")
    spent = ", ".join(f"{kind} {now[kind] - MACHINE_START[kind]:.0f}" for kind in ("user", "system", "idle", "steal"))
    return [f"the machine: {model}, {os.cpu_count()} cores; its CPU seconds over the run: {spent}"]


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


CPU_SECONDS: dict[str, float] = {}  # test id -> CPU seconds of its setup, call and teardown, its subprocesses included
SPANS: dict[str, tuple[float, float]] = {}  # test id -> (start, end) in seconds since the epoch: the workers' timelines
CPU_LINES = 30  # the tests that used the most CPU, in the summary
CPU_FILE_LINES = 40  # the test files that used the most CPU (every test of the file summed), in the summary


def _cpu_s() -> float:
    """User + system seconds of this process and of its children that ended (torchrun launches, CLI runs)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test's CPU seconds (``CPU_SECONDS``): on 2 cores the suite's wall is its CPU over 2, so this, not
    ``--durations``, says what a test costs (a test's wall is shared with what the other worker runs)."""
    started, start_s = _cpu_s(), time.time()
    yield
    CPU_SECONDS[item.nodeid] = _cpu_s() - started
    SPANS[item.nodeid] = (start_s, time.time())


def pytest_sessionfinish(session):
    folder = os.environ.get("AUTOSHARD_LAUNCH_TIMINGS")
    launches = sys.modules.get("e2e.one_launch")
    worker = getattr(session.config, "workerinput", {}).get("workerid", "main")
    if folder:
        lines = launches.timing_lines() if launches is not None else []
        (Path(folder) / f"{worker}.json").write_text(
            json.dumps({"launches": lines, "cpu": CPU_SECONDS, "spans": SPANS})
        )


def pytest_terminal_summary(terminalreporter):
    """Where the shared launches' time went (tests/e2e/one_launch.py), per worker; the tests that used the most
    CPU, and the suite's CPU in all."""
    folder = os.environ.get("AUTOSHARD_LAUNCH_TIMINGS")
    cpu: dict[str, float] = {}
    spans: dict[str, list] = {}
    for worker in sorted(Path(folder).glob("*.json")) if folder else []:
        record = json.loads(worker.read_text())
        cpu.update(record["cpu"])
        if record.get("spans"):
            spans[worker.stem] = list(record["spans"].values())
        if record["launches"]:
            for line in ([f"{worker.stem}:"] if worker.stem != "main" else []) + record["launches"]:
                terminalreporter.write_line(line)
    if cpu:
        terminalreporter.write_line(
            f"CPU seconds of the tests (subprocesses included): {sum(cpu.values()):.0f} in all; the largest:"
        )
        for nodeid, seconds in sorted(cpu.items(), key=lambda kv: -kv[1])[:CPU_LINES]:
            terminalreporter.write_line(f"{seconds:8.1f}  {nodeid}")
        for line in _cpu_by_file(cpu):
            terminalreporter.write_line(line)
    for line in _timeline_lines(spans) + machine_lines():
        terminalreporter.write_line(line)


def _cpu_by_file(cpu: dict[str, float]) -> list[str]:
    """The test files that used the most CPU, each test of a file summed (a shared launch counts in the file of the
    test that made it), with their tests' count: where the suite's CPU goes, file by file."""
    files: dict[str, list[float]] = {}
    for nodeid, seconds in cpu.items():
        files.setdefault(nodeid.split("::")[0], []).append(seconds)
    ranked = sorted(files.items(), key=lambda kv: -sum(kv[1]))[:CPU_FILE_LINES]
    return ["CPU seconds per test file (its tests summed), the largest:"] + [
        f"{sum(times):8.1f}  {len(times):4d} tests  {name}" for name, times in ranked
    ]


def _timeline_lines(spans: dict[str, list]) -> list[str]:
    """Each worker's last test's end and the seconds it ran tests, from the suite's first start: a worker that ends
    long before another left a core idle that long (a group too large, or scheduled late)."""
    if not spans:
        return []
    first = min(start for worker in spans.values() for start, _ in worker)
    lines = ["the workers' timelines (seconds from the first test's start):"]
    for name, worker in sorted(spans.items()):
        running = sum(end - start for start, end in worker)
        lines.append(
            f"  {name}: {len(worker)} tests, the last ended at {max(e for _, e in worker) - first:7.1f}, running tests {running:7.1f}"
        )
    return lines


@pytest.fixture(autouse=True)
def _no_torch_mode_left_behind():
    """Every test starts with torch's function and dispatch mode stacks empty. A mode a test leaves pushed (the
    fixed-randomness modes of ``runtime.randomness``: every ``torch.rand`` 0.5 after it) would change the tests
    that run after it on the same worker; it is popped here, and the test that left it is named on stderr."""
    yield
    if "torch" not in sys.modules:
        return
    import torch
    from torch.utils._python_dispatch import _len_torch_dispatch_stack, _pop_mode

    left = torch._C._len_torch_function_stack() + _len_torch_dispatch_stack()
    while _len_torch_dispatch_stack():
        _pop_mode()
    while torch._C._len_torch_function_stack():
        torch._C._pop_torch_function_stack()
    if left:
        print(
            f"\n{os.environ.get('PYTEST_CURRENT_TEST', 'a test')} left {left} torch mode(s) pushed; popped",
            file=sys.stderr,
        )


@pytest.fixture(scope="module")
def one_rank():
    """A one-rank gloo group (FSDP2, DTensor and DCP need one), made here unless a test before made one."""
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if owned:
        dist.destroy_process_group()


def pytest_collection_finish(session):
    """The cyclic garbage collector kept off what collection imported (``gc.freeze``: torch, transformers, sympy,
    autoshard, the test modules, alive all session), as in the ranks (``jobs_driver.keep_collector_off_imports``):
    seven unit test files in one process spent 18.6 of 147.7 CPU-s in collections, 9.7 of 140.3 so
    (benchmarks/reports/ci-time-2026-12-04)."""
    keep_collector_off_imports()
