"""The training recipe as data: optimizer, learning-rate schedule, weight decay and gradient clipping.

``Recipe`` is a frozen dataclass with no torch in it, so ``autoshard compile`` reads a recipe file and its flags
and prints the program's ``RECIPE`` constant without importing torch; ``runtime.recipe`` builds the optimizer,
scheduler and clipping from it (and re-exports it). Defaults: AdamW at lr 1e-3 with torch's betas, eps and
weight_decay 0.01, a constant rate, no clipping (what programs trained with before recipes), except that weight
decay skips norms, biases and embeddings (``decay_all=False``: see ``Recipe``). ``Recipe.from_file`` reads the
``[training]`` table of a TOML or YAML file; ``as_dict`` is what a program prints as its ``RECIPE`` constant.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import tomllib

from autoshard.errors import AutoshardError

OPTIMIZERS = ("adamw", "adam", "sgd")  # torch's AdamW, Adam, SGD (runtime.recipe.OPTIMIZERS)
SCHEDULES = ("constant", "linear", "cosine")
TABLE = "training"  # the recipe's table in a TOML or YAML file


@dataclass(frozen=True)
class Recipe:
    """How to train: the optimizer and its settings, the learning-rate schedule, clipping.

    ``decay_all`` False (the default) leaves normalisation layers, biases and embeddings without weight decay
    (``param_groups``): decay pulls a norm's gain towards 0 and an embedding row towards 0 only while its token
    is rare, neither of which regularises (GPT-2/3, nanoGPT and torchtitan's recipes group the same way); it is
    exact under every plan, since the groups are found by module type on the model (on pipeline stages by the
    whole model's names) and one process (``autoshard verify``'s reference) finds the same ones. True puts decay
    on every parameter (torch's one group, what programs did before recipes).
    ``steps`` is the length of the decay (None: the run's own ``--steps``, ``for_run``)."""

    optimizer: str = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)  # adam, adamw
    eps: float = 1e-8  # adam, adamw
    momentum: float = 0.0  # sgd
    weight_decay: float = 0.01
    decay_all: bool = False
    schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0  # the decay's floor, a fraction of lr
    max_grad_norm: float | None = None  # None: no clipping
    steps: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))  # a program's constant writes them as a list
        _check(self)

    @classmethod
    def from_file(cls, path: str | Path) -> Recipe:
        """The ``[training]`` table of a ``.toml`` (tomllib) or ``.yaml`` / ``.yml`` file (``training:``);
        a key it lacks keeps its default. Unknown keys and bad values are refused in one line."""
        path = Path(path)
        table = _read_table(path)
        unknown = sorted(set(table) - {f.name for f in fields(cls)})
        if unknown:
            raise AutoshardError(
                f"{path}: unknown key '{unknown[0]}' in [{TABLE}]; fix: use only "
                f"{', '.join(f.name for f in fields(cls))}"
            )
        values = {name: _coerce(name, value, path) for name, value in table.items()}
        try:
            return cls(**values)
        except AutoshardError as exc:
            raise AutoshardError(f"{path}: {exc}") from None

    def for_run(self, steps: int, lr: float | None = None) -> Recipe:
        """This recipe with ``steps`` filled in where it has none (the run's ``--steps``; a run of no steps, which
        only loads and exports, leaves it None: no schedule runs), and ``lr`` if given."""
        own = steps if steps >= 1 else None
        return dataclasses.replace(
            self, steps=self.steps if self.steps is not None else own, lr=self.lr if lr is None else lr
        )

    def as_dict(self) -> dict[str, Any]:
        """Plain values (``betas`` a list), for a program's constants: ``Recipe(**RECIPE)`` rebuilds it."""
        values = dataclasses.asdict(self)
        values["betas"] = list(self.betas)
        return values

    to_constants = as_dict

    def optimizer_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of the optimizer's class (``OPTIMIZERS``) other than params and the kernel."""
        if self.optimizer == "sgd":
            return {"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay}
        return {"lr": self.lr, "betas": tuple(self.betas), "eps": self.eps, "weight_decay": self.weight_decay}


def _check(recipe: Recipe) -> None:
    """Every field's value is one the recipe can train with (a one-line ``AutoshardError`` naming it)."""

    def bad(name: str, want: str) -> AutoshardError:
        return AutoshardError(f"{name} = {getattr(recipe, name)!r} is not valid; fix: {want}")

    if recipe.optimizer not in OPTIMIZERS:
        raise bad("optimizer", f"use one of {', '.join(OPTIMIZERS)}")
    if recipe.schedule not in SCHEDULES:
        raise bad("schedule", f"use one of {', '.join(SCHEDULES)}")
    if not 0 < recipe.lr < float("inf"):
        raise bad("lr", "a learning rate above 0, e.g. 3e-4")
    if len(recipe.betas) != 2 or not all(0 <= b < 1 for b in recipe.betas):
        raise bad("betas", "two numbers in [0, 1), e.g. [0.9, 0.95]")
    for name in ("eps", "weight_decay", "momentum"):
        if getattr(recipe, name) < 0:
            raise bad(name, "a number >= 0")
    if not 0 <= recipe.min_lr_ratio <= 1:
        raise bad("min_lr_ratio", "a fraction of lr in [0, 1], e.g. 0.1")
    if recipe.warmup_steps < 0:
        raise bad("warmup_steps", "a number of steps >= 0")
    if recipe.steps is not None and recipe.steps < 1:
        raise bad("steps", "a number of steps >= 1, or leave it out to decay over the run's --steps")
    if recipe.max_grad_norm is not None and not recipe.max_grad_norm > 0:
        raise bad("max_grad_norm", "a norm above 0, e.g. 1.0, or leave it out for no clipping")


_TYPES = {
    "optimizer": str,
    "schedule": str,
    "lr": float,
    "eps": float,
    "momentum": float,
    "weight_decay": float,
    "min_lr_ratio": float,
    "max_grad_norm": float,
    "warmup_steps": int,
    "steps": int,
    "decay_all": bool,
}


def _coerce(name: str, value: Any, path: Path) -> Any:
    """``value`` as the field's type: an int where a float is wanted is taken, anything else of the wrong type
    is refused (YAML reads ``1e-3`` as a string: taken as a float when it reads as one)."""

    def refuse(want: str) -> AutoshardError:
        return AutoshardError(
            f"{path}: {name} = {value!r} in [{TABLE}] is not {want}; fix: e.g. {name} = {_EXAMPLES[name]}"
        )

    if name == "betas":
        if not (isinstance(value, list) and len(value) == 2):
            raise refuse("a list of two numbers")
        return tuple(
            _coerce("lr", v, path) if not isinstance(v, bool) else _raise(refuse("a list of two numbers"))
            for v in value
        )
    want = _TYPES[name]
    if value is None and name in ("max_grad_norm", "steps"):
        return None
    if want is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise refuse("a number") from None
    if want is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, want) and (want is bool or not isinstance(value, bool)):
        return value
    raise refuse({str: "a string", int: "a whole number", bool: "true or false", float: "a number"}[want])


