"""Pretrained weights in and out: a transformers checkpoint (``save_pretrained``) loaded into an emitted program with
``--init-from``, trained 0 steps and written back with ``--export-hf``, equals the original tensor for tensor, and
``from_pretrained`` loads the export as written (its config beside the weights); each rank reads and writes only
its shards (DCP's Hugging Face storage reader and writer).

Each case's run is a job of the session's one torchrun launch per world size (``one_launch.Cases``)."""

from pathlib import Path

import pytest
import torch

import autoshard
from autoshard.launch import write_program
from e2e.one_launch import Cases, attempt, job

pytestmark = pytest.mark.e2e

LLAMA, FAST = "tests/models/hf_llama.py:build_4_layers", "tests/clusters/fast_link_cpu.yaml"
CASES = {  # name: ranks, pins
    "tp2-pp2": (4, dict(dp=1, tp=2, pp=2, schedule="1f1b")),
    "dp2-zero3": (2, dict(dp=2, zero=3)),
    "api-dp2-tp2": (4, dict(dp=2, tp=2, zero=3)),  # autoshard.parallelize(init_from=...) (tests/e2e/api_driver.py)
}
API_DRIVER = Path(__file__).with_name("api_driver.py")


def hf_llama():
    """tests/models/hf_llama.py, imported here as the program imports it (a module of its own)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_llama_here", "tests/models/hf_llama.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def round_trip(case, folder):
    """The model saved by transformers from seed 7 (the program builds from seed 0, so loading must replace every
    weight), then one run: --steps 0 --init-from it --export-hf; state: (the original folder, the export)."""
    torch.manual_seed(7)
    hf_llama().build_4_layers().save_pretrained(folder / "pretrained")
    ranks, pins = CASES[case]
    plan = autoshard.plan(LLAMA, cluster=FAST, devices_per_node=ranks, global_batch=8, **pins)
    args = ["--steps", 0, "--init-from", folder / "pretrained", "--export-hf", folder / "exported"]
    if case.startswith("api-"):
        plan.save(folder / "plan.json")
        run = job(API_DRIVER, [folder / "plan.json", *args], folder / "out")
    else:
        run = job(write_program(plan, folder / "train.py"), args, folder / "out")
    return [run], (folder / "pretrained", folder / "exported")


LAUNCHES = Cases(
    {case: ranks for case, (ranks, _) in CASES.items()},
    prepare=lambda names, ranks, root: {case: attempt(lambda: round_trip(case, root / case)) for case in names},
    finish=lambda case, state, failures: (*state, failures[0]),
    case_of=lambda test, params: params.get("case"),
)


def safetensors_of(folder):
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors |= load_file(path)
    return tensors


@pytest.mark.parametrize("case", sorted(CASES))
def test_pretrained_weights_round_trip_through_a_sharded_program(launches, case):
    original, exported, failure = launches.result(LAUNCHES, case)
    assert not failure, failure[-4000:]
    before, after = safetensors_of(original), safetensors_of(exported)
    assert before and set(before) <= set(after), sorted(set(before) - set(after))
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    # the program wrote the model's config beside the weights: transformers loads the export as it is
    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(exported).state_dict()
    assert (exported / "config.json").is_file() and set(before) <= set(loaded)
    assert all(torch.equal(loaded[name], tensor) for name, tensor in before.items())
    torch.manual_seed(0)  # the program's own initialisation differs: the load did replace it
    initial = hf_llama().build_4_layers().state_dict()
    assert all(not torch.equal(initial[name], tensor) for name, tensor in before.items() if tensor.dim() == 2)


def test_init_from_what_is_not_weights_is_one_line(tmp_path):
    from safetensors.torch import save_file

    from autoshard.errors import AutoshardError
    from autoshard.runtime.checkpoint import load_weights

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    (tmp_path / "empty").mkdir()
    with pytest.raises(AutoshardError, match=r"neither a Hugging Face folder of \*.safetensors nor a DCP checkpoint"):
        load_weights(tmp_path / "empty", model, optimizer)
    (tmp_path / "other").mkdir()
    save_file({"0.weight": torch.ones(4, 4)}, tmp_path / "other" / "model.safetensors")
    with pytest.raises(AutoshardError, match=r"lacks 3 of the model's tensors \(0.bias, 1.bias, 1.weight\)"):
        load_weights(tmp_path / "other", model, optimizer)
