"""The CLI as a user meets it: plans, byte-identical re-plans, and one-line errors with exit 2."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from autoshard.cli import main

GPT = "examples/gpt.py:build"


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_json_has_design_keys_and_is_deterministic(in_repo, capsys, tmp_path):
    args = ["plan", GPT, "--cluster", "local-cpu", "--devices-per-node", "2", "--global-batch", "8"]
    code, out, _ = run_cli(capsys, *args, "--json")
    assert code == 0
    plan = json.loads(out)
    assert list(plan) == [
        "version",
        "model",
        "cluster",
        "global_batch",
        "decisions",
        "layout",
        "predicted",
        "review",
        "provenance",
    ]
    for key in ("mesh", "zero_stage", "microbatch_size", "num_microbatches", "schedule", "recompute"):
        assert key in plan["decisions"]
    assert "stages" in plan["layout"] and "tensor_parallel" in plan["layout"] and "alternatives" in plan["review"]
    for key in ("spec", "hash", "params", "layers"):
        assert key in plan["model"]
    for key in (
        "step_time_s",
        "compute_s",
        "comm_exposed_s",
        "bubble_s",
        "memory_peak_bytes_per_rank",
        "tokens_per_s",
        "mfu",
    ):
        assert key in plan["predicted"]
    assert plan["model"]["layers"] == 4 and plan["decisions"]["mesh"]["dp"] == 2
    run_cli(capsys, *args, "-o", str(tmp_path / "a.json"))
    run_cli(capsys, *args, "-o", str(tmp_path / "b.json"))
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert (tmp_path / "a.json").read_text() == out


def test_pins_are_honoured(in_repo, capsys):
    code, out, _ = run_cli(
        capsys,
        "plan",
        GPT,
        "--cluster",
        "local-cpu",
        "--devices-per-node",
        "2",
        "--global-batch",
        "8",
        "--zero",
        "3",
        "--microbatch-size",
        "2",
        "--recompute",
        "full",
        "--json",
    )
    plan = json.loads(out)
    decisions = plan["decisions"]
    assert (
        decisions["zero_stage"],
        decisions["microbatch_size"],
        decisions["num_microbatches"],
        decisions["recompute"],
    ) == (3, 2, 2, "full")
    assert sorted(plan["provenance"]["pinned"]) == ["microbatch_size", "recompute", "zero"]


def test_inspect_and_compile(in_repo, capsys, tmp_path):
    plan_path, program = tmp_path / "p.json", tmp_path / "train.py"
    run_cli(capsys, "plan", GPT, "--cluster", "local-cpu", "--global-batch", "8", "--zero", "1", "-o", str(plan_path))
    code, out, _ = run_cli(capsys, "inspect", str(plan_path))
    assert code == 0
    for text in (
        "Memory per rank",
        "optimizer state",
        "Time per step",
        "exposed communication",
        "Alternatives",
        "uncalibrated preset",
    ):
        assert text in " ".join(out.split())
    code, out, _ = run_cli(capsys, "compile", str(plan_path), "-o", str(program))
    source = program.read_text()
    compile(source, str(program), "exec")
    assert (
        'build_optimizer(model, mesh["dp"], zero_stage=1, recipe=recipe)' in source
        and "ZeroRedundancyOptimizer" in source
    )
    assert 'apply_ddp(model, mesh["dp"], bucket_cap_mb=' in source and 'MESH = {"pp": 1, "dp": 2, "tp": 1}' in source
    header = source.split('"""')[1]  # its run commands name the files the user has, not train.py and plan.json
    assert f"nproc-per-node 2 {program}" in header and f"autoshard run {plan_path}" in header
    assert "e+0" not in header and "plan.json" not in header


def test_milliseconds_are_written_without_exponents():
    from autoshard.passes.lowering.codegen import ms_text

    assert [ms_text(s) for s in (13.1, 0.1234, 0.00158, 4.26e-5, 1e-9, 0.0)] == [
        "13,100",
        "123",
        "1.58",
        "0.0426",
        "0",
        "0",
    ]