def _raise(exc: Exception):
    raise exc


_EXAMPLES = {
    "optimizer": '"adamw"',
    "schedule": '"cosine"',
    "lr": "3e-4",
    "betas": "[0.9, 0.95]",
    "eps": "1e-8",
    "momentum": "0.9",
    "weight_decay": "0.1",
    "decay_all": "false",
    "warmup_steps": "100",
    "min_lr_ratio": "0.1",
    "max_grad_norm": "1.0",
    "steps": "1000",
}


def _read_table(path: Path) -> dict[str, Any]:
    """The ``[training]`` table of ``path`` as a dict."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise AutoshardError(
            f"cannot read recipe file {path}: {exc.strerror}; fix: give an existing .toml or .yaml file"
        ) from None
    if path.suffix == ".toml":
        try:
            document = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise AutoshardError(f"{path}: not valid TOML ({exc}); fix: the file's syntax") from None
    elif path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            document = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            where = getattr(exc, "problem_mark", None)
            at = f" at line {where.line + 1}" if where is not None else ""
            raise AutoshardError(f"{path}: not valid YAML{at}; fix: the file's syntax") from None
    else:
        raise AutoshardError(f"recipe file {path} must end in .toml, .yaml or .yml; fix: rename it")
    table = document.get(TABLE) if isinstance(document, dict) else None
    if not isinstance(table, dict):
        raise AutoshardError(
            f"{path} has no [{TABLE}] table; fix: put the recipe's keys under [{TABLE}] (TOML) or '{TABLE}:' (YAML)"
        )
    return table


# ---------------------------------------------------------------------------- command-line flags


@dataclass(frozen=True)
class RecipeFlag:
    """One recipe key a command line sets (``RECIPE_FLAGS``): ``autoshard compile``, ``run`` and ``verify`` add a
    flag per row, which replaces that key of ``--recipe FILE`` (or of the defaults)."""

    name: str  # the Recipe field
    flag: str
    parse: Callable[[str], Any]  # argparse's type=
    help: str
    choices: tuple[str, ...] | None = None
    metavar: str | None = None  # the flag's value in --help (default: the choices)


RECIPE_FLAGS: tuple[RecipeFlag, ...] = (
    RecipeFlag("optimizer", "--optimizer", str.lower, "the optimizer (default: adamw)", OPTIMIZERS),
    RecipeFlag("lr", "--lr", float, "the peak learning rate (default: 1e-3)", metavar="LR"),
    RecipeFlag(
        "weight_decay",
        "--weight-decay",
        float,
        "weight decay; norms, biases and embeddings take none "
        "unless the recipe file sets decay_all = true (default: 0.01)",
        metavar="WD",
    ),
    RecipeFlag(
        "schedule",
        "--schedule",
        str.lower,
        "the learning rate after warmup: constant, or a linear or "
        "cosine decay to min_lr_ratio * lr over the run's steps (default: constant)",
        SCHEDULES,
    ),
    RecipeFlag("warmup_steps", "--warmup-steps", int, "steps of linear warmup to lr (default: 0)", metavar="N"),
    RecipeFlag(
        "max_grad_norm",
        "--max-grad-norm",
        float,
        "clip the whole model's gradient to this 2-norm, taken over every mesh axis (default: no clipping)",
        metavar="NORM",
    ),
)
RECIPE_FILE_HELP = (
    f"a TOML or YAML file whose [{TABLE}] table is the training recipe (optimizer, lr, betas, eps, "
    f"momentum, weight_decay, decay_all, schedule, warmup_steps, min_lr_ratio, max_grad_norm, steps); "
    f"the flags below replace its keys"
)


def recipe_of(path: str | Path | None = None, **flags: Any) -> Recipe:
    """A command line's recipe: ``path``'s ``[training]`` table (None: the defaults), each flag given (a
    ``RECIPE_FLAGS`` name, not None) replacing its key; a bad value is one line naming its flag."""
    recipe = Recipe.from_file(path) if path else Recipe()
    for row in RECIPE_FLAGS:
        value = flags.pop(row.name, None)
        if value is None:
            continue
        try:
            recipe = dataclasses.replace(recipe, **{row.name: value})
        except AutoshardError as exc:
            raise AutoshardError(f"{row.flag} {value}: {exc}") from None
    assert not flags, f"not recipe flags: {sorted(flags)}"
    return recipe
