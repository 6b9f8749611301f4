"""The training recipe in one process (runtime/recipe.py): its file, its weight-decay groups, its optimizer, its
schedule against the closed form, its scheduler's checkpointed position, clipping on one module. Clipping across
mesh axes: tests/e2e/test_recipe_clipping.py."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from autoshard.errors import AutoshardError
from autoshard.runtime import checkpoint, parallel
from autoshard.runtime.recipe import (
    Recipe,
    build_optimizer,
    build_scheduler,
    clip_grad_norm,
    lr_factor,
    optimizer_kernel,
    param_groups,
)


class MyRMSNorm(nn.Module):  # a norm torch does not know (transformers' LlamaRMSNorm is one)
    def __init__(self, width):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Zoo(nn.Module):
    """Every kind of parameter param_groups sorts; the head tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(16, 8)
        self.ln = nn.LayerNorm(8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8, bias=False)
        self.rms = nn.RMSNorm(8)
        self.mine = MyRMSNorm(8)
        self.gn = nn.GroupNorm(2, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids):
        x = self.ln(self.wte(ids))
        x = self.down(torch.relu(self.up(x)))
        x = self.mine(self.rms(x))
        x = self.bn(self.gn(x.transpose(1, 2))).transpose(1, 2)
        return self.head(x)


DECAYED = {"up.weight", "down.weight"}
UNDECAYED = {
    "wte.weight",
    "ln.weight",
    "ln.bias",
    "up.bias",
    "rms.weight",
    "mine.weight",
    "gn.weight",
    "gn.bias",
    "bn.weight",
    "bn.bias",
}