BAD = [
    (["plan", "nope.py:build"], "model file 'nope.py' not found"),
    (["plan", "examples/gpt.py"], "has no factory"),
    (["plan", "examples/gpt.py:missing"], "no function 'missing'"),
    (["plan", "tests/bad_models/broken.py:raises"], "RuntimeError: boom"),
    (["plan", "tests/bad_models/broken.py:not_a_module"], "not a torch.nn.Module"),
    (["plan", "tests/bad_models/broken.py:no_batch_model"], "no example_batch"),
    (["plan", "tests/bad_models/wrong_batch.py:build"], "batch (2) as its first dimension"),
    (["plan", "tests/bad_models/data_dependent.py:build"], "data-dependent"),
    (["plan", GPT, "--global-batch", "7", "--dp", "2"], "not divisible by dp=2"),
    (["plan", GPT, "--cluster", "dgx-z9000"], "dgx-z9000"),
    (["plan", GPT, "--zero", "5"], "--zero 5"),
    (["plan", GPT, "--offload", "nvme"], "--offload nvme is not emitted: no maintained library"),
    (["plan", GPT, "--offload", "cpu"], "--offload cpu: CPU ranks (gloo) keep their state in host memory already"),
    (["plan", GPT, "--microbatch-size", "3"], "does not divide"),
    (["plan", GPT, "--seq-len", "128"], "'wpe' looks up positions up to 127 in a table of 64 rows"),
    (["plan", "hf:tests/bad_models"], "'tests/bad_models' has no config.json; hf:DIR names a transformers model"),
    (["plan", "tests/bad_models/huge.py:build"], "no plan fits in memory"),
    (["inspect", "missing.json"], "not found"),
    (["inspect", "tests/bad_models/broken.py"], "not valid JSON"),
    (["plan", GPT, "--cluster", "tests/bad_models/bad_cluster.yaml"], "intra_node.bandwidth_gbps"),
    (["plan", GPT, "--global-batch"], "expected one argument"),
]


@pytest.mark.parametrize("argv, message", BAD, ids=[m for _, m in BAD])
def test_bad_input_is_one_line_exit_2(in_repo, capsys, tmp_path, argv, message):
    if argv[0] == "plan" and "--cluster" not in argv:
        argv = argv + ["--cluster", "local-cpu", "--devices-per-node", "2"]
    if argv[0] == "plan" and "--global-batch" not in argv:
        argv = argv + ["--global-batch", "8"]
    out_file = tmp_path / "plan.json"
    code, out, err = run_cli(capsys, *argv, *(["-o", str(out_file)] if argv[0] == "plan" else []))
    assert code == 2
    assert message in err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert "Traceback" not in err + out
    assert not out_file.exists()


def test_infeasible_names_memory_and_fix(in_repo, capsys):
    code, _, err = run_cli(
        capsys,
        "plan",
        "tests/bad_models/huge.py:build",
        "--cluster",
        "local-cpu",
        "--devices-per-node",
        "2",
        "--global-batch",
        "8",
    )
    assert code == 2 and "GiB short" in err and "--nodes" in err


def test_plan_for_another_model_is_refused(in_repo, capsys, tmp_path):
    plan_path = tmp_path / "p.json"
    run_cli(capsys, "plan", GPT, "--cluster", "local-cpu", "--global-batch", "8", "-o", str(plan_path))
    data = json.loads(plan_path.read_text())
    data["model"]["spec"] = "tests/models/mlp.py:build"
    plan_path.write_text(json.dumps(data))
    code, _, err = run_cli(capsys, "compile", str(plan_path), "-o", str(tmp_path / "t.py"))
    assert code == 2 and "not the model this plan was made for" in err
    assert not (tmp_path / "t.py").exists()


def test_debug_shows_traceback(in_repo):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "autoshard.cli",
            "plan",
            "nope.py:build",
            "--cluster",
            "local-cpu",
            "--global-batch",
            "8",
            "--debug",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_compile_writes_a_slurm_script_with_the_multi_node_torchrun(in_repo, tmp_path, capsys):
    import subprocess

    plan_path, program = tmp_path / "plan.json", tmp_path / "train.py"
    assert (
        main(
            [
                "plan",
                "examples/gpt.py:build",
                "--cluster",
                "dgx-h100",
                "--nodes",
                "2",
                "--global-batch",
                "32",
                "-o",
                str(plan_path),
            ]
        )
        == 0
    )
    assert main(["compile", str(plan_path), "-o", str(program)]) == 0
    out = capsys.readouterr().out
    script = (tmp_path / "train.sbatch").read_text()
    assert "sbatch" in out and program.exists()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --gpus-per-node=8" in script
    assert (
        "srun torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:29500 "
        "--rdzv-id $JOB_ID train.py"
    ) in script
    assert subprocess.run(["bash", "-n", str(tmp_path / "train.sbatch")], check=False).returncode == 0


