"""--precision: the pin, its pricing (cost.memory.pinned_precision), its plan name, its program and its refusals.

Whether each pinned precision trains like one process in that precision is tests/e2e/test_verify.py's
(gpt-bf16-zero3-2, gpt-bf16-pure-zero1-2, gpt-fp16-zero3-2).
"""

import json

import pytest
import torch

import autoshard
from autoshard.api import estimate
from autoshard.cli import main
from autoshard.cost.memory import BF16_AUTOCAST, BF16_PURE, FP16_AUTOCAST, FP32, pinned_precision
from autoshard.errors import AutoshardError
from autoshard.ir.decisions import PIN_PRECISIONS, precision_policy
from autoshard.ir.pins import Pins
from autoshard.passes.lowering.codegen import emit_program
from autoshard.passes.lowering.lower import lower
from autoshard.pipeline import PlanRequest, precision_notes

GPT = "examples/gpt.py:build"
H100 = dict(cluster="dgx-h100", nodes=1, global_batch=64)
DDP = dict(dp=8, tp=1, pp=1, zero=0, microbatch_size=8, recompute="none")


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def estimates(in_repo_module):
    """The same DDP configuration of the example GPT on a DGX H100 priced in each --precision, and unpinned."""
    plans = {p: estimate(GPT, **H100, **DDP, precision=p) for p in PIN_PRECISIONS}
    plans[None] = estimate(GPT, **H100, **DDP)
    return plans


def test_each_pin_is_the_plans_precision(estimates):
    """fp32, bf16 -> bf16-autocast (the plan format's older name), bf16-pure (fp32 weights: cast), fp16 ->
    fp16-autocast; unpinned on NCCL: bf16-autocast, as before; provenance names the pin."""
    assert {p: plan.precision for p, plan in estimates.items()} == {
        "fp32": "fp32",
        "bf16": "bf16-autocast",
        "bf16-pure": "bf16-pure",
        "fp16": "fp16-autocast",
        None: "bf16-autocast",
    }
    assert "precision" in estimates["bf16-pure"].pinned and "precision" not in estimates[None].pinned
    assert estimates[None].predicted.memory == estimates["bf16"].predicted.memory  # unpinned NCCL is bf16


def test_state_bytes_follow_the_formulas(estimates):
    """DDP holds the whole weights and optimizer state: Ψ·p and Ψ·o with (p, o) = (4, 8) for fp32, bf16 and fp16
    (fp32 master weights) and (2, 4) for bf16-pure;
    activations in 2 bytes under every 16-bit precision, 4 in fp32."""
    params = estimates["fp32"].model["params"]
    state = {
        p: m.params_bytes + m.grads_bytes + m.optimizer_bytes
        for p, m in ((p, plan.predicted.memory) for p, plan in estimates.items())
    }
    for pin, precision in (("fp32", FP32), ("bf16", BF16_AUTOCAST), ("fp16", FP16_AUTOCAST), ("bf16-pure", BF16_PURE)):
        m = estimates[pin].predicted.memory
        assert (m.params_bytes, m.optimizer_bytes) == (
            params * precision.param_bytes,
            params * precision.optimizer_bytes,
        ), pin
    assert state["bf16-pure"] * 2 == state["bf16"] == state["fp16"] == state["fp32"]
    acts = {p: plan.predicted.memory.activations_bytes for p, plan in estimates.items()}
    assert acts["bf16-pure"] == acts["bf16"] == acts["fp16"] < acts["fp32"]
    assert (
        estimates["bf16-pure"].predicted.memory_peak_bytes_per_rank
        < estimates["bf16"].predicted.memory_peak_bytes_per_rank
        < estimates["fp32"].predicted.memory_peak_bytes_per_rank
    )


