"""Pins: the decisions a user fixes by hand.

``PINS`` is the one table of the decisions a user may fix: each row's field on ``Pins``, its flag on
``autoshard plan`` and ``estimate`` (``cli.py`` adds one argument per row), the Python API's keyword
(``autoshard.plan(**pins)``: the flag's stem, or the field's name), how the flag's text is read, its help,
the check a pinned value passes, and the value ``estimate`` takes where it is left out. ``Pins`` is
``ir.decisions.Decisions``' fields, each optional.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from autoshard.errors import AutoshardError
from autoshard.ir.decisions import (
    FLOAT8_CHOICES,
    PIN_OFFLOAD,
    PIN_PRECISIONS,
    PIN_RECOMPUTE,
    PIPELINE_SCHEDULES,
    SCHEDULES,
    ZERO_STAGES,
)


@dataclass(frozen=True)
class PinRow:
    """One decision the user may fix by hand (``PINS``)."""

    name: str  # the field of Pins: a field of Decisions, an axis of Mesh, or stage_cuts (the layout's split points)
    flag: str  # on `autoshard plan` / `estimate`; its stem is the API keyword and the name in provenance.pinned
    parse: Callable[[str], Any]  # the flag's text -> the value (argparse's type=)
    help: str
    check: Callable[[Any, str], Any] | None = None  # (value, flag) -> the value Pins keeps; one line when outside
    choices: tuple[str, ...] | None = None  # the flag's texts, when it takes a few
    metavar: str | None = None  # the flag's value in --help (default: the keyword in capitals, or the choices)
    default: Callable[[Pins], Any] | None = None  # estimate's value where it is not pinned, from the other pins
    estimate_optional: bool = False  # estimate never asks for it: the planner chooses it where it is not pinned

    @property
    def keyword(self) -> str:
        """The Python API's keyword (``autoshard.plan(zero=3)``), also the name ``provenance.pinned`` records."""
        return self.flag.removeprefix("--").replace("-", "_")


