"""Fuzzing the plan and cluster loaders: whatever the file holds, no traceback escapes.

Every outcome is a success or an ``AutoshardError`` (through the CLI: exit 2, one line). The
documents are a real plan's JSON / a valid cluster file with values replaced, types changed
and keys deleted, plus arbitrary text. A plan that loads must also render (``inspect``) and
emit a program that is valid Python (``compile``), since its fields reach both.
"""

from __future__ import annotations

import atexit
import io
import json
import math
import os
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console

from autoshard.cli import main
from autoshard.cost.hardware import load_cluster
from autoshard.errors import AutoshardError
from autoshard.ir.plan import Plan
from autoshard.ir.plan_format import flatten
from autoshard.passes.lowering.codegen import emit_program
from autoshard.show import render_plan

ROOT = Path(__file__).resolve().parent.parent


def fuzz(examples: int) -> settings:
    return settings(
        max_examples=examples,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


WORK = Path(tempfile.mkdtemp(prefix="autoshard-fuzz-"))
atexit.register(shutil.rmtree, WORK, True)


@lru_cache(maxsize=1)
def base_plan() -> dict:
    """A real plan with TP styles, stages and alternatives (GPT on 4 CPU ranks, tp=2), captured once."""
    import autoshard

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        plan = autoshard.plan("examples/gpt.py:build", cluster="local-cpu", devices_per_node=4, global_batch=8, tp=2)
    finally:
        os.chdir(cwd)
    assert plan.tensor_parallel
    return json.loads(plan.to_json())


def base_plan_v1() -> dict:
    """The same plan in the flat layout of version 1 (still read)."""
    return {**flatten(json.loads(json.dumps(base_plan()))), "version": 1}


def base_cluster() -> dict:
    return yaml.safe_load((ROOT / "examples/cluster.yaml").read_text())


# ---------------------------------------------------------------------------- mutations

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 70),
    st.integers(10**7, 10**30),
    st.integers(-(10**30), -(10**7)),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(
        [
            "",
            "h.0",
            "colwise",
            "1f1b",
            "none",
            "gloo",
            "[/]",
            '"""',
            "x\ny",
            "{__import__('os')}",
            "a:b",
            "examples/gpt.py:build",
            "0" * 16,
            "dgx-h100",
        ]
    ),
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6,
)


def paths(doc, prefix=()) -> list[tuple]:
    """Every path into a JSON document, the root first."""
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += paths(v, prefix + (i,))
    return out


def mutate(doc, path: tuple, action: str, value):
    """Replace, delete, wrap in a list, or stringify the value at ``path``; returns the document."""
    if not path:
        return value if action == "replace" else doc
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    if action == "replace":
        parent[key] = value
    elif action == "delete":
        del parent[key]
    elif action == "wrap":
        parent[key] = [parent[key]]
    elif action == "stringify":
        parent[key] = str(parent[key])
    return doc


def same_kind(value):
    """A value of the same JSON type as ``value`` (a near-valid edit: the loader must check ranges too)."""
    if isinstance(value, bool):
        return st.booleans()
    if isinstance(value, int):
        return st.one_of(st.integers(-2, 70), st.just(value * 2), st.just(2**63))
    if isinstance(value, float):
        return st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.just(-value), st.just(0.0))
    if isinstance(value, str):
        return st.one_of(
            st.text(max_size=10),
            st.just(value + "x"),
            st.just(value.upper()),
            st.sampled_from(["h.0", "h.0.attn.c_attn", "rowwise", "gpipe", "full", "fp32"]),
        )
    if isinstance(value, list):
        return st.just(value[:-1]) | st.just(value + value[:1]) | st.just(value[::-1])
    return st.just(value)


@st.composite
def mutated(draw, make_base, max_edits: int = 3):
    doc = make_base()
    for _ in range(draw(st.integers(1, max_edits))):
        path = draw(st.sampled_from(paths(doc)))
        action = draw(
            st.sampled_from(["same-kind", "same-kind", "same-kind", "replace", "delete", "wrap", "stringify"])
        )
        if action == "same-kind":
            current = doc
            for key in path:
                current = current[key]
            action, value = "replace", draw(same_kind(current))
        else:
            value = draw(JSON_VALUES)
        doc = mutate(doc, path, action, value)
    return doc


def plan_documents():
    return st.one_of(
        mutated(lambda: json.loads(json.dumps(base_plan()))).map(lambda d: json.dumps(d, allow_nan=True)),
        mutated(base_plan_v1).map(lambda d: json.dumps(d, allow_nan=True)),
        st.text(max_size=200),
        st.builds(lambda d: json.dumps(d), st.dictionaries(st.sampled_from(sorted(base_plan())), JSON_VALUES)),
    )


