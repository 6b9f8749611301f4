"""Symbolic cost: the plan's expressions give its own figures back, scale as the cost model does,
are stored deterministically, read back without running code; `inspect --what-if` uses them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sympy

from autoshard import api
from autoshard.cli import main
from autoshard.cost.expressions import evaluate, parse_expression
from autoshard.cost.symbolic import MEMORY_PARTS, SYMBOLS, TIME_PARTS
from autoshard.ir.plan import Plan, load_plan
from autoshard.show import plan_figures

ROOT = Path(__file__).resolve().parent.parent

GPT = "examples/gpt.py:build"
LOCAL = {"cluster": "local-cpu"}
CONFIGS = {  # name -> (devices per node, global batch, pins)
    "fsdp": (4, 16, {}),  # the planner's choice: dp=4, ZeRO-3, one micro-batch
    "ddp": (2, 8, {"dp": 2, "tp": 1, "pp": 1, "zero": 0, "microbatch_size": 2, "recompute": "none"}),
    "tp": (4, 16, {"dp": 2, "tp": 2, "pp": 1, "zero": 2, "microbatch_size": 2, "recompute": "full"}),
    "pipeline": (4, 16, {"dp": 2, "tp": 1, "pp": 2, "zero": 1, "microbatch_size": 2, "schedule": "1f1b"}),
    "tp-interleaved": (
        4,
        16,
        {"dp": 1, "tp": 2, "pp": 2, "zero": 0, "microbatch_size": 2, "schedule": "interleaved-1f1b"},
    ),
}


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)
        return {
            name: api.plan(GPT, global_batch=batch, devices_per_node=devices, **LOCAL, **pins)
            for name, (devices, batch, pins) in CONFIGS.items()
        }


@pytest.fixture(scope="module")
def saved(plans, tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("plans")
    paths = {}
    for name, plan in plans.items():
        plan.save(folder / f"{name}.json")
        paths[name] = str(folder / f"{name}.json")
    return paths


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------------------- the plan's own point


def _assert_reproduces(plan: Plan, rel: float) -> None:
    got, p = plan_figures(plan), plan.predicted
    for key in ("step_time_s", "compute_s", "comm_exposed_s", "bubble_s", "tokens_per_s", "samples_per_s", "mfu"):
        assert got[key] == pytest.approx(getattr(p, key), rel=rel, abs=1e-15), key
    for key in MEMORY_PARTS:
        assert got[key] == pytest.approx(getattr(p.memory, key), rel=rel, abs=1), key
    assert got["memory_peak_bytes"] == pytest.approx(p.memory.peak_bytes, rel=rel, abs=1)
    assert got["step_time_s"] == pytest.approx(sum(got[k] for k in TIME_PARTS), rel=1e-12)


@pytest.mark.parametrize("name", CONFIGS)
def test_expressions_give_the_plans_own_figures(plans, name):
    plan = plans[name]
    assert plan.symbolic["symbols"] == {
        "B": plan.global_batch,
        "s": 64,
        "dp": plan.mesh.dp,
        "tp": plan.mesh.tp,
        "pp": plan.mesh.pp,
        "b": plan.microbatch_size,
        "v": plan.virtual_stages,
    }
    _assert_reproduces(plan, rel=1e-9)


@pytest.mark.parametrize("name", CONFIGS)
def test_saved_plans_too(saved, name):
    _assert_reproduces(load_plan(saved[name]), rel=1e-5)  # the JSON keeps 6 significant digits of `predicted`


def test_expressions_are_in_the_seven_symbols_only(plans):
    for plan in plans.values():
        sym = plan.symbolic
        for text in [sym["step_time_s"], sym["memory_peak_bytes"], *sym["parts"].values(), *sym["memory"].values()]:
            assert parse_expression(text).free_symbols <= set(SYMBOLS.values())


def test_same_inputs_give_byte_identical_plans_in_a_fresh_process(in_repo, plans):
    """sympy's printing must not depend on hash order: a process with another hash seed agrees."""
    env = {**os.environ, "PYTHONHASHSEED": "12345", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "autoshard.cli",
            "plan",
            GPT,
            "--cluster",
            "local-cpu",
            "--devices-per-node",
            "4",
            "--global-batch",
            "16",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=True,
    )
    assert proc.stdout == plans["fsdp"].to_json()


