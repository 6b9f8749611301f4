"""The published-runs corpus (``benchmarks/bench_published.py``): its records are complete, every row is priced by a
command or says why not, the declared fitting set keeps its bounds, the committed results are of these rows, and
a row's command, run through the CLI in-process, returns the plan of the configuration as published."""

import contextlib
import io
import json

import pytest

from autoshard.cli import main
from benchmarks.bench_megatron import ROWS as MEGATRON_ROWS
from benchmarks.bench_published import BY_NAME, FIT, HELD_OUT_ALWAYS, RESULTS, ROWS, STATUSES, torchtitan_cuts


def test_every_record_is_complete_and_priced_or_explained():
    assert len(ROWS) >= 20 and len(BY_NAME) == len(ROWS)  # names unique
    for r in ROWS:
        assert r.source and r.model and r.needs and r.emits and r.recompute and r.sharding, r.name
        hw = r.hardware
        assert hw.gpu and hw.memory and hw.power and hw.interconnect, r.name
        assert r.dp * r.tp * r.pp * r.cp == r.gpus and r.global_batch % (r.dp * r.micro_batch) == 0, r.name
        assert r.published_step_s > 0 and r.status in STATUSES, r.name
        if r.status == "not priced":
            assert not r.estimate_args() and r.reason, r.name
        else:
            args = r.estimate_args()
            assert args[0] == "estimate" and args[-1] == "--json" and hw.cluster in args, r.name
            pinned = {a: b for a, b in zip(args, args[1:]) if a.startswith("--")}
            assert (pinned["--dp"], pinned["--tp"], pinned["--pp"]) == (str(r.dp), str(r.tp), str(r.pp)), r.name
            assert pinned["--global-batch"] == str(r.global_batch), r.name
            assert pinned["--microbatch-size"] == str(r.micro_batch), r.name
        if r.status != "as run":
            assert r.reason, r.name
    # a float8 run is priced with its float8 linears (--float8: emitted beside TP and pipeline stages too, torchao's
    # float8 TP styles and each stage's linears converted after the split), never without them
    for r in ROWS:
        if any("float8" in n for n in r.needs) and r.status != "not priced":
            flags = r.estimate_args()
            assert "--float8" in flags and r.status in ("as run", "async TP", "compile"), r.name
    # the Megatron-LM rows are bench_megatron's own records and commands, not copies
    for m in MEGATRON_ROWS:
        assert BY_NAME[f"megatron-{m.name}"].estimate_args() == m.estimate_args()


def test_published_throughput_becomes_step_time():
    """torchtitan's tps = tokens a dp rank saw / (s · cp·tp·pp): step = global batch · seq / (GPUs · tps)."""
    eager = BY_NAME["tt-8b-8g-eager"]
    assert eager.published_step_s == pytest.approx(16 * 8192 / (8 * 5762))
    cp = BY_NAME["tt-405b-cp8-256k"]
    assert cp.published_step_s == pytest.approx(8 * 262144 / (512 * 16))


def test_pipeline_cuts_are_torchtitans():
    """generate_split_points (torchtitan 9dec370): 126 layers over 8 stages: 15, 16 × 6, 15."""
    cuts = torchtitan_cuts(126, 8)
    sizes = [b - a for a, b in zip((0, *cuts), (*cuts, 126))]
    assert sizes == [15, 16, 16, 16, 16, 16, 16, 15]
    assert [b - a for a, b in zip((0, *torchtitan_cuts(126, 16)), (*torchtitan_cuts(126, 16), 126))] == [7] + [
        8
    ] * 14 + [7]


def test_the_fitting_set_is_at_most_a_third_and_holds_out_torchtitans_eager_rows():
    assert set(FIT) <= set(BY_NAME) and len(set(FIT)) == len(FIT)
    assert 3 * len(FIT) <= len(ROWS)
    assert not set(HELD_OUT_ALWAYS) & set(FIT)
    assert all(BY_NAME[n].status == "as run" and BY_NAME[n].estimate_args() for n in HELD_OUT_ALWAYS)
    assert all(BY_NAME[n].estimate_args() for n in FIT)


def test_committed_results_are_of_these_rows():
    """benchmarks/results/published.json holds every row with its current command, and a prediction for each
    priced row (re-run the benchmark when a row or its command changes)."""
    doc = json.loads(RESULTS.read_text())
    got = {r["name"]: r for r in doc["rows"]}
    assert set(got) == set(BY_NAME)
    for name, r in got.items():
        assert r["command"] == BY_NAME[name].command_line(), name
        assert ("predicted_step_s" in r) == bool(BY_NAME[name].estimate_args()), name
    assert doc["summary"]["as run"]["rows"] == sum(1 for r in ROWS if r.status == "as run" and r.name not in FIT)