def test_the_search_prices_the_pinned_precision(in_repo):
    """A searched plan (only --precision pinned) on CPU ranks records and prices it: bf16-pure's state is half
    of the unpinned fp32 plan's for the same decisions."""
    pure = autoshard.plan(
        GPT, cluster="local-cpu", devices_per_node=2, global_batch=8, dp=2, zero=0, precision="bf16-pure"
    )
    fp32 = estimate(
        GPT,
        cluster="local-cpu",
        devices_per_node=2,
        global_batch=8,
        dp=2,
        tp=1,
        pp=1,
        zero=0,
        microbatch_size=pure.microbatch_size,
        recompute=pure.recompute,
    )
    assert pure.precision == "bf16-pure" and fp32.precision == "fp32"
    m, f = pure.predicted.memory, fp32.predicted.memory
    assert (
        m.params_bytes + m.grads_bytes + m.optimizer_bytes
    ) * 2 == f.params_bytes + f.grads_bytes + f.optimizer_bytes


def test_cli_flag_writes_the_plan(in_repo, capsys, tmp_path):
    out = tmp_path / "p.json"
    code, _, err = run_cli(
        capsys,
        "estimate",
        GPT,
        "--cluster",
        "local-cpu",
        "--devices-per-node",
        "2",
        "--global-batch",
        "8",
        "--dp",
        "2",
        "--tp",
        "1",
        "--pp",
        "1",
        "--zero",
        "3",
        "--microbatch-size",
        "4",
        "--recompute",
        "none",
        "--precision",
        "FP16",
        "-o",
        str(out),
    )
    assert code == 0, err
    plan = json.loads(out.read_text())
    assert plan["decisions"]["precision"] == "fp16-autocast"
    assert "precision" in plan["provenance"]["pinned"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--pp", "2", "--precision", "fp16"], "--precision fp16 with pipeline stages is not emitted yet"),
        (["--precision", "bf16", "--runtime", "megatron-lm"], "--precision bf16 with --runtime megatron-lm"),
        (["--tp", "2", "--precision", "fp16"], "--precision fp16 with --tp 2 is not emitted yet"),
    ],
)
def test_refusals_are_one_line(in_repo, capsys, argv, message):
    code, out, err = run_cli(
        capsys, "plan", GPT, "--cluster", "local-cpu", "--devices-per-node", "2", "--global-batch", "8", *argv
    )
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_searched_fp16_plans_stay_on_data_parallelism(in_repo):
    """Unpinned tp and pp with --precision fp16: the search offers only what its loss scaling runs on."""
    from autoshard.cost.hardware import load_cluster
    from autoshard.passes.planning.space import candidate_configs
    from autoshard.passes.planning.strategies import fp16_runs
    from autoshard.pipeline import capture_graph

    _, graph = capture_graph(GPT, use_cache=True, proofs=False)
    cluster = load_cluster("local-cpu", devices_per_node=4)
    every = candidate_configs(graph, cluster, 8, Pins())
    fp16 = candidate_configs(graph, cluster, 8, Pins(precision="fp16"))
    assert any(c.mesh.tp > 1 for c in every) and any(c.mesh.pp > 1 for c in every)
    assert fp16 == [c for c in every if fp16_runs(c)] and all(c.mesh.tp == c.mesh.pp == 1 for c in fp16)


def test_unknown_precision_is_refused():
    with pytest.raises(AutoshardError, match="--precision int8 must be one of fp32, bf16, bf16-pure, fp16"):
        Pins(precision="int8")


def test_master_weight_precisions_need_fp32_parameters():
    """A model built in bf16 keeps its dtype: fp32, bf16 and fp16 (fp32 master weights) are refused on it, and
    bf16-pure is its own bf16-params (today's unpinned plan)."""
    for pin in ("fp32", "bf16", "fp16"):
        with pytest.raises(AutoshardError, match=f"--precision {pin}: the model's parameters are bfloat16"):
            pinned_precision(pin, "bfloat16")
    assert pinned_precision("bf16-pure", "bfloat16").name == "bf16-params"
    assert pinned_precision("bf16-pure").name == "bf16-pure"