PIPELINE = [
    "--cluster",
    "local-cpu",
    "--devices-per-node",
    "2",
    "--global-batch",
    "8",
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
]


def test_virtual_stages_and_even_cuts_are_pinned(in_repo, capsys):
    """--virtual-stages 2 implies interleaved 1F1B (estimate needs no --schedule); --stage-cuts even puts
    L / (pp·v) blocks in each stage, Megatron-LM's split; a pin left out is not recorded as pinned."""
    code, out, _ = run_cli(
        capsys, "estimate", GPT, *PIPELINE, "--virtual-stages", "2", "--stage-cuts", "even", "--json"
    )
    plan = json.loads(out)
    assert (
        code == 0 and plan["decisions"]["schedule"] == "interleaved-1f1b" and plan["decisions"]["virtual_stages"] == 2
    )
    assert plan["layout"]["split_points"] == ["h.1", "h.2", "h.3"]
    assert "schedule" not in plan["provenance"]["pinned"] and "stage_cuts" in plan["provenance"]["pinned"]
    code, out, _ = run_cli(capsys, "estimate", GPT, *PIPELINE, "--schedule", "1f1b", "--stage-cuts", "3", "--json")
    assert code == 0 and json.loads(out)["layout"]["split_points"] == ["h.3"]
    assert json.loads(out)["decisions"]["virtual_stages"] == 1  # follows the schedule


def test_plan_honours_virtual_stages(in_repo, capsys):
    from autoshard.passes.planning.strategies import runs_virtual_stages

    code, out, _ = run_cli(
        capsys,
        "plan",
        GPT,
        "--cluster",
        "local-cpu",
        "--devices-per-node",
        "2",
        "--global-batch",
        "8",
        "--virtual-stages",
        "2",
        "--json",
    )
    decisions = json.loads(out)["decisions"]
    assert code == 0 and decisions["mesh"]["pp"] == 2 and decisions["virtual_stages"] == 2
    assert runs_virtual_stages(decisions["schedule"], 2) and not runs_virtual_stages(decisions["schedule"], 1)


def test_runtime_megatron_lm_prices_megatron_and_says_the_program_is_autoshard(in_repo, capsys, tmp_path):
    """--runtime megatron-lm: the plan records it (provenance.runtime), its price is Megatron-LM's (fp16 with
    fp32 Adam state, scores through HBM: not autoshard's), and the printout and notes say that compile still
    emits autoshard's program."""
    pins = [*PIPELINE, "--schedule", "1f1b"]
    code, out, _ = run_cli(capsys, "estimate", GPT, *pins, "--json")
    ours = json.loads(out)
    code, out, _ = run_cli(capsys, "estimate", GPT, *pins, "--runtime", "megatron-lm", "--json")
    megatron = json.loads(out)
    assert code == 0 and ours["provenance"]["runtime"] == "autoshard"
    assert megatron["provenance"]["runtime"] == "megatron-lm"
    assert megatron["predicted"] != ours["predicted"] and megatron["decisions"] == ours["decisions"]
    assert any("still emits autoshard's program" in note for note in megatron["review"]["notes"])
    path = tmp_path / "m.json"
    run_cli(capsys, "estimate", GPT, *pins, "--runtime", "megatron-lm", "-o", str(path))
    code, out, _ = run_cli(capsys, "inspect", str(path))
    assert code == 0 and "priced for" in out and "megatron-lm" in out
    code, out, _ = run_cli(
        capsys,
        "plan",
        GPT,
        "--cluster",
        "local-cpu",
        "--devices-per-node",
        "2",
        "--global-batch",
        "8",
        "--runtime",
        "megatron-lm",
        "--json",
    )
    assert code == 0 and json.loads(out)["provenance"]["runtime"] == "megatron-lm"


def test_no_zero_3_advice_where_one_dp_rank_has_nothing_to_shard(in_repo, capsys):
    base = ["plan", "tests/bad_models/huge.py:build", "--cluster", "local-cpu", "--global-batch", "8"]
    code, _, err = run_cli(capsys, *base, "--devices-per-node", "1")
    assert code == 2 and "no plan fits in memory" in err and "--zero 3" not in err
    code, _, err = run_cli(capsys, *base, "--devices-per-node", "2", "--dp", "2", "--pp", "1", "--zero", "0")
    assert code == 2 and "allow --zero 3" in err  # two dp ranks: sharding is the advice