def cluster_documents():
    return st.one_of(
        mutated(base_cluster).map(lambda d: yaml.safe_dump(d)),
        st.text(max_size=200),
        st.builds(
            yaml.safe_dump,
            st.dictionaries(
                st.sampled_from(
                    ["preset", "name", "nodes", "devices_per_node", "backend", "device", "intra_node", "inter_node"]
                ),
                JSON_VALUES,
            ),
        ),
    )


# ---------------------------------------------------------------------------- plan loader


def check_plan_text(text: str) -> Plan | None:
    try:
        plan = Plan.from_json(text, source="fuzzed.json")
    except AutoshardError as exc:
        assert "\n" not in str(exc)
        return None
    # it loaded: every reader of a plan must cope with it
    render_plan(plan, Console(file=io.StringIO(), width=120))
    compile(emit_program(plan), "train.py", "exec")
    assert Plan.from_json(plan.to_json()).to_json() == plan.to_json()
    return plan


def test_base_plan_loads():
    assert check_plan_text(json.dumps(base_plan())) is not None
    assert check_plan_text(json.dumps(base_plan_v1())).to_json() == json.dumps(base_plan(), indent=2) + "\n"


@fuzz(300)
@given(plan_documents())
def test_plan_loader_never_raises_anything_else(text):
    check_plan_text(text)


def _edited(path: tuple, value) -> str:
    return json.dumps(mutate(json.loads(json.dumps(base_plan())), path, "replace", value))


@pytest.mark.parametrize(
    "path, value",
    [
        (("review", "alternatives", 0, "why_not"), "[/]"),  # rich markup in prose: shown as text, not parsed
        (("review", "tensor_parallel_reasons"), {"h.0": "[/x] [bold]"}),
        (("review", "notes"), ["[red]x"]),
        (("model", "spec"), "examples/gpt.py:build x"),
        (("decisions", "ddp_bucket_cap_mb"), 1e-300),
    ],
)
def test_plan_edits_that_load_still_render_and_compile(path, value):
    assert check_plan_text(_edited(path, value)) is not None


@fuzz(40)
@given(plan_documents())
def test_inspect_fuzzed_plan_is_a_table_or_one_line(capsys, text):
    path = WORK / "plan.json"
    path.write_text(text)
    code = main(["inspect", str(path)])
    out, err = capsys.readouterr()
    assert code in (0, 2)
    assert "Traceback" not in out + err
    if code == 2:
        assert err.startswith("error: ") and err.count("\n") == 1


# ---------------------------------------------------------------------------- cluster loader


def check_cluster_text(text: str) -> None:
    path = WORK / "cluster.yaml"
    path.write_text(text)
    try:
        cluster = load_cluster(str(path))
    except AutoshardError as exc:
        assert "\n" not in str(exc)
        return
    assert cluster.world_size >= 1 and cluster.intra_node.bandwidth_gbps > 0
    assert math.isfinite(cluster.device.peak_tflops)


def test_base_cluster_loads():
    check_cluster_text(yaml.safe_dump(base_cluster()))
    assert load_cluster(str(WORK / "cluster.yaml")).world_size == 16


@fuzz(300)
@given(cluster_documents())
def test_cluster_loader_never_raises_anything_else(text):
    check_cluster_text(text)


@fuzz(200)
@given(st.text(max_size=40), st.one_of(st.none(), st.integers(-5, 10**9)), st.one_of(st.none(), st.integers(-5, 64)))
def test_cluster_names_and_flags_never_raise_anything_else(name, nodes, devices_per_node):
    try:
        load_cluster(name, nodes=nodes, devices_per_node=devices_per_node)
    except AutoshardError as exc:
        assert "\n" not in str(exc)


@fuzz(12)
@given(cluster_documents())
def test_plan_with_fuzzed_cluster_file_is_a_plan_or_one_line(in_repo, capsys, text):
    path = WORK / "cli-cluster.yaml"
    path.write_text(text)
    code = main(["plan", "tests/models/mlp.py:build", "--cluster", str(path), "--global-batch", "8", "--json"])
    out, err = capsys.readouterr()
    assert code in (0, 2)
    assert "Traceback" not in out + err
    if code == 2:
        assert err.startswith("error: ") and err.count("\n") == 1
    else:
        assert json.loads(out)["version"] == 2


# ---------------------------------------------------------------------------- symbolic expressions