def test_one_loop_serves_every_precision(estimates):
    """Every precision prints the same SPMD loop: the scaler (fp16's GradScaler, a pass-through otherwise) scales
    the loss inside runtime.forward_backward, unscales before clipping and steps; checkpoints keep it. The
    PRECISION comment says what fp16 does; bf16-pure casts the meta model first. No template is patched."""
    fp16 = emit_program(estimates["fp16"])
    compile(fp16, "train.py", "exec")
    assert "PRECISION = 'fp16-autocast'  # float16 compute" in fp16 and "the loss scaled (GradScaler)" in fp16
    body = fp16[fp16.index("def main") :]
    order = [
        body.index(s)
        for s in (
            "scaler = runtime.grad_scaler(PRECISION, model, ctx.device)",
            "runtime.forward_backward(",
            "PRECISION, scaler)",
            "scaler.unscale_(optimizer)",
            "clip_grad_norm(model",
            "scaler.step(optimizer)",
            "scaler.update()",
        )
    ]
    assert order == sorted(order)
    assert "optimizer.step()" not in body.replace("# optimizer.step()", "")
    assert body.count("scaler=scaler") == 2  # checkpoints keep the loss scale (resume and save)
    pure, bf16 = emit_program(estimates["bf16-pure"]), emit_program(estimates["bf16"])
    compile(pure, "train.py", "exec")
    assert "model = cast_params(model, precision=PRECISION)" in pure
    assert [s.op for s in lower(estimates["bf16-pure"])][0] == "cast_params"
    assert "cast_params" not in bf16 and all(s.op != "cast_params" for s in lower(estimates["bf16"]))
    assert {p[p.index("def main") :] for p in (fp16, pure, bf16)} == {body}


def test_forward_backward_scales_and_casts():
    """runtime.forward_backward: the loss summed over micro-batches (each / m), gradients those of the batch's
    mean; fp16's enabled scaler multiplies them by its scale, a disabled one leaves them; bf16-pure casts the
    floating inputs to the weights' dtype."""
    from autoshard.runtime.train_step import forward_backward

    torch.manual_seed(0)
    x, y = torch.randn(8, 4), torch.randn(8, 2)

    def grads(precision="fp32", scaler=None, dtype=torch.float32):
        model = torch.nn.Linear(4, 2).to(dtype)
        with torch.no_grad():
            model.weight.fill_(0.5), model.bias.zero_()
        loss = forward_backward(
            model, (x,), y, lambda out, t: ((out.float() - t) ** 2).mean(), None, 4, None, 8, precision, scaler
        )
        return loss, model.weight.grad.float()

    plain_loss, plain = grads()
    whole = torch.nn.functional.mse_loss(x @ torch.full((2, 4), 0.5).T, y)
    assert torch.allclose(plain_loss, whole, rtol=1e-5)
    assert torch.equal(grads(scaler=torch.amp.GradScaler("cpu", enabled=False))[1], plain)
    scaled = grads(scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))[1]
    assert torch.allclose(scaled, plain * 1024, rtol=1e-5)
    pure_loss, pure = grads("bf16-pure", dtype=torch.bfloat16)  # float inputs cast, else the matmul would refuse
    assert torch.allclose(pure, plain, rtol=0.05, atol=1e-2)


def test_runtime_cast_and_scaler():
    """cast_params rounds a meta model to bf16 (bf16-pure only); grad_scaler is torch's GradScaler for fp16 on
    plain parameters, a disabled one otherwise."""
    from autoshard.runtime.parallel import cast_inputs, cast_params, grad_scaler

    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    assert cast_params(model, "bf16-autocast").weight.dtype == torch.float32
    assert cast_params(model, "bf16-pure").weight.dtype == torch.bfloat16
    x, ids = cast_inputs((torch.ones(2), torch.ones(2, dtype=torch.long)), "bf16-pure")
    assert x.dtype == torch.bfloat16 and ids.dtype == torch.long
    cpu = torch.device("cpu")
    assert not grad_scaler("bf16-autocast", torch.nn.Linear(2, 2), cpu).is_enabled()  # a pass-through
    assert isinstance(grad_scaler("fp16-autocast", torch.nn.Linear(2, 2), cpu), torch.amp.GradScaler)
    assert precision_policy("fp16-autocast").grad_scaler and precision_policy("bf16-pure").cast_dtype == "bfloat16"