def test_every_flag_of_every_command_has_help_text():
    import argparse

    from autoshard.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    bare = [
        f"{name} {action.option_strings or action.dest}"
        for name, sub in commands.items()
        for action in sub._actions
        if not isinstance(action, argparse._HelpAction) and not action.help
    ]
    assert not bare, f"no --help text: {bare}"
    schedule = next(a for a in commands["plan"]._actions if "--schedule" in a.option_strings)
    assert "1f1b" in schedule.choices and "zbv" in schedule.choices


def test_a_calibrated_cluster_gets_no_preset_caveat(in_repo, capsys):
    """The caveat follows the device's figures: a cluster file that only changes a preset's links keeps it."""
    code, out, _ = run_cli(
        capsys, "plan", GPT, "--cluster", "tests/clusters/cpu4_shared_cores.yaml", "--global-batch", "8"
    )
    assert code == 0 and "Time per step" in out and "uncalibrated" not in out
    code, out, _ = run_cli(capsys, "plan", GPT, "--cluster", "tests/clusters/fast_link_cpu.yaml", "--global-batch", "8")
    assert code == 0 and "uncalibrated preset" in " ".join(out.split())


def test_a_pipeline_on_shared_cores_writes_a_plan_inspect_reads(in_repo, capsys, tmp_path):
    """4 ranks on 2 cores: a rank runs faster while the others wait in the schedule's bubbles, so the
    pipelined span can be under m·T_max. The plan still holds parts >= 0 that add up to the step."""
    plan = tmp_path / "pp.json"
    pins = ["--dp", "1", "--tp", "2", "--pp", "2", "--zero", "0", "--microbatch-size", "1", "--recompute", "none"]
    cluster = ["--cluster", "tests/clusters/cpu4_shared_cores.yaml", "--global-batch", "8"]
    code, _, _ = run_cli(capsys, "estimate", GPT, *cluster, *pins, "--schedule", "1f1b", "-o", str(plan))
    assert code == 0
    code, out, err = run_cli(capsys, "inspect", str(plan))
    assert code == 0, err
    predicted = json.loads(plan.read_text())["predicted"]
    assert predicted["bubble_s"] >= 0.0 and "pipeline bubble" in out


def test_inspect_folds_the_repeated_layers_tensor_parallel_rows(in_repo, capsys, tmp_path):
    plan = tmp_path / "tp.json"
    code, _, _ = run_cli(
        capsys,
        "estimate",
        "tests/models/hf_llama.py:build_4_layers",
        "--cluster",
        "tests/clusters/fast_link_cpu.yaml",
        "--devices-per-node",
        "2",
        "--global-batch",
        "8",
        "--dp",
        "1",
        "--tp",
        "2",
        "--pp",
        "1",
        "--zero",
        "0",
        "--microbatch-size",
        "8",
        "--recompute",
        "none",
        "-o",
        str(plan),
    )
    assert code == 0
    tables = {}
    for flags in ((), ("--all",)):
        code, out, _ = run_cli(capsys, "inspect", str(plan), *flags)
        tables[flags] = [
            line
            for line in out.split("Tensor parallelism over")[1].split("Alternatives")[0].splitlines()
            if line.startswith("│ ")
        ]
    every, folded = tables[("--all",)], tables[()]
    assert any("layers.3.self_attn.q_proj" in row for row in every)
    assert any("layers.*.self_attn.q_proj  x4" in row for row in folded)
    assert not any("layers.3." in row for row in folded) and 4 * len(folded) < 2 * len(every)


