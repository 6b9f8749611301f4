"""The bad-input corpus: every case exits 2 with one line naming the problem and the fix.

docs/design.md's quality bar: bad input gets a one-line error that names the problem and the fix,
exit code 2, no traceback; nothing half-written is left behind and nothing is lost. The input
files are in tests/bad_inputs/ (model files, cluster files); tampered plans are made here from
a real plan. Each case is (argv, a substring of the expected message).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from autoshard.cli import main

B = "tests/bad_inputs/"
GPT = "examples/gpt.py:build"
MLP = "tests/models/mlp.py:build"
LOCAL = ["--cluster", "local-cpu", "--devices-per-node", "2", "--global-batch", "8"]


def plan_args(model: str, *extra: str) -> list[str]:
    return ["plan", model, *LOCAL, *extra]


def cluster_args(cluster: str, *extra: str) -> list[str]:
    return ["plan", MLP, "--cluster", cluster, "--global-batch", "8", *extra]


# ---------------------------------------------------------------------------- the corpus

MODEL_FILES = [  # broken model files
    (plan_args("nope.py:build"), "model file 'nope.py' not found"),
    (plan_args("tests/bad_inputs:build"), "is a folder, not a file"),
    (plan_args("examples/gpt.py"), "has no factory"),
    (plan_args("examples/gpt.py:"), "no function ''"),
    (plan_args(B + "syntax_error.py:build"), "raised SyntaxError"),
    (plan_args(B + "import_error.py:build"), "No module named 'autoshard_no_such_package'"),
    (plan_args(B + "exits_on_import.py:build"), "exit(3) was called; a model file defines functions"),
    (plan_args(B + "factory_exits.py:build"), "the factory raised SystemExit"),
    (plan_args(B + "factory_needs_argument.py:build"), "the factory build() needs the argument(s) width"),
    (plan_args(B + "not_callable.py:build"), "no function 'build'"),
    (plan_args("tests/bad_models/broken.py:not_a_module"), "not a torch.nn.Module"),
    (plan_args(B + "batch_not_tuple.py:build"), "example_batch must return (inputs: tuple, targets)"),
    (plan_args(B + "batch_raises.py:build"), "example_batch(2) raised FileNotFoundError"),
    (plan_args(B + "batch_not_tensors.py:build"), "inputs must be a tuple of tensors"),
    (plan_args("tests/bad_models/wrong_batch.py:build"), "as its first dimension"),
]

UNTRACEABLE = [  # torch.export cannot capture the model
    (plan_args("tests/bad_models/data_dependent.py:build"), "data-dependent control flow"),
    (
        plan_args(B + "item_in_forward.py:build"),
        "data-dependent control flow at tests/bad_inputs/item_in_forward.py:12",
    ),
    (plan_args(B + "nonzero_shape.py:build"), "depends on tensor values"),
    (plan_args(B + "meta_build.py:build"), "cannot be built on the meta device"),
    (plan_args(B + "shape_mismatch.py:build"), "torch.export failed"),
    (plan_args(B + "keyword_only_input.py:build"), "keyword-only: scale"),
]

UNSUPPORTED_OPS = [
    (plan_args(B + "numpy_forward.py:build"), ".numpy()"),
    (plan_args(B + "custom_op.py:build"), "cannot trace op autoshard_bad_inputs::scale"),
]

DIMENSIONS = [  # zero-size or enormous
    (plan_args(B + "zero_width.py:build"), "parameter '0.weight' has shape (0, 4), a zero-size dimension"),
    (plan_args(B + "zero_batch_dim.py:build"), "shape (2, 0, 4) with a zero-size dimension"),
    (plan_args(B + "no_params.py:build"), "the model has no trainable parameters"),
    (plan_args(B + "enormous_dim.py:build"), "a tensor is too large to exist"),
    (cluster_args(B + "enormous_cluster.yaml"), "more than autoshard plans for"),
    (cluster_args("local-cpu", "--nodes", "100000000"), "= 200,000,000 devices, more than autoshard plans for"),
    (cluster_args("local-cpu", "--global-batch", "0"), "--global-batch 0 must be a positive integer"),
    (cluster_args("local-cpu", "--devices-per-node", "-2"), "--devices-per-node -2 must be a positive integer"),
]

CLUSTER_FILES = [
    (cluster_args(B + "negative_bandwidth.yaml"), "inter_node.bandwidth_gbps must be > 0, got -10"),
    (cluster_args(B + "negative_latency.yaml"), "intra_node.latency_us must be >= 0, got -3"),
    (cluster_args(B + "missing_field.yaml"), "missing field 'inter_node'"),
    (cluster_args(B + "missing_device_field.yaml"), "missing field 'device.memory_bytes'"),
    (
        cluster_args(B + "unknown_preset.yaml"),
        "preset must be one of dgx-a100-80gb, dgx-h100, local-cpu, got 'dgx-b300'",
    ),
    (cluster_args("dgx-z9000"), "unknown cluster 'dgx-z9000'"),
    (cluster_args(B + "unknown_field.yaml"), "unknown field 'node'"),
    (cluster_args(B + "syntax_error.yaml"), "YAML syntax error at line"),
    (cluster_args(B + "not_a_mapping.yaml"), "the document must be a mapping of cluster fields, got list"),
    (cluster_args(B + "wrong_type.yaml"), "nodes must be an integer, got 'two'"),
    (cluster_args(B + "nan_bandwidth.yaml"), "intra_node.bandwidth_gbps must be a number, got nan"),
    (cluster_args(B + "unknown_backend.yaml"), "backend must be one of nccl, gloo"),
    (cluster_args(B + "efficiency_above_one.yaml"), "matmul_efficiency must be in (0, 1]"),
    (cluster_args(B + "python_tag.yaml"), "could not determine a constructor for the tag"),
    (cluster_args(B + "deep.yaml"), "nested too deeply"),
    (cluster_args(B + "no_such_cluster.yaml"), "does not exist"),
    (cluster_args("tests/bad_inputs"), "cannot be read (IsADirectoryError)"),
]

INFEASIBLE = [
    (plan_args("tests/bad_models/huge.py:build"), "no plan fits in memory"),
    (plan_args(B + "enormous_layer.py:build"), "GiB short"),
    (cluster_args(B + "tiny_memory.yaml"), "but devices have 1000 bytes"),
    (plan_args(GPT, "--tp", "3"), "--tp 3 must divide the 2 devices per node"),
    (plan_args(GPT, "--global-batch", "7", "--dp", "2"), "not divisible by dp=2"),
    (plan_args(MLP, "--tp", "2", "--sequence-parallel", "on"), "--sequence-parallel on: this model's tensor-parallel"),
]

OUTPUTS = [  # where results would be written
    (plan_args(GPT, "-o", B + "syntax_error.py/plan.json"), "cannot write tests/bad_inputs/syntax_error.py/plan.json"),
    (["calibrate", "-o", "{tmp}/cluster.txt"], "must end in .yaml or .yml"),
    (["compile", "{plan}", "-o", "{tmp}/train.txt"], "must end in .py"),
    (["run", "{plan}", "--program", "{tmp}/train.txt"], "must end in .py"),
    (["compile", "{plan}", "-o", B + "syntax_error.py/train.py"], "cannot write"),
    (["compile", "{plan}", "-o", "tests/models/mlp.py"], "is this plan's model file"),
    (["run", "{plan}", "--program", "tests/models/mlp.py"], "is this plan's model file"),
    (["calibrate", "-o", "{tmp}/no_such_folder/cluster.yaml"], "does not exist"),
    (["run", "{plan}", "--log-jsonl", "{tmp}"], "is a folder; fix: name a file"),
]

PIPELINE_PINS = [  # --virtual-stages, --stage-cuts, --runtime: one line, before capture where no graph is needed
    (plan_args(GPT, "--virtual-stages", "0"), "--virtual-stages 0 must be a positive integer"),
    (plan_args(GPT, "--virtual-stages", "two"), "invalid int value: 'two'"),
    (plan_args(GPT, "--virtual-stages", "2", "--pp", "1"), "--virtual-stages 2 puts 2 stages on each pipeline rank"),
    (plan_args(GPT, "--virtual-stages", "2", "--schedule", "1f1b"), "needs --schedule interleaved-1f1b"),
    (plan_args(GPT, "--virtual-stages", "1", "--schedule", "interleaved-1f1b"), "runs 2 or more stages per rank"),
    (plan_args(GPT, "--virtual-stages", "3", "--pp", "2"), "needs 6 blocks, the model has 4"),
    (plan_args(GPT, "--stage-cuts", "2,1"), "--stage-cuts 2,1 must be 'even' or increasing block indices"),
    (plan_args(GPT, "--stage-cuts", "0"), "--stage-cuts 0 must be 'even' or increasing block indices >= 1"),
    (plan_args(GPT, "--stage-cuts", "even", "--pp", "1"), "splits pipeline stages but --pp 1"),
    (plan_args(GPT, "--stage-cuts", "1,2", "--pp", "2", "--schedule", "1f1b"), "gives 3 stages, but --pp 2 x 1"),
    (plan_args(GPT, "--stage-cuts", "9", "--pp", "2", "--schedule", "1f1b"), "names block 9, but the model's blocks"),
    (plan_args(GPT, "--runtime", "deepspeed"), "invalid choice: 'deepspeed'"),
    (
        [
            "estimate",
            GPT,
            *LOCAL,
            "--dp",
            "1",
            "--tp",
            "1",
            "--pp",
            "2",
            "--zero",
            "0",
            "--microbatch-size",
            "2",
            "--recompute",
            "none",
        ],
        "pin --schedule too",
    ),
]

USAGE = [
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["plan", GPT, "--global-batch", "8"], "the following arguments are required: --cluster"),
    (["inspect"], "the following arguments are required: plan"),
    (["plan", GPT, *LOCAL, "--recompute", "sometimes"], "invalid choice: 'sometimes'"),
]

CASES = (
    MODEL_FILES
    + UNTRACEABLE
    + UNSUPPORTED_OPS
    + DIMENSIONS
    + CLUSTER_FILES
    + INFEASIBLE
    + PIPELINE_PINS
    + OUTPUTS
    + USAGE
)


def _id(argv: list[str]) -> str:
    return " ".join(a.replace(B, "") for a in argv[:2] + [a for a in argv[2:] if "/" in a or "=" in a][:1])


@pytest.fixture(scope="module")
def good_plan(tmp_path_factory):
    """A real 2-rank plan (dp=2) of the small MLP, and its JSON as a dict."""
    root = Path(__file__).resolve().parent.parent
    cwd = os.getcwd()
    os.chdir(root)
    try:
        import autoshard

        plan = autoshard.plan(MLP, cluster="local-cpu", devices_per_node=2, global_batch=8)
    finally:
        os.chdir(cwd)
    path = tmp_path_factory.mktemp("good") / "plan.json"
    plan.save(path)
    return path


def run_cli(capsys, argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_exit_2(code, out, err, message):
    assert code == 2, (code, out, err)
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert "Traceback" not in out + err


def _fill(argv, tmp_path, plan_path):
    return [a.replace("{tmp}", str(tmp_path)).replace("{plan}", str(plan_path)) for a in argv]


@pytest.mark.parametrize("argv, message", CASES, ids=[_id(a) for a, _ in CASES])
def test_bad_input_is_one_line_exit_2(in_repo, capsys, tmp_path, good_plan, argv, message):
    argv = _fill(argv, tmp_path, good_plan)
    output = tmp_path / "plan.json"
    if argv[0] in ("plan", "estimate") and "-o" not in argv:
        argv = argv + ["-o", str(output)]
    before = sorted(in_repo.joinpath("tests/bad_inputs").iterdir())
    code, out, err = run_cli(capsys, argv)
    assert_one_line_exit_2(code, out, err, message)
    assert sorted(tmp_path.iterdir()) == [], "nothing is written on a bad input"
    assert sorted(in_repo.joinpath("tests/bad_inputs").iterdir()) == before
    assert not Path("autoshard-was-here").exists()  # python_tag.yaml constructed nothing


def test_failed_command_leaves_an_existing_output_untouched(in_repo, capsys, tmp_path, good_plan):
    """A pre-existing output file survives every failing command that would have replaced it."""
    kept_plan, kept_program = tmp_path / "plan.json", tmp_path / "train.py"
    kept_plan.write_text("my earlier plan\n")
    kept_program.write_text("# my edited program\n")
    tampered = tmp_path / "tampered.json"
    data = json.loads(good_plan.read_text())
    data["decisions"]["mesh"]["dp"] = "two"
    tampered.write_text(json.dumps(data))
    for argv in (
        plan_args(B + "syntax_error.py:build", "-o", str(kept_plan)),
        cluster_args(B + "negative_bandwidth.yaml", "-o", str(kept_plan)),
        plan_args("tests/bad_models/huge.py:build", "-o", str(kept_plan)),
        ["compile", str(tampered), "-o", str(kept_program)],
    ):
        code, _, err = run_cli(capsys, argv)
        assert code == 2 and err.count("\n") == 1
    assert kept_plan.read_text() == "my earlier plan\n"
    assert kept_program.read_text() == "# my edited program\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json", "tampered.json", "train.py"]


# ---------------------------------------------------------------------------- tampered plans


def _set(path, value):
    def edit(d):
        for key in path[:-1]:
            d = d[key]
        d[path[-1]] = value

    return edit


def _delete(path):
    def edit(d):
        for key in path[:-1]:
            d = d[key]
        del d[path[-1]]

    return edit


TAMPERED = [  # (what is done to a real plan's JSON, message)
    ("text: not json {", "not valid JSON"),
    ("text: ", "not valid JSON"),
    ("text: [1, 2, 3]", "a plan is a JSON object"),
    ("text: " + "[" * 50000 + "]" * 50000, "JSON nested too deeply"),
    ("bytes", "cannot read the plan"),
    (_set(["version"], 3), "plan version 3, this autoshard reads versions 1 and 2"),
    (_set(["version"], True), "plan version True"),
    (_delete(["decisions", "mesh"]), "plan field 'decisions.mesh' is missing"),
    (_set(["decisions", "mesh", "dp"], "two"), "plan field 'decisions.mesh.dp' must be an integer >= 1, got 'two'"),
    (_set(["decisions", "mesh", "sp"], 2), "plan field 'decisions.mesh' has an unknown key 'sp'"),
    (_set(["decisions", "mesh"], {"dp": 64, "tp": 1, "pp": 1}), "needs 64 ranks but the plan's cluster has 2 devices"),
    (_set(["decisions", "zero_stage"], 7), "plan field 'decisions.zero_stage' must be one of 0, 1, 2, 3, got 7"),
    (_set(["decisions", "schedule"], "zigzag"), "plan field 'decisions.schedule' must be one of"),
    (_set(["global_batch"], 10), "not the global batch 10"),
    (_set(["decisions", "microbatch_size"], 0), "plan field 'decisions.microbatch_size' must be an integer >= 1"),
    (_delete(["model", "hash"]), "plan field 'model.hash' is missing"),
    (_set(["model", "spec"], 5), "plan field 'model.spec' must be a printable name"),
    (_set(["model", "params"], "many"), "plan field 'model.params' must be an integer >= 0"),
    (_set(["model", "file_sha256"], "0" * 63), "plan field 'model.file_sha256' must be 64 lowercase hexadecimal"),
    (_set(["model", "tokens_per_sample"], "1; import os"), "model.tokens_per_sample' must be an integer >= 1"),
    (
        _set(["layout", "blocks"], ["h.0{__import__('os').getpid()}"]),
        "plan field 'layout.blocks[0]' must be a module path",
    ),
    (_set(["cluster", "name"], 'x"""\nimport os\n"""'), "plan field 'cluster.name' must be a printable name"),
    (_set(["cluster", "nodes"], 0), "nodes must be > 0, got 0"),
    (_set(["cluster"], []), "plan field 'cluster' must be a mapping"),
    (
        _set(["layout", "tensor_parallel"], {"0.fc1": "diagonal"}),
        "layout.tensor_parallel.0.fc1' must be one of colwise",
    ),
    (_set(["layout", "stages"], [{"index": 0, "modules": ["0"], "ranks": [0, 5]}]), "a rank below the mesh's 2"),
    (_set(["predicted"], None), "plan field 'predicted' must be a mapping, got None"),
    (_set(["predicted", "step_time_s"], -1.0), "predicted.step_time_s' must be a number >= 0"),
    (_set(["decisions", "ddp_bucket_cap_mb"], "nan"), "decisions.ddp_bucket_cap_mb' must be a finite number"),
    (_set(["review", "alternatives"], [None]), "plan field 'review.alternatives[0]' must be a mapping"),
    (_set(["review", "notes"], "not a list"), "plan field 'review.notes' must be a list"),
    (_set(["review", "colour"], 1), "plan field 'review' has an unknown key 'colour'"),
    (_set(["zero_stage"], 3), "plan has an unknown key 'zero_stage', which belongs in 'decisions' in version 2"),
]


def _tampered_id(case) -> str:
    edit = case[0]
    if isinstance(edit, str):
        return edit[:24]
    return case[1][:48]


def write_tampered(good_plan: Path, edit, path: Path) -> Path:
    if edit == "bytes":
        path.write_bytes(b"\xff\xfe\x00 not text")
    elif isinstance(edit, str):
        path.write_text(edit.removeprefix("text: "))
    else:
        data = json.loads(good_plan.read_text())
        edit(data)
        path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("edit, message", TAMPERED, ids=[_tampered_id(c) for c in TAMPERED])
def test_tampered_plan_is_refused(in_repo, capsys, tmp_path, good_plan, edit, message):
    """inspect, compile and run refuse it in one line; compile writes no program."""
    plan = write_tampered(good_plan, edit, tmp_path / "tampered.json")
    program = tmp_path / "train.py"
    for argv in (
        ["inspect", str(plan)],
        ["compile", str(plan), "-o", str(program)],
        ["run", str(plan), "--steps", "1"],
        ["verify", str(plan), "--steps", "1"],
    ):
        code, out, err = run_cli(capsys, argv)
        assert_one_line_exit_2(code, out, err, message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tampered.json"]


# ---------------------------------------------------------------------------- plan and model mismatch


@pytest.fixture
def planned_model_copy(in_repo, capsys, tmp_path):
    """A plan of a copy of the MLP model file in tmp_path (the copy can then be edited)."""
    model = tmp_path / "mlp.py"
    shutil.copy(in_repo / "tests/models/mlp.py", model)
    plan = tmp_path / "plan.json"
    code, _, err = run_cli(capsys, ["plan", f"{model}:build", *LOCAL, "-o", str(plan)])
    assert code == 0, err
    return model, plan


def test_compile_and_run_refuse_a_changed_model(capsys, tmp_path, planned_model_copy):
    model, plan = planned_model_copy
    model.write_text(model.read_text().replace("HIDDEN = 128", "HIDDEN = 96"))
    program = tmp_path / "train.py"
    for argv in (["compile", str(plan), "-o", str(program)], ["run", str(plan), "--steps", "1"]):
        code, out, err = run_cli(capsys, argv)
        assert_one_line_exit_2(code, out, err, "is not the model this plan was made for")
        assert "re-plan it with `autoshard plan" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp.py", "plan.json"]  # no program written


def test_compile_refuses_a_plan_whose_model_file_is_gone(capsys, tmp_path, planned_model_copy):
    model, plan = planned_model_copy
    model.unlink()
    code, out, err = run_cli(capsys, ["compile", str(plan), "-o", str(tmp_path / "train.py")])
    assert_one_line_exit_2(code, out, err, f"model file '{model}' not found")
    assert not (tmp_path / "train.py").exists()


def test_run_refuses_a_plan_for_a_cluster(in_repo, capsys, tmp_path):
    plan = tmp_path / "plan.json"
    assert (
        run_cli(
            capsys, ["plan", MLP, "--cluster", "dgx-h100", "--nodes", "2", "--global-batch", "16", "-o", str(plan)]
        )[0]
        == 0
    )
    code, out, err = run_cli(capsys, ["run", str(plan), "--steps", "1"])
    assert_one_line_exit_2(code, out, err, "this plan needs 16 ranks on 2 node(s)")


# ---------------------------------------------------------------------------- launching the program


def _compile(capsys, plan: Path, program: Path) -> Path:
    code, _, err = run_cli(capsys, ["compile", str(plan), "-o", str(program)])
    assert code == 0, err
    return program


def _program_env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parent.parent)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    return {**env, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}


def test_program_started_without_torchrun_names_the_world_size(in_repo, capsys, tmp_path, good_plan):
    """`python train.py` is one rank; the 2-rank program says how to launch it, exit 2, one line."""
    program = _compile(capsys, good_plan, tmp_path / "train.py")
    proc = subprocess.run(
        [sys.executable, str(program), "--steps", "1"],
        capture_output=True,
        text=True,
        env=_program_env(),
        cwd=in_repo,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (
        "error: this program was planned for 2 ranks but was launched with 1; "
        "launch it with torchrun --nproc-per-node 2 (or re-plan)\n"
    )
    assert "Traceback" not in proc.stdout


@pytest.mark.e2e
def test_torchrun_with_the_wrong_world_size(in_repo, capsys, tmp_path, good_plan):
    """torchrun with 1 rank for a 2-rank program: the rank says so in one line and the job fails."""
    from autoshard.launch import run_torchrun

    program = _compile(capsys, good_plan, tmp_path / "train.py")
    proc = run_torchrun(program, 1, ["--steps", "1"], quiet=True)
    assert proc.returncode != 0
    ours = [line for line in proc.stdout.splitlines() if line.startswith("error: ")]
    assert ours == [
        (
            "error: this program was planned for 2 ranks but was launched with 1; "
            "launch it with torchrun --nproc-per-node 2 (or re-plan)"
        )
    ]


@pytest.mark.e2e
def test_program_refuses_a_model_changed_after_compile(capsys, tmp_path, planned_model_copy):
    """The emitted program checks the fingerprint on every rank: one line per rank, no traceback."""
    from autoshard.launch import run_torchrun

    model, plan = planned_model_copy
    program = _compile(capsys, plan, tmp_path / "train.py")
    model.write_text(model.read_text().replace("N_BLOCKS = 4", "N_BLOCKS = 3"))
    proc = run_torchrun(program, 2, ["--steps", "1"], quiet=True)
    assert proc.returncode != 0
    # Two ranks print at once through torchrun's one stdout: their lines may run together.
    assert proc.stdout.count("error: ") == 2, proc.stdout
    assert proc.stdout.count("is not the model this plan was made for") == 2, proc.stdout
    assert "autoshard/runtime" not in proc.stdout  # no traceback through our code


def test_corpus_covers_every_category():
    assert len(CASES) + len(TAMPERED) >= 30  # and 6 scenarios above: model mismatch, launch, cluster plans
    assert all(
        len(group) >= 2
        for group in (
            MODEL_FILES,
            UNTRACEABLE,
            UNSUPPORTED_OPS,
            DIMENSIONS,
            CLUSTER_FILES,
            INFEASIBLE,
            PIPELINE_PINS,
            TAMPERED,
        )
    )