def test_one_process_reference_runs_the_precision(in_repo):
    """verify's reference trains in the plan's precision: bf16-pure keeps bf16 weights and bf16 losses; bf16
    autocast and fp16 with a scaler differ from fp32 in the loss yet stay close."""
    from autoshard.modelfile import load_model_file
    from autoshard.verify import train_reference

    model_file = load_model_file(GPT)
    runs = {
        p: train_reference(model_file, 4, 2, 0, 1e-3, fixed_randomness=True, precision=p)
        for p in ("fp32", "bf16-pure", "bf16-autocast", "fp16-autocast")
    }
    assert all(t.dtype == torch.bfloat16 for t in runs["bf16-pure"].params.values() if t.is_floating_point())
    assert all(float(torch.tensor(loss).bfloat16()) == loss for loss in runs["bf16-pure"].losses)
    for p in ("bf16-autocast", "fp16-autocast"):
        assert runs[p].params["h.0.attn.q_proj.weight"].dtype == torch.float32
        assert runs[p].losses != runs["fp32"].losses
        assert runs[p].losses == pytest.approx(runs["fp32"].losses, rel=1e-2)


def test_hf_config_in_bf16_is_noted(tmp_path):
    """A transformers config naming torch_dtype bfloat16 trains fp32 master weights unless bf16-pure is pinned;
    the plan's notes say which."""
    from autoshard.cost.hardware import load_cluster

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16"}))
    cluster = load_cluster("dgx-h100", nodes=1)
    request = PlanRequest(model_spec=f"hf:{tmp_path}", cluster=cluster, global_batch=8)
    (note,) = precision_notes(request)
    assert "fp32 master weights (precision bf16 autocast)" in note and "--precision bf16-pure" in note
    pinned = PlanRequest(model_spec=f"hf:{tmp_path}", cluster=cluster, global_batch=8, pins=Pins(precision="bf16-pure"))
    assert "trains in bf16" in precision_notes(pinned)[0]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "float32"}))
    assert precision_notes(request) == ()
    assert precision_notes(PlanRequest(model_spec=GPT, cluster=cluster, global_batch=8)) == ()


def test_checkpoints_keep_the_loss_scale(tmp_path, one_rank):
    """A resumed fp16 run scales its loss as the uninterrupted one: the scale and growth count are saved and
    loaded; a checkpoint without them leaves a fresh scaler as it is."""
    from autoshard.runtime import checkpoint

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.step(optimizer)
    scaler.update(new_scale=1024.0)
    saved = checkpoint.save(tmp_path / "with", 1, model, optimizer, scaler=scaler)
    fresh = torch.amp.GradScaler("cpu")
    assert checkpoint.load(saved, model, optimizer, scaler=fresh) == 1
    assert fresh.get_scale() == 1024.0
    plain = checkpoint.save(tmp_path / "without", 1, model, optimizer)
    other = torch.amp.GradScaler("cpu")
    checkpoint.load(plain, model, optimizer, scaler=other)
    assert other.get_scale() == 65536.0


def test_inspect_shows_the_dtype_note(estimates):
    """The decisions table's precision row carries the hf:DIR dtype note where the plan has one."""
    from dataclasses import replace

    from rich.console import Console

    from autoshard.show import decision_table

    plan = estimates["bf16"]
    note = "config.json names torch_dtype bfloat16: the program keeps fp32 master weights (precision bf16)"
    noted = replace(plan, review=replace(plan.review, notes=plan.review.notes + (note,)))

    def shown(p):
        console = Console(record=True, width=300)
        console.print(decision_table(p))
        return console.export_text()

    assert "torch_dtype bfloat16" in shown(noted) and "torch_dtype" not in shown(plan)