def test_a_recipe_file_and_flags_become_the_programs_constants(in_repo, capsys, tmp_path, monkeypatch):
    """compile and run write the recipe into the program (``RECIPE``): the file's keys, each flag over its key; a
    bad value is one line naming its flag or file."""
    import autoshard.launch
    from autoshard.ir.recipe import Recipe

    plan = tmp_path / "p.json"
    run_cli(
        capsys, "plan", GPT, "--cluster", "local-cpu", "--devices-per-node", "2", "--global-batch", "8", "-o", str(plan)
    )
    (tmp_path / "r.toml").write_text(
        '[training]\noptimizer = "sgd"\nlr = 0.1\nmomentum = 0.9\ndecay_all = true\n'
        'schedule = "linear"\nmin_lr_ratio = 0.1\n'
    )
    code, _, err = run_cli(
        capsys,
        "compile",
        str(plan),
        "-o",
        str(tmp_path / "c.py"),
        "--recipe",
        str(tmp_path / "r.toml"),
        "--schedule",
        "cosine",
        "--warmup-steps",
        "10",
        "--max-grad-norm",
        "1",
        "--weight-decay",
        "0.1",
    )
    assert code == 0, err
    assert recipe_constant(tmp_path / "c.py") == Recipe(
        optimizer="sgd",
        lr=0.1,
        momentum=0.9,
        decay_all=True,
        schedule="cosine",
        min_lr_ratio=0.1,
        warmup_steps=10,
        max_grad_norm=1.0,
        weight_decay=0.1,
    )
    started = []
    monkeypatch.setattr(
        autoshard.launch,
        "run_torchrun",
        lambda program, ranks, args, **kw: started.append(args) or subprocess.CompletedProcess([], 0),
    )
    code, _, _ = run_cli(capsys, "run", str(plan), "--steps", "1", "--lr", "3e-4", "--program", str(tmp_path / "t.py"))
    assert code == 0 and "--lr" not in started[0]  # the constant is the record
    assert recipe_constant(tmp_path / "t.py") == Recipe(lr=3e-4) and not Recipe().decay_all
    (tmp_path / "bad.yaml").write_text("training:\n  schedule: step\n")
    for flags, says in [
        (["--lr", "-1"], "--lr -1.0: lr = -1.0 is not valid"),
        (["--max-grad-norm", "0"], "--max-grad-norm 0.0: max_grad_norm = 0.0 is not valid"),
        (["--schedule", "step"], "argument --schedule: invalid choice: 'step'"),
        (["--recipe", str(tmp_path / "bad.yaml")], "schedule = 'step' is not valid"),
    ]:
        code, _, err = run_cli(capsys, "compile", str(plan), "-o", str(tmp_path / "x.py"), *flags)
        assert code == 2 and says in err and err.count("\n") == 1, err
        assert not (tmp_path / "x.py").exists()


def recipe_constant(program: Path):
    """The ``RECIPE`` a program trains with, read from its text."""
    from autoshard.ir.recipe import Recipe

    tree = ast.parse(program.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "RECIPE")
    return Recipe(**ast.literal_eval(node.value))


def test_hf_folder_of_a_model_that_is_no_causal_lm_is_refused_in_one_line(in_repo, capsys, tmp_path):
    import transformers

    transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path)
    code, _, err = run_cli(capsys, "plan", f"hf:{tmp_path}", "--cluster", "local-cpu", "--global-batch", "8")
    assert code == 2 and "a ViTConfig has no causal LM in transformers" in err and err.count("\n") == 1


def test_hf_folder_plans_compiles_and_names_its_folder(in_repo, capsys, tmp_path):
    import transformers

    transformers.Qwen2Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
    ).save_pretrained(tmp_path / "qwen")
    plan = tmp_path / "p.json"
    code, out, _ = run_cli(
        capsys,
        "plan",
        f"hf:{tmp_path / 'qwen'}",
        "--cluster",
        "local-cpu",
        "--devices-per-node",
        "2",
        "--global-batch",
        "8",
        "-o",
        str(plan),
    )
    assert code == 0 and "2 blocks" in out
    saved = json.loads(plan.read_text())["model"]
    assert saved["tokens_per_sample"] == 16  # the model's positions, below the default 2048
    code, _, _ = run_cli(capsys, "compile", str(plan), "-o", str(tmp_path / "train.py"))
    assert code == 0 and f"MODEL = 'hf:{tmp_path / 'qwen'}'" in (tmp_path / "train.py").read_text()
    (tmp_path / "qwen" / "config.json").write_text(
        (tmp_path / "qwen" / "config.json").read_text().replace('"num_hidden_layers": 2', '"num_hidden_layers": 3')
    )
    code, _, err = run_cli(capsys, "compile", str(plan), "-o", str(tmp_path / "train.py"))
    assert code == 2 and "is not the model this plan was made for" in err  # the config's bytes are checked


def test_hf_folder_of_a_bf16_config_builds_fp32_weights(tmp_path):
    """fp32 master weights whatever dtype the config names (bf16 autocast is the program's, per backend)."""
    import torch
    import transformers

    from autoshard.modelfile import load_model_file

    transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=8,
        dtype="bfloat16",
    ).save_pretrained(tmp_path)
    assert '"bfloat16"' in (tmp_path / "config.json").read_text()
    model = load_model_file(f"hf:{tmp_path}").build("meta")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.config._attn_implementation == "sdpa"