EXPRESSION_TOKENS = st.sampled_from(
    [
        "B",
        "s",
        "dp",
        "tp",
        "pp",
        "b",
        "v",
        "x",
        "0",
        "1",
        "16",
        "17",
        "9",
        "2.5e-7",
        "1e308",
        "1e-308",
        "9" * 40,
        "+",
        "-",
        "*",
        "/",
        "**",
        "(",
        ")",
        ",",
        " ",
        "Max(",
        "Min(",
        "Eq(",
        "Piecewise((",
        "True",
        "False",
        "__import__",
        ".",
        "[",
        "'",
        "lambda",
        "(-1)",
        "**16",
        "**-16",
        "**0.5",
    ]
)


def plan_expressions() -> list[str]:
    symbolic = base_plan()["review"]["symbolic"]
    return [
        symbolic["step_time_s"],
        symbolic["memory_peak_bytes"],
        symbolic["model_flops_per_sample"],
        *symbolic["parts"].values(),
        *symbolic["memory"].values(),
    ]


@st.composite
def mutated_expression(draw) -> str:
    """A real plan's expression with tokens inserted, slices deleted or repeated; or tokens strung together."""
    if draw(st.integers(0, 3)) == 0:
        return "".join(draw(st.lists(EXPRESSION_TOKENS, max_size=30)))
    text = draw(st.sampled_from(plan_expressions()))
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(text)))
        j = draw(st.integers(i, min(len(text), i + 40)))
        action = draw(st.sampled_from(["insert", "delete", "repeat", "nest"]))
        if action == "insert":
            text = text[:i] + draw(EXPRESSION_TOKENS) + text[i:]
        elif action == "delete":
            text = text[:i] + text[j:]
        elif action == "repeat":
            text = text[:j] + text[i:j] * draw(st.integers(2, 200)) + text[j:]
        else:
            depth = draw(st.integers(1, 60))
            text = "(" * depth + text[i:j] + "**16)" * depth if text[i:j] else text
    return text


@pytest.mark.timeout(300)
@fuzz(400)
@given(
    mutated_expression(),
    st.fixed_dictionaries(
        {},
        optional={
            "B": st.integers(1, 2**40),
            "s": st.integers(1, 2**20),
            "dp": st.integers(1, 4096),
            "b": st.integers(1, 64),
        },
    ),
)
def test_expressions_evaluate_or_raise_value_error(text, values):
    """Whatever the string: a finite float or a ValueError naming the problem, never anything else."""
    from autoshard.cost.expressions import evaluate_expression

    point = {**base_plan()["review"]["symbolic"]["symbols"], **values}
    try:
        result = evaluate_expression(text, point)
    except ValueError as exc:
        assert "\n" not in str(exc) and len(str(exc)) < 400
    else:
        assert isinstance(result, float) and math.isfinite(result)


@pytest.mark.timeout(600)
@fuzz(40)
@given(
    mutated_expression(),
    st.sampled_from(["step_time_s", "memory_peak_bytes", "parts.forward_s", "memory.activations_bytes"]),
    st.sampled_from(["global_batch=16", "seq_len=4096", "dp=1", "global_batch=1099511627776"]),
)
def test_inspect_what_if_with_fuzzed_expression_is_a_table_or_one_line(capsys, text, where, what_if):
    data = json.loads(json.dumps(base_plan()))
    target = data["review"]["symbolic"]
    *parents, key = where.split(".")
    for parent in parents:
        target = target[parent]
    target[key] = text
    path = WORK / "what-if.json"
    path.write_text(json.dumps(data))
    assert check_plan_text(path.read_text()) is not None  # the loader leaves symbolic cost to --what-if
    code = main(["inspect", str(path), "--what-if", what_if])
    out, err = capsys.readouterr()
    assert code in (0, 2)
    assert "Traceback" not in out + err
    if code == 2:
        assert err.startswith("error: ") and err.count("\n") == 1
    else:
        assert "What if" in out


# ---------------------------------------------------------------------------- file outputs

OUTPUT_KINDS = [
    "new",
    "new-in-missing-folder",
    "existing-file",
    "directory",
    "link-to-file",
    "dangling-link",
    "link-to-model",
    "link-to-cluster",
    "model",
    "cluster",
    "helper",
    "inside-a-file",
    "trailing-slash",
    "dot",
]


REFUSED_OUTPUTS = (
    "directory",
    "dot",
    "model",
    "cluster",
    "helper",
    "link-to-model",
    "link-to-cluster",
    "inside-a-file",
)  # an input, or no file at all


def _output_folder() -> Path:
    """A fresh folder with a model file, the module it imports, a cluster file and an unrelated file."""
    folder = Path(tempfile.mkdtemp(dir=WORK, prefix="outputs-"))
    model = (ROOT / "tests/models/mlp.py").read_text()
    (folder / "model.py").write_text(model.replace("import torch\n", "import torch\nimport helper  # noqa\n", 1))
    (folder / "helper.py").write_text("SCALE = 1\n")
    (folder / "cluster.yaml").write_text((ROOT / "tests/clusters/fast_link_cpu.yaml").read_text())
    (folder / "notes.txt").write_text("keep me\n")
    (folder / "sub").mkdir()
    return folder