# ---------------------------------------------------------------------------- scaling laws


def test_global_batch_scales_micro_batches_not_memory(plans):
    plan = plans["ddp"]  # dp=2, b=2, m=2, DDP: gradients all-reduced once a step
    base, twice = evaluate(plan.symbolic, {}), evaluate(plan.symbolic, {"B": 16})
    for key in ("forward_s", "backward_s"):
        assert twice[key] == pytest.approx(2 * base[key])
    assert twice["optimizer_s"] == pytest.approx(base["optimizer_s"])
    assert twice["dp_comm_exposed_s"] == pytest.approx(base["dp_comm_exposed_s"])  # constant in B and s
    assert twice["grad_accumulation_s"] == pytest.approx(3 * base["grad_accumulation_s"])  # m − 1: 1 -> 3
    for key in MEMORY_PARTS:
        assert twice[key] == pytest.approx(base[key])


def test_sequence_length_between_linear_and_quadratic(plans):
    plan = plans["fsdp"]
    base, longer = evaluate(plan.symbolic, {}), evaluate(plan.symbolic, {"s": 128})
    assert 2 < longer["forward_s"] / base["forward_s"] < 4
    assert 2 <= longer["activations_bytes"] / base["activations_bytes"] < 4
    assert longer["params_bytes"] == pytest.approx(base["params_bytes"])
    assert longer["dp_comm_exposed_s"] == pytest.approx(base["dp_comm_exposed_s"])


def test_degrees_switch_parts_off(plans):
    tp = evaluate(plans["tp"].symbolic, {"tp": 1, "dp": 4})
    assert tp["tp_comm_s"] == 0 and tp["bubble_s"] == 0 and tp["p2p_s"] == 0
    base = evaluate(plans["tp"].symbolic, {})
    assert tp["params_bytes"] > base["params_bytes"]  # the sharded weights are whole again
    pipe = evaluate(plans["pipeline"].symbolic, {"pp": 1})
    assert pipe["bubble_s"] == 0 and pipe["p2p_s"] == 0
    ddp = evaluate(plans["ddp"].symbolic, {"dp": 1, "B": 4})
    assert ddp["dp_comm_exposed_s"] == 0


def test_parts_zero_at_the_plan_take_the_cost_models_coefficient(plans):
    """fsdp has tp = pp = 1 and m = 1: TP, p2p, bubble and accumulation appear when the point moves."""
    plan = plans["fsdp"]
    base = evaluate(plan.symbolic, {})
    assert base["tp_comm_s"] == base["p2p_s"] == base["bubble_s"] == base["grad_accumulation_s"] == 0
    moved = evaluate(plan.symbolic, {"tp": 2, "pp": 2, "dp": 1, "b": 2})
    assert moved["tp_comm_s"] > 0 and moved["p2p_s"] > 0 and moved["bubble_s"] > 0
    assert moved["grad_accumulation_s"] > 0


def test_bubble_is_the_schedules_share_of_a_micro_batch(plans):
    """bubble = k·(pp − 1)/v·T_mb: at the plan's point it is the priced bubble (fill and drain,
    (Σ_r T_r − T_max)/v, so 0 < k ≤ 1: the other ranks are no slower than the slowest), and
    re-evaluated elsewhere it keeps that k."""
    plan = plans["tp-interleaved"]
    assert evaluate(plan.symbolic, {})["bubble_s"] == pytest.approx(plan.predicted.bubble_s, rel=1e-6)
    shares = []
    for values in ({}, {"B": 64, "s": 32}, {"pp": 4}):
        e = evaluate(plan.symbolic, values)
        point = {**plan.symbolic["symbols"], **values}
        m = point["B"] / (point["dp"] * point["b"])
        per_microbatch = (
            sum(e[k] for k in ("forward_s", "backward_s", "recompute_s", "host_s", "tp_comm_s", "p2p_s")) / m
        )
        shares.append(e["bubble_s"] / ((point["pp"] - 1) / point["v"] * per_microbatch))
    assert 0 < shares[0] <= 1
    assert shares == pytest.approx([shares[0]] * len(shares))