def test_hf_folder_of_a_roberta_style_model_takes_the_tokens_its_positions_hold(tmp_path):
    """RoBERTa-style embeddings (CamemBERT's, Data2VecText's) number positions from pad_token_id + 1: of 16 rows with
    pad 1, 14 tokens fit; a 16-token default read row 17 and every run of the model failed (verify's first forward)."""
    import transformers

    from autoshard.errors import AutoshardError
    from autoshard.modelfile import load_model_file, position_offset

    for config_class in (transformers.CamembertConfig, transformers.Data2VecTextConfig):
        folder = tmp_path / config_class.model_type
        config = config_class(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=16,
            pad_token_id=1,
        )
        config.save_pretrained(folder)
        assert position_offset(config) == 2
        model_file = load_model_file(f"hf:{folder}")
        (inputs,), _ = model_file.example_batch(2)
        assert inputs.shape == (2, 14)
        model_file.build("cpu")(inputs)  # runs: every position inside the table
        with pytest.raises(AutoshardError, match=r"--seq-len 15: .* its 16 position rows hold 14 tokens"):
            load_model_file(f"hf:{folder}", seq_len=15)
    llama = transformers.LlamaConfig(vocab_size=64, hidden_size=16, num_attention_heads=2, max_position_embeddings=8)
    assert position_offset(llama) == 0


def test_hf_folder_whose_model_reads_past_its_positions_says_to_shorten_the_default_length(tmp_path):
    """ProphetNet's n-gram stream looks up position + 1 of positions numbered from the padding index: at hf:DIR's
    default (every one of its 16 positions) it fails to trace with a shape error far from the cause; the refusal
    names first the length that traces (14), and 14 tokens capture. ProphetNet's own head counts narrow."""
    import transformers

    from autoshard.errors import AutoshardError
    from autoshard.modelfile import load_model_file
    from autoshard.narrowing import narrowed_config
    from autoshard.passes.capturing.capture import capture

    config = transformers.ProphetNetConfig(
        vocab_size=64,
        hidden_size=16,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        num_encoder_layers=1,
        num_decoder_layers=1,
        num_encoder_attention_heads=2,
        num_decoder_attention_heads=2,
        max_position_embeddings=16,
        num_buckets=8,
        relative_max_distance=16,
        is_decoder=True,
    )
    config.save_pretrained(tmp_path)
    with pytest.raises(
        AutoshardError, match=r"at 16 tokens per sample, every position .* at 14 it does .* --seq-len 14"
    ):
        capture(load_model_file(f"hf:{tmp_path}"))
    assert capture(load_model_file(f"hf:{tmp_path}", seq_len=14)).nodes
    assert load_model_file(f"hf:{tmp_path}", seq_len=14).length_at_positions is None
    narrowed = narrowed_config(transformers.ProphetNetConfig())
    assert (narrowed.num_decoder_attention_heads, narrowed.num_encoder_attention_heads) == (4, 4)


def test_run_passes_pretrained_weights_in_and_out_and_refuses_a_missing_folder(tmp_path, capsys, monkeypatch):
    """``autoshard run --init-from DIR --export-hf DIR``: the program's own flags, checked before anything starts."""
    import autoshard.launch

    plan = tmp_path / "p.json"
    run_cli(
        capsys, "plan", GPT, "--cluster", "local-cpu", "--devices-per-node", "2", "--global-batch", "8", "-o", str(plan)
    )
    started = []
    monkeypatch.setattr(
        autoshard.launch,
        "run_torchrun",
        lambda program, ranks, args, **kw: started.append(args) or subprocess.CompletedProcess([], 0),
    )
    (tmp_path / "weights").mkdir()
    program = str(tmp_path / "t.py")
    flags = ["--init-from", str(tmp_path / "weights"), "--export-hf", str(tmp_path / "out")]
    code, out, err = run_cli(capsys, "run", str(plan), "--steps", "1", "--program", program, *flags)
    assert code == 0, err
    assert "local-cpu is an uncalibrated preset" in " ".join(out.split())  # under the measured vs predicted table
    args = started[0]
    assert args[args.index("--init-from") + 1] == flags[1] and args[args.index("--export-hf") + 1] == flags[3]
    (tmp_path / "a-file").write_text("")
    for bad, says in [
        (["--init-from", str(tmp_path / "missing")], "is not a folder; fix: name a Hugging Face folder"),
        (["--export-hf", str(tmp_path / "a-file")], "--export-hf"),
    ]:
        Path(program).unlink(missing_ok=True)
        code, _, err = run_cli(capsys, "run", str(plan), "--program", program, *bad)
        assert code == 2 and says in err and err.count("\n") == 1, err
    assert len(started) == 1