def _output_path(folder: Path, kind: str, name: str) -> str:
    if kind == "new":
        return str(folder / name)
    if kind == "new-in-missing-folder":
        return str(folder / "missing" / name)
    if kind == "existing-file":
        return str(folder / "notes.txt")
    if kind == "directory":
        return str(folder / "sub")
    if kind == "link-to-file":
        (folder / name).symlink_to(folder / "notes.txt")
    elif kind == "dangling-link":
        (folder / name).symlink_to(folder / "nowhere.json")
    elif kind == "link-to-model":
        (folder / name).symlink_to(folder / "model.py")
    elif kind == "link-to-cluster":
        (folder / name).symlink_to(folder / "cluster.yaml")
    elif kind in ("model", "cluster", "helper"):
        return str(folder / {"model": "model.py", "cluster": "cluster.yaml", "helper": "helper.py"}[kind])
    elif kind == "inside-a-file":
        return str(folder / "notes.txt" / name)
    elif kind == "trailing-slash":
        return str(folder / name) + "/"
    elif kind == "dot":
        return str(folder) + "/."
    return str(folder / name)


def _snapshot(folder: Path) -> dict[str, bytes | str]:
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        out[rel] = f"-> {os.readlink(p)}" if p.is_symlink() else ("<dir>" if p.is_dir() else p.read_bytes())
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", OUTPUT_KINDS)
@fuzz(2)
@given(
    name=st.text(st.characters(codec="utf-8", exclude_characters="/\x00"), min_size=1, max_size=12).map(
        lambda t: t + ".json"
    )
)
def test_plan_output_never_replaces_an_input_nor_leaves_a_temporary(capsys, kind, name):
    folder = _output_folder()
    output = _output_path(folder, kind, name)
    before = _snapshot(folder)
    inputs = {p: before[p] for p in ("model.py", "helper.py", "cluster.yaml")}
    code = main(
        [
            "plan",
            f"{folder}/model.py:build",
            "--cluster",
            str(folder / "cluster.yaml"),
            "--devices-per-node",
            "2",
            "--global-batch",
            "8",
            "-o",
            output,
        ]
    )
    out, err = capsys.readouterr()
    after = _snapshot(folder)
    assert code in (0, 2), err
    assert "Traceback" not in out + err
    if kind in REFUSED_OUTPUTS:
        assert code == 2, f"plan -o {kind} was written"
    assert all(after.get(p) == content for p, content in inputs.items()), "an input was replaced"
    assert all(after.get(p) == before[p] for p in before if p not in (name, "notes.txt")), "a file changed"
    added = set(after) - set(before) - {name, "__pycache__"} - {p for p in after if p.startswith("__pycache__/")}
    if code == 2:
        assert err.startswith("error: ") and err.count("\n") == 1, err
        assert after == {**before, **{p: after[p] for p in after if "__pycache__" in p}}, "a failed plan wrote"
    else:
        assert added <= {"missing", f"missing/{name}"}, added  # the output, and nothing temporary
        written = Path(output)
        assert json.loads(written.read_text())["version"] == 2


@pytest.mark.timeout(120)
@fuzz(40)
@given(st.integers(1, 12), st.integers(1, 12), st.sampled_from(["name", "device", "nodes", "preset"]), st.booleans())
def test_alias_bombs_of_any_shape_are_refused_by_their_expanded_size(branching, depth, key, flow):
    """Level k holds ``branching`` aliases of level k − 1: branching^depth values once expanded. Over
    the bound it is refused by size, before anything is built; under it the loader says what is wrong."""
    from autoshard.cost.hardware import MAX_YAML_NODES

    def items(level: int) -> str:
        inner = ", ".join(["x"] * branching if level == 0 else [f"*l{level - 1}"] * branching)
        return f"[{inner}]" if flow else "".join(f"\n  - {i}" for i in inner.split(", "))

    lines = [f"l{k}: &l{k} {items(k)}" for k in range(depth)] + [f"{key}: *l{depth - 1}"]
    text = "preset: dgx-h100\n" * (key != "preset") + "\n".join(lines) + "\n"
    path = WORK / "aliases.yaml"
    path.write_text(text)
    with pytest.raises(AutoshardError) as info:
        load_cluster(str(path))
    message = str(info.value)
    assert "\n" not in message and len(message) < 400
    if branching**depth > MAX_YAML_NODES:  # the last level alone expands to at least branching^depth values
        assert "aliases expand to more than" in message