# ---------------------------------------------------------------------------- reading back


def test_round_trip_and_no_code_runs():
    x = parse_expression("Piecewise((0, Eq(pp, 1)), (1, True))*B*s**2/(dp*b) + 2.5e-7*Min(B/(b*dp), pp)")
    assert float(
        x.xreplace({SYMBOLS["pp"]: 2, SYMBOLS["B"]: 8, SYMBOLS["s"]: 2, SYMBOLS["dp"]: 2, SYMBOLS["b"]: 2})
    ) == pytest.approx(8 + 5e-7)
    for text in ("__import__('os').system('true')", "B.__class__", "9**9**9", "lambda: 0", "x + 1", "open('f')"):
        with pytest.raises(ValueError):
            parse_expression(text)
    expr = (SYMBOLS["B"] + sympy.Float(0.125)) / SYMBOLS["tp"]
    assert parse_expression(sympy.sstr(expr)) == expr


def test_old_plans_load_and_what_if_says_re_plan(in_repo, capsys, saved, tmp_path):
    data = json.loads(Path(saved["ddp"]).read_text())
    del data["review"]["symbolic"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    assert load_plan(old).symbolic == {}
    code, out, err = run_cli(capsys, "inspect", str(old))
    assert code == 0 and "Time per step" in out
    code, _, err = run_cli(capsys, "inspect", str(old), "--what-if", "global_batch=32")
    assert code == 2 and "no symbolic cost" in err and "autoshard plan" in err and err.count("\n") == 1


def test_tampered_expression_is_one_line(in_repo, capsys, saved, tmp_path):
    data = json.loads(Path(saved["ddp"]).read_text())
    data["review"]["symbolic"]["parts"]["forward_s"] = "__import__('os').system('echo pwned')"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    code, out, err = run_cli(capsys, "inspect", str(bad), "--what-if", "dp=1")
    assert code == 2 and "damaged" in err and err.count("\n") == 1 and "pwned" not in out


# ---------------------------------------------------------------------------- inspect --what-if


def test_what_if_table(in_repo, capsys, saved):
    code, out, err = run_cli(
        capsys, "inspect", saved["fsdp"], "--what-if", "global_batch=2048", "--what-if", "seq_len=128"
    )
    assert code == 0 and err == ""
    assert "What if global_batch=2048 seq_len=128" in out
    for text in ("forward (ms)", "step (ms)", "tokens/s", "MFU", "activations (MiB)", "peak per rank (MiB)"):
        assert text in out
    plan = load_plan(saved["fsdp"])
    step_ms = plan_figures(plan, {"B": 2048, "s": 128})["step_time_s"] * 1e3
    assert f"{step_ms:,.3f}" in out


@pytest.mark.parametrize(
    "what_if, message",
    [
        (["seq_len=1048576"], "does not fit"),
        (["global_batch=20"], "not divisible by dp x microbatch_size = 16"),
        (["dp=8"], "degrees differ from the plan's"),
    ],
)
def test_what_if_warnings(in_repo, capsys, saved, what_if, message):
    code, out, err = run_cli(capsys, "inspect", saved["fsdp"], *(a for w in what_if for a in ("--what-if", w)))
    assert code == 0 and "What if" in out
    assert message in err and err.startswith("warning: ")


@pytest.mark.parametrize(
    "what_if, message",
    [
        ("batch=32", "global_batch, seq_len, microbatch_size, dp, tp, pp"),
        ("dp", "expected NAME=VALUE"),
        ("tp=two", "tp must be a positive integer"),
        ("global_batch=0", "global_batch must be a positive integer"),
    ],
)
def test_bad_what_if_is_one_line_exit_2(in_repo, capsys, saved, what_if, message):
    code, out, err = run_cli(capsys, "inspect", saved["ddp"], "--what-if", what_if)
    assert code == 2 and message in err and err.count("\n") == 1 and err.startswith("error: ") and out == ""