def test_torchtitans_8b_row_runs_through_the_cli_as_published(in_repo_module):
    """The 8-GPU eager FSDP row: FSDP 8, local batch 2 in one micro-batch, torchtitan's op-level selective
    recompute (``--recompute alternate``), on the Grand Teton cluster file (96 GiB devices); it fits them."""
    row = BY_NAME["tt-8b-8g-eager"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(row.estimate_args()) == 0
    plan = json.loads(out.getvalue())
    d, p = plan["decisions"], plan["predicted"]
    assert d["mesh"] == {"dp": 8, "tp": 1, "pp": 1} and d["zero_stage"] == 3
    assert (d["microbatch_size"], d["num_microbatches"], d["recompute"]) == (2, 1, "alternate")
    assert plan["cluster"]["name"] == "grand-teton-h100" and plan["cluster"]["device"]["memory_bytes"] == 96 * 2**30
    assert plan["cluster"]["device"]["memory_bandwidth_gbps"] == 2150
    assert p["step_time_s"] > 0 and 0 < p["memory_peak_bytes_per_rank"] < 96 * 2**30


def test_the_compiled_fsdp_rows_are_priced_as_run_with_compile_and_the_fitted_constant_comes_from_the_fit_rows():
    """The bf16 torch.compile FSDP rows are priced with --compile on; the Grand Teton file's matmul efficiency is
    what its declared fitting rows imply (``fit_matmul_efficiency``), and those rows are in the fitting set, never
    the held-out eager ones."""
    import re

    from benchmarks.bench_published import GRAND_TETON, GRAND_TETON_FIT, ROOT, fit_matmul_efficiency

    for name in ("tt-8b-8g-compile", "tt-8b-128g-compile", "ao-8b-h100-bf16"):
        args = BY_NAME[name].estimate_args()
        # their torchtitan predates its compiled loss (COMPILED_LOSS_BY_SOURCE)
        compiled = ["--compile", "on", "--compile-loss", "off", "--json"]
        assert BY_NAME[name].status == "as run" and args[-5:] == compiled, name
    assert set(GRAND_TETON_FIT) <= set(FIT) and not set(GRAND_TETON_FIT) & set(HELD_OUT_ALWAYS)
    eta, implied = fit_matmul_efficiency()
    assert set(implied) == set(GRAND_TETON_FIT) and all(0.3 < v < 0.8 for v in implied.values())
    written = re.search(r"(?m)^  matmul_efficiency: (\S+)$", (ROOT / GRAND_TETON).read_text()).group(1)
    assert float(written) == eta


def test_the_reserve_is_fitted_on_the_fitting_rows_only():
    """max_reserved / peak comes from the fitting rows that publish memory; a held-out row's memory cannot move it."""
    from benchmarks.bench_published import fit_reserve, with_reserve

    doc = json.loads(RESULTS.read_text())
    rows = doc["rows"]
    assert fit_reserve(rows) == doc["reserved_over_peak"] and 1.0 < doc["reserved_over_peak"] < 1.5
    moved = [dict(r, memory_gib=r["memory_gib"] * 2) if not r["fit"] and r.get("memory_gib") else r for r in rows]
    assert fit_reserve(moved) == fit_reserve(rows)
    row = next(r for r in with_reserve(rows, 1.25) if r["name"] == "tt-8b-8g-eager")
    assert row["predicted_reserved_gib"] == row["predicted_memory_gib"] * 1.25


def test_torchtitans_405b_rows_are_priced_compiled_in_stages_without_the_async_tp_they_ran_with():
    """Table 5 and 6: compiled blocks beside TP (and beside cp) inside pipeline stages are emitted, async TP there is
    not (``ir.decisions.async_tp_refusal``), so each row is priced compiled without it and is not "as run"."""
    six = ("tt-405b-512g-1f1b", "tt-405b-512g-interleaved-1f1b", *(f"tt-405b-cp{c}-{32 * c}k" for c in (1, 2, 4, 8)))
    for name in six:
        row, args = BY_NAME[name], BY_NAME[name].estimate_args()
        assert row.status == "async TP" and "async TP" in row.needs and row.emits == "no: async TP", name
        assert "--compile" in args and args[args.index("--compile") + 1] == "on" and "--async-tp" not in args, name
        assert args[args.index("--float8") + 1] == "tensorwise" and "--loss-parallel" in args, name