def group_names(model: nn.Module, groups: list[dict]) -> dict[float, set[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {g["weight_decay"]: {names[id(p)] for p in g["params"]} for g in groups}


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(step))


def train(model, optimizer, scheduler=None, steps=3, max_norm=None, first=0) -> list[float]:
    norms = []
    for step in range(first, first + steps):
        model(batch(step)).square().mean().backward()
        norms.append(clip_grad_norm(model, max_norm))
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return norms


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------- the recipe and its file


def test_the_default_recipe_trains_as_programs_did_before_it_but_for_the_no_decay_groups():
    """Recipe(decay_all=True) is AdamW at 1e-3 with torch's settings on every parameter: bit for bit, through
    build_optimizer, a constant scheduler and clipping left off; Recipe() differs only in its no-decay group;
    parallel.build_optimizer without a recipe is unchanged."""
    torch.manual_seed(0)
    before, now = Zoo(), Zoo()
    now.load_state_dict(before.state_dict())
    train(before, torch.optim.AdamW(before.parameters(), lr=1e-3))
    optimizer = build_optimizer(now, Recipe(decay_all=True), "cpu")
    train(now, optimizer, build_scheduler(optimizer, Recipe(decay_all=True)))
    grouped = build_optimizer(Zoo(), Recipe(), "cpu").param_groups
    assert [g["weight_decay"] for g in grouped] == [0.01, 0.0] and not Recipe().decay_all
    assert all(torch.equal(a, b) for a, b in zip(weights(before).values(), weights(now).values()))
    old = parallel.build_optimizer(Zoo(), lr=1e-3)
    assert type(old) is torch.optim.AdamW and len(old.param_groups) == 1 and old.defaults["foreach"] is None


def test_a_toml_and_a_yaml_file_give_the_same_recipe(tmp_path):
    (tmp_path / "r.toml").write_text(
        '[training]\noptimizer = "adamw"\nlr = 3e-4\nbetas = [0.9, 0.95]\n'
        'weight_decay = 0.1\ndecay_all = false\nschedule = "cosine"\nwarmup_steps = 100\n'
        "min_lr_ratio = 0.1\nmax_grad_norm = 1\nsteps = 1000\n[other]\nx = 1\n"
    )
    (tmp_path / "r.yaml").write_text(
        "training:\n  optimizer: adamw\n  lr: 3e-4\n  betas: [0.9, 0.95]\n"
        "  weight_decay: 0.1\n  decay_all: false\n  schedule: cosine\n"
        "  warmup_steps: 100\n  min_lr_ratio: 0.1\n  max_grad_norm: 1.0\n  steps: 1000\n"
    )
    toml, yaml = Recipe.from_file(tmp_path / "r.toml"), Recipe.from_file(tmp_path / "r.yaml")
    assert (
        toml
        == yaml
        == Recipe(
            lr=3e-4,
            betas=(0.9, 0.95),
            weight_decay=0.1,
            decay_all=False,
            schedule="cosine",
            warmup_steps=100,
            min_lr_ratio=0.1,
            max_grad_norm=1.0,
            steps=1000,
        )
    )
    assert Recipe(**toml.as_dict()) == toml and toml.to_constants()["betas"] == [0.9, 0.95]
    (tmp_path / "partial.toml").write_text('[training]\nschedule = "linear"\n')
    assert Recipe.from_file(tmp_path / "partial.toml") == Recipe(schedule="linear")


@pytest.mark.parametrize(
    "name, text, says",
    [
        ("r.toml", "[training]\nlearning_rate = 1e-3\n", "unknown key 'learning_rate'"),
        ("r.toml", '[training]\noptimizer = "lion"\n', "optimizer = 'lion'"),
        ("r.toml", "[training]\nlr = -1.0\n", "lr = -1.0"),
        ("r.toml", '[training]\nsteps = "many"\n', "steps = 'many'"),
        ("r.toml", "[training]\nbetas = [0.9]\n", "betas = [0.9]"),
        ("r.toml", "[training]\nmin_lr_ratio = 2.0\n", "min_lr_ratio = 2.0"),
        ("r.toml", "[training]\nmax_grad_norm = 0.0\n", "max_grad_norm = 0.0"),
        ("r.toml", '[training]\ndecay_all = "no"\n', "decay_all = 'no'"),
        ("r.toml", "[optimizer]\nlr = 1e-3\n", "no [training] table"),
        ("r.toml", "[training\n", "not valid TOML"),
        ("r.yaml", "training: [1, 2\n", "not valid YAML"),
        ("r.yaml", "training:\n  lr: fast\n", "lr = 'fast'"),
        ("r.json", "{}", "must end in .toml, .yaml or .yml"),
    ],
)
def test_a_bad_recipe_file_is_refused_in_one_line(tmp_path, name, text, says):
    (tmp_path / name).write_text(text)
    with pytest.raises(AutoshardError) as caught:
        Recipe.from_file(tmp_path / name)
    message = str(caught.value)
    assert says in message and "fix" in message and "\n" not in message and caught.value.exit_code == 2


def test_a_decaying_schedule_needs_its_steps():
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(AutoshardError, match="steps"):
        build_scheduler(optimizer, Recipe(schedule="cosine"))
    assert Recipe(schedule="cosine").for_run(50).steps == 50 and Recipe(steps=7).for_run(50, lr=0.5).steps == 7
    assert Recipe().for_run(50, lr=0.5).lr == 0.5


# ---------------------------------------------------------------------------- weight decay groups


def test_norms_biases_and_embeddings_take_no_decay_each_parameter_once():
    model = Zoo()
    groups = param_groups(model, 0.1)
    assert group_names(model, groups) == {0.1: DECAYED, 0.0: UNDECAYED}  # the tied head is the embedding, once
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    lone = nn.Linear(2, 2, bias=False)
    (only,) = param_groups(lone, 0.1)  # the empty no-decay group is left out
    assert only["weight_decay"] == 0.1 and only["params"] == [lone.weight]


def test_groups_are_found_on_fsdp2_tp_and_ddp_models(one_rank):
    """The module types survive FSDP2 (its FSDP<class> subclasses), DTensor TP and DDP's wrapper."""
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    sharded = Zoo()
    parallelize_module(sharded, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(sharded.up, mesh=mesh["dp"])
    fully_shard(sharded, mesh=mesh["dp"])
    ddp = nn.parallel.DistributedDataParallel(Zoo())
    for model, prefix in ((sharded, ""), (ddp, "module.")):
        named = group_names(model, param_groups(model, 0.1))
        assert named == {0.1: {prefix + n for n in DECAYED}, 0.0: {prefix + n for n in UNDECAYED}}
    assert all(type(p).__name__ == "DTensor" for p in sharded.parameters())


def test_pipeline_stages_take_the_whole_models_groups_by_name(one_rank):
    """A stage's graph module has lost the module types: its groups come from the names found on the whole
    model (PipelineStages.no_decay), and match the whole model's, the tied head's copy included."""
    from autoshard.runtime import pipeline_parallel as pp

    torch.manual_seed(0)
    model = Zoo().eval()  # BatchNorm's running statistics would be updated by the split's trace
    whole = group_names(model, param_groups(model, 0.1))
    parts = pp.build_pipeline_stages(model, (batch(0),), ["rms"], 0, 1, 2, torch.device("cpu"), dist.group.WORLD)
    optimizer = build_optimizer(parts, Recipe(decay_all=False, weight_decay=0.1), "cpu")
    found = {0.1: set(), 0.0: set()}
    for module, stage_optimizer in zip(parts.modules, optimizer.optimizers):
        for wd, names in group_names(module, stage_optimizer.param_groups).items():
            found[wd] |= names
    assert found == {0.1: whole[0.1], 0.0: whole[0.0] | {"head.weight"}}


# ---------------------------------------------------------------------------- optimizer


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd"])
def test_each_optimizer_is_torchs_own_with_the_recipes_settings(name):
    recipe = Recipe(
        optimizer=name, lr=0.05, betas=(0.8, 0.9), eps=1e-6, momentum=0.9, weight_decay=0.1, decay_all=False
    )
    model = Zoo()
    optimizer = build_optimizer(model, recipe, "cpu")
    assert type(optimizer) is {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[name]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert optimizer.defaults["foreach"] is False and not optimizer.defaults.get("fused")  # one process's loop
    settings = {"momentum": 0.9} if name == "sgd" else {"betas": (0.8, 0.9), "eps": 1e-6}
    assert all(optimizer.defaults[k] == v for k, v in settings.items())
    zero = parallel.build_optimizer(model, recipe=recipe)  # the applier passes it through
    assert type(zero) is type(optimizer) and len(zero.param_groups) == 2


def test_the_kernel_is_fused_on_cuda_only_and_the_loop_where_dtensors_and_tensors_mix(monkeypatch):
    cpu = [torch.zeros(2)]
    assert optimizer_kernel("adamw", cpu, "cpu") == {"foreach": False}
    assert optimizer_kernel("adamw", cpu, "cuda") == {"foreach": False}  # parameters not on CUDA (yet)
    import autoshard.runtime.recipe as recipe_module

    class FakeCuda(torch.Tensor):  # stands for a CUDA parameter on this CPU machine
        device = torch.device("cuda")

    class FakeDTensor(FakeCuda):
        pass

    monkeypatch.setattr(recipe_module, "DTensor", FakeDTensor)
    plain, sharded = torch.zeros(2).as_subclass(FakeCuda), torch.zeros(2).as_subclass(FakeDTensor)
    assert optimizer_kernel("adamw", [plain], "cuda") == {"fused": True}
    assert optimizer_kernel("adamw", [sharded], "cuda") == {"fused": True}
    assert optimizer_kernel("sgd", [sharded], "cuda") == {"foreach": True}  # DTensor has no fused SGD
    # tensor parallelism without FSDP2 leaves replicated modules plain: torch's list kernels refuse the mix
    assert optimizer_kernel("adamw", [plain, sharded], "cuda") == {"foreach": False}


# ---------------------------------------------------------------------------- schedule


def closed_form(step: int, schedule: str, warmup: int, steps: int, floor: float) -> float:
    """lr_factor's docstring, written out again."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    p = min(1.0, (step + 1 - warmup) / (steps - warmup))
    return floor + (1 - floor) * ((1 - p) if schedule == "linear" else (1 + math.cos(math.pi * p)) / 2)


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_the_schedule_follows_its_closed_form(schedule):
    recipe = Recipe(optimizer="sgd", lr=0.2, schedule=schedule, warmup_steps=3, steps=10, min_lr_ratio=0.1)
    model = nn.Linear(2, 2)
    optimizer = build_optimizer(model, recipe, "cpu")
    scheduler = build_scheduler(optimizer, recipe)
    seen = []
    for _ in range(13):  # past steps: the floor stays
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    expected = [0.2 * closed_form(t, schedule, 3, 10, 0.1) for t in range(13)]
    assert seen == pytest.approx(expected, rel=1e-12)
    assert seen[0] == pytest.approx(0.2 / 3) and seen[2] == pytest.approx(0.2)  # warmup from lr/W up to lr
    if schedule != "constant":
        assert seen[9] == pytest.approx(0.02) and seen[12] == pytest.approx(0.02)  # the floor at the last step
    if schedule == "cosine":
        assert lr_factor(6, recipe) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi * 4 / 7)) / 2)


def test_the_scheduler_resumes_from_a_checkpoint_exactly(one_rank, tmp_path):
    """Trained 2 steps, saved with its scheduler, resumed in a fresh run and trained 3 more: the same rates and
    weights as 5 steps in one go; a checkpoint saved without a scheduler puts it at the steps done."""
    recipe = Recipe(lr=0.01, schedule="cosine", warmup_steps=2, steps=5, min_lr_ratio=0.1, max_grad_norm=0.05)

    def fresh():
        torch.manual_seed(0)
        model = Zoo()
        optimizer = build_optimizer(model, recipe, "cpu")
        return model, optimizer, build_scheduler(optimizer, recipe)

    model, optimizer, scheduler = fresh()
    train(model, optimizer, scheduler, steps=5, max_norm=recipe.max_grad_norm)
    straight, straight_lr = weights(model), optimizer.param_groups[0]["lr"]

    model, optimizer, scheduler = fresh()
    train(model, optimizer, scheduler, steps=2, max_norm=recipe.max_grad_norm)
    checkpoint.save(tmp_path / "with", 2, model, optimizer, scheduler=scheduler)
    checkpoint.save(tmp_path / "without", 2, model, optimizer)
    for folder in ("with", "without"):
        model, optimizer, scheduler = fresh()
        assert checkpoint.resume(tmp_path / folder, model, optimizer, scheduler=scheduler) == 2
        assert scheduler.last_epoch == 2 and optimizer.param_groups[0]["lr"] == pytest.approx(
            0.01 * lr_factor(2, recipe)
        )
        train(model, optimizer, scheduler, steps=3, max_norm=recipe.max_grad_norm, first=2)
        assert optimizer.param_groups[0]["lr"] == straight_lr
        assert all(torch.equal(a, b) for a, b in zip(straight.values(), weights(model).values())), folder


# ---------------------------------------------------------------------------- clipping, one module


def test_clipping_one_module_is_torchs_clip_grad_norm():
    torch.manual_seed(0)
    model, reference = Zoo(), Zoo()
    reference.load_state_dict(model.state_dict())
    for m in (model, reference):
        m(batch(0)).square().mean().backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
    norm = clip_grad_norm(model, 0.01)
    assert norm == pytest.approx(float(expected), rel=1e-6) and norm > 0.01  # it did clip
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters()))
    assert clip_grad_norm(model, None) == pytest.approx(0.01, rel=1e-4)  # None: measured, left alone