def _positive(value: Any, flag: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AutoshardError(f"{flag} {value} must be a positive integer")
    return value


def _zero_stage(value: Any, flag: str) -> int:
    if value not in ZERO_STAGES:
        raise AutoshardError(f"{flag} {value} must be 0, 1, 2 or 3")
    return value


def _recompute(value: Any, flag: str) -> str:
    if value not in PIN_RECOMPUTE:
        raise AutoshardError(f"{flag} {value} must be one of {', '.join(PIN_RECOMPUTE)}")
    return value


def _schedule(value: Any, flag: str) -> str:
    value = value.lower()
    if value not in SCHEDULES:
        raise AutoshardError(
            f"{flag} {value} must be one of {', '.join(SCHEDULES[1:])} (or none, without pipeline stages)"
        )
    return value


def _stage_cuts(value: Any, flag: str) -> str | tuple[int, ...]:
    return parse_stage_cuts(value)


def _precision(value: Any, flag: str) -> str:
    value = value.lower() if isinstance(value, str) else value
    if value not in PIN_PRECISIONS:
        raise AutoshardError(f"{flag} {value} must be one of {', '.join(PIN_PRECISIONS)}")
    return value


def _float8(value: Any, flag: str) -> str:
    value = value.lower() if isinstance(value, str) else value
    if value not in FLOAT8_CHOICES:
        raise AutoshardError(f"{flag} {value} must be one of {', '.join(FLOAT8_CHOICES)}")
    return value


def _offload(value: Any, flag: str) -> str:
    value = value.lower() if isinstance(value, str) else value
    if value not in PIN_OFFLOAD:
        raise AutoshardError(f"{flag} {value} must be one of {', '.join(PIN_OFFLOAD)}")
    return value


def _on_off(value: Any, flag: str) -> bool:
    """True / False, or the flag's on / off."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("on", "off"):
        return value.lower() == "on"
    raise AutoshardError(f"{flag} {value!r} must be on or off (True or False)")


PINS: tuple[PinRow, ...] = (
    PinRow("dp", "--dp", int, "pin the data-parallel degree", _positive),
    PinRow("tp", "--tp", int, "pin the tensor-parallel degree (it divides the devices per node)", _positive),
    PinRow("pp", "--pp", int, "pin the pipeline-parallel degree (pipeline stages)", _positive),
    PinRow(
        "zero_stage",
        "--zero",
        int,
        "pin the ZeRO stage: 0 (DDP), 1 (optimizer state sharded over dp), 2 (and gradients), 3 (and parameters: FSDP)",
        _zero_stage,
    ),
    PinRow("microbatch_size", "--microbatch-size", int, "pin the samples per rank in each micro-batch", _positive),
    PinRow(
        "recompute",
        "--recompute",
        str.lower,
        "pin recompute: none; selective (keep every matmul and attention output, recompute the rest); alternate "
        "(torchtitan's op-level policy: keep attention and every other weight matmul's output); full (keep each "
        "block's input)",
        _recompute,
        choices=PIN_RECOMPUTE,
    ),
    PinRow(
        "schedule",
        "--schedule",
        str.lower,
        f"pin the pipeline schedule: {', '.join(SCHEDULES[1:])} (none without pipeline stages)",
        _schedule,
        choices=SCHEDULES,
        default=lambda p: "none" if p.pp == 1 else "interleaved-1f1b" if (p.virtual_stages or 1) > 1 else None,
    ),
    PinRow(
        "virtual_stages",
        "--virtual-stages",
        int,
        "pin the pipeline stages per pp rank (V > 1: interleaved-1f1b, "
        "Megatron-LM's interleaving; default: the schedule's, 1 for gpipe and 1f1b)",
        _positive,
        metavar="V",
        default=lambda p: dict(PIPELINE_SCHEDULES).get(p.schedule, 1) if p.schedule is not None else None,
        estimate_optional=True,
    ),
    PinRow(
        "stage_cuts",
        "--stage-cuts",
        str,
        "pin where pipeline stages begin: 'even' (L / (pp x V) blocks each, as "
        "Megatron-LM splits layers) or the first block of stages 1 .. pp x V - 1 (default: the planner's cuts)",
        _stage_cuts,
        metavar="even|K1,K2,...",
        estimate_optional=True,
    ),
    PinRow(
        "dp_replicate",
        "--dp-replicate",
        int,
        "HSDP: FSDP2 shards over dp / N ranks (inside a node) and "
        "replicates across N; 1 for plain FSDP2 (estimate: 1 unless given)",
        _positive,
        default=lambda p: 1,
    ),
    PinRow(
        "ep",
        "--ep",
        int,
        "expert parallelism: split each mixture-of-experts layer's experts over this many of "
        "the dp ranks, tokens sent to them by all-to-all (estimate: 1 unless given)",
        _positive,
        default=lambda p: 1,
    ),
    PinRow(
        "cp",
        "--cp",
        int,
        "context parallelism: split each sample's sequence over this many ranks, attention as "
        "a ring (long sequences; estimate: 1 unless given)",
        _positive,
        default=lambda p: 1,
    ),
    PinRow(
        "sequence_parallel",
        "--sequence-parallel",
        str.lower,
        "TP's norm and dropout regions on 1/tp of the "
        "tokens, a reduce-scatter and an all-gather for each all-reduce (default: searched; estimate: on where "
        "tp > 1 without pipeline stages)",
        _on_off,
        choices=("on", "off"),
        # where it can run: it never costs memory
        default=lambda p: (p.tp or 1) > 1 and (p.pp or 1) == 1,
    ),
    PinRow(
        "loss_parallel",
        "--loss-parallel",
        str.lower,
        "the output projection's logits sharded on the vocabulary over tp and the cross-entropy computed on "
        "the shards: no rank holds the whole logits (default: searched where tp > 1 without pipeline stages or "
        "cp; estimate: off)",
        _on_off,
        choices=("on", "off"),
        default=lambda p: False,
    ),
    PinRow(
        "precision",
        "--precision",
        str.lower,
        "training precision: fp32; bf16 (bf16 autocast, fp32 master "
        "weights and gradient reduction); bf16-pure (weights, gradients and optimizer state in bf16); fp16 "
        "(fp16 autocast, fp32 master weights, loss scaling) (default: bf16 on GPUs, fp32 on CPU ranks, a model's "
        "16-bit parameters in their own dtype)",
        _precision,
        choices=PIN_PRECISIONS,
        estimate_optional=True,
    ),
    PinRow(
        "compile",
        "--compile",
        str.lower,
        "torch.compile each block (inductor fuses its elementwise ops between the matmuls; the first steps "
        "compile); pipelines, --cp and --ep run eager (default: off)",
        _on_off,
        choices=("on", "off"),
        default=lambda p: False,
    ),
    PinRow(
        "float8",
        "--float8",
        str.lower,
        "float8 training of the linears torchao converts (their dims divisible by 16, not the output "
        "projection): tensorwise (one scale per tensor; FSDP2 gathers the weights in float8), rowwise (one scale "
        "per row), or off (default: searched on devices with float8 matmuls, off elsewhere; estimate: off)",
        _float8,
        choices=FLOAT8_CHOICES,
        default=lambda p: FLOAT8_CHOICES[0],
    ),
    PinRow(
        "offload",
        "--offload",
        str.lower,
        "offload the model state to host memory: cpu (FSDP2's CPUOffloadPolicy: ZeRO-3's parameter, gradient and "
        "optimizer-state shards on the host, the optimizer step on the CPU, ZeRO-3 without pipeline stages on GPUs); "
        "nvme is priced and refused; none (default: searched where a plan needs it or it wins; estimate: none)",
        _offload,
        choices=PIN_OFFLOAD,
        default=lambda p: PIN_OFFLOAD[0],
    ),
    PinRow(
        "async_tp",
        "--async-tp",
        str.lower,
        "async TP: inductor overlaps each sequence-parallel all-gather and reduce-scatter with its matmul in "
        "chunks over symmetric memory (needs --compile on, tp > 1 with sequence parallelism, NCCL ranks) "
        "(default: searched there; estimate: off)",
        _on_off,
        choices=("on", "off"),
        default=lambda p: False,
    ),
    PinRow(
        "compile_loss",
        "--compile-loss",
        str.lower,
        "torch.compile the loss (inductor fuses the fp32 upcast, log-softmax and nll: no fp32 copy of the logits "
        "kept for backward), as torchtitan does under --training.compile since April 2025; not in pipelines nor "
        "beside loss parallelism (default: on under --compile on without either, else off)",
        _on_off,
        choices=("on", "off"),
        default=lambda p: bool(p.compile) and (p.pp or 1) == 1 and not p.loss_parallel,
    ),
)
PIN_OF: dict[str, PinRow] = {**{row.keyword: row for row in PINS}, **{row.name: row for row in PINS}}


def _pin_fields(cls: type) -> type:
    """``Pins``' fields: one per row of ``PINS``, in its order, each None unless pinned."""
    cls.__annotations__ = {row.name: "Any" for row in PINS}
    for row in PINS:
        setattr(cls, row.name, None)
    return dataclass(frozen=True, init=False)(cls)


@_pin_fields
class Pins:
    """The decisions the user fixed by hand: ``Decisions``' fields (the mesh's by axis: dp, tp, pp, cp) and the
    stage cuts, each None where the planner chooses. One field per row of ``PINS``; ``Pins(**keywords)`` takes
    each by its field name or by its API keyword (``zero`` for ``zero_stage``), and checks it (the row's
    ``check``): a value outside is one line naming the flag."""

    def __init__(self, **pins: Any):
        given: dict[str, Any] = {}
        for key, value in pins.items():
            row = PIN_OF.get(key)
            if row is None:
                raise AutoshardError(f"unknown pin {key!r}; the pins are {', '.join(r.keyword for r in PINS)}")
            if value is not None and given.get(row.name) is not None:
                raise AutoshardError(f"{row.keyword} and {row.name} pin the same decision ({row.flag}); give one")
            if value is not None:
                given[row.name] = value
        for row in PINS:
            value = given.get(row.name)
            object.__setattr__(self, row.name, row.check(value, row.flag) if value is not None and row.check else value)

    @property
    def names(self) -> tuple[str, ...]:
        """The pinned decisions by their API keyword (``provenance.pinned``), in ``PINS``' order."""
        return tuple(row.keyword for row in PINS if getattr(self, row.name) is not None)

    @property
    def wants_pipeline(self) -> bool:
        return (
            (self.pp or 1) > 1
            or self.schedule not in (None, "none")
            or (self.virtual_stages or 1) > 1
            or self.stage_cuts is not None
        )

    def with_defaults(self) -> Pins:
        """These pins with every unpinned decision that has a natural default (its row's ``default``) set to it,
        in ``PINS``' order: what ``estimate`` prices, which needs every other decision pinned
        (``missing_for_estimate``). The schedule is none without pipeline stages and interleaved 1F1B with
        several stages per rank; the virtual stages follow the schedule (1 for gpipe and 1f1b)."""
        pins = self
        for row in PINS:
            if row.default is not None and getattr(pins, row.name) is None:
                pins = replace(pins, **{row.name: row.default(pins)})
        return pins

    def missing_for_estimate(self) -> tuple[str, ...]:
        """The decisions ``estimate`` needs pinned that are neither pinned nor defaulted (``with_defaults``), by
        their API keyword (``PIN_OF[keyword].flag`` is the flag)."""
        pins = self.with_defaults()
        return tuple(row.keyword for row in PINS if getattr(pins, row.name) is None and not row.estimate_optional)


STAGE_CUTS_EVEN = "even"  # Megatron-LM's split: ⌊k·L / S⌋ for k = 1 .. S − 1, L blocks over S = pp·v stages


def parse_stage_cuts(value: object) -> str | tuple[int, ...]:
    """``--stage-cuts``: "even", or increasing block indices ≥ 1 ("12,24,36" or a sequence of ints)."""
    if isinstance(value, str) and value.strip().lower() == STAGE_CUTS_EVEN:
        return STAGE_CUTS_EVEN
    parts = value.split(",") if isinstance(value, str) else value
    try:
        cuts = tuple(_cut_index(part) for part in parts)
    except (TypeError, ValueError):
        cuts = ()
    if not cuts or any(b <= a for a, b in zip(cuts, cuts[1:])):
        shown = (
            value
            if isinstance(value, str)
            else ",".join(map(str, value))
            if isinstance(value, (list, tuple))
            else repr(value)
        )
        raise AutoshardError(
            f"--stage-cuts {shown[:80]} must be 'even' or increasing block indices >= 1, the "
            f"first block of each stage after the first; e.g. --stage-cuts even or --stage-cuts 12,24,36"
        )
    return cuts


def _cut_index(part: object) -> int:
    value = int(part.strip()) if isinstance(part, str) else part
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(part)
    return value
