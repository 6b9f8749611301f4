"""The plan's symbolic cost read back and evaluated (``inspect --what-if``): ``cost.symbolic``'s expressions.

Plans store the expressions as strings (``sympy.sstr``: deterministic for the same inputs);
``parse_expression`` reads them back without ``eval`` (a plan is data, loading runs no code).
A plan file may be damaged or hostile, so a string is first checked against limits (at most
MAX_EXPRESSION_CHARS characters, MAX_DEPTH levels, numbers of at most MAX_DIGITS digits and
MAX_LITERAL in size, powers only of expressions holding a symbol and only by a written number of
at most MAX_EXPONENT), and ``evaluate`` (``inspect --what-if``) walks the checked tree in floats
(``evaluate_expression``) with every symbol an integer of at most MAX_SYMBOL_VALUE: never exact,
unbounded arithmetic. A division by zero, a result beyond floats or a step time that is not > 0
is a ValueError that ``show.plan_figures`` turns into one line.
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Mapping
from typing import Any

import sympy

from autoshard.cost.symbolic import (
    COMM_PARTS,
    COMPUTE_PARTS,
    MEMORY_PARTS,
    SYMBOLS,
    TIME_PARTS,
    WHAT_IF_EXAMPLES,
    WHAT_IF_NAMES,
)
from autoshard.errors import AutoshardError

_FUNCTIONS = {"Piecewise": sympy.Piecewise, "Eq": sympy.Eq, "Min": sympy.Min, "Max": sympy.Max}


_BINARY = {
    ast.Add: lambda x, y: x + y,
    ast.Sub: lambda x, y: x - y,
    ast.Mult: lambda x, y: x * y,
    ast.Div: lambda x, y: x / y,
    ast.Pow: lambda x, y: x**y,
}


# What a plan's expression may be (a plan writes < 5,000 characters, nesting < 30, coefficients
# < 10^16, exponents 1 and 2): anything beyond is a damaged or hostile file, refused before any
# arithmetic, so that reading one takes bounded time and memory.
MAX_EXPRESSION_CHARS = 20_000


MAX_DEPTH = 100  # syntax-tree levels


MAX_LITERAL = 1e30  # |a number written in the expression|


MAX_EXPONENT = 16  # |a power|, a number written right after ** (its base must hold a symbol)


MAX_SYMBOL_VALUE = 2**40  # a symbol's value at a plan's point or in a what-if


MAX_DIGITS = 30  # digits in a row


_DIGIT_RUN = re.compile(r"[0-9_]+")


def parse_expression(text: str) -> sympy.Expr:
    """An expression string of a plan back to sympy, by walking its syntax tree: only the seven
    symbols, numbers, + − × / **, and Piecewise / Eq / Min / Max; nothing is evaluated as code.
    The limits above are checked first (``_checked_tree``); ValueError names what is wrong."""
    return _convert(_checked_tree(text))


def _checked_tree(text: str) -> ast.AST:
    """The syntax tree of ``text`` once its size, depth, names, numbers and powers are within limits."""
    if not isinstance(text, str):
        raise ValueError(f"an expression must be a string, got {type(text).__name__}")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"an expression of {len(text):,} characters (at most {MAX_EXPRESSION_CHARS:,})")
    digits = max((len(run) for run in _DIGIT_RUN.findall(text)), default=0)
    if digits > MAX_DIGITS:  # Python's parser would build the integer (up to 4,300 digits) first
        raise ValueError(f"a number of {digits} digits in an expression (at most {MAX_DIGITS})")
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError as exc:
        raise ValueError(f"not an expression: {exc.msg[:80]}") from None
    except (MemoryError, RecursionError, ValueError):  # the parser's own depth and digit limits
        raise ValueError("not an expression: nested too deeply or a number too long") from None
    stack = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"an expression nested more than {MAX_DEPTH} levels deep")
        _check_node(node)
        children = node.args if isinstance(node, ast.Call) else ast.iter_child_nodes(node)  # func: checked
        stack.extend(
            (child, depth + 1)
            for child in children
            if not isinstance(child, (ast.expr_context, ast.operator, ast.unaryop))
        )
    return tree


def _check_node(node: ast.AST) -> None:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool):
            return
        if not isinstance(value, (int, float)) or not math.isfinite(value) or abs(value) > MAX_LITERAL:
            raise ValueError(f"the number {_short(node)} in an expression (at most {MAX_LITERAL:g} in size)")
    elif isinstance(node, ast.Name):
        if node.id not in SYMBOLS and node.id not in ("True", "False"):
            raise ValueError(f"unexpected name {node.id[:40]!r} in an expression (symbols: {', '.join(SYMBOLS)})")
    elif isinstance(node, ast.BinOp):
        if type(node.op) not in _BINARY:
            raise ValueError(f"unexpected operator in {_short(node)!r}")
        if isinstance(node.op, ast.Pow):
            exponent = _literal(node.right)
            if exponent is None or abs(exponent) > MAX_EXPONENT:
                raise ValueError(f"exponent in {_short(node)!r} is not a number of at most {MAX_EXPONENT}")
            if not any(isinstance(n, ast.Name) and n.id in SYMBOLS for n in ast.walk(node.left)):
                raise ValueError(f"a power of a number, {_short(node)!r}, in an expression")
    elif isinstance(node, ast.UnaryOp):
        if not isinstance(node.op, (ast.USub, ast.UAdd)):
            raise ValueError(f"unexpected operator in {_short(node)!r}")
    elif isinstance(node, ast.Call):
        if not (isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS) or node.keywords:
            raise ValueError(f"unexpected {_short(node)!r} in an expression")
    elif not isinstance(node, ast.Tuple):
        raise ValueError(f"unexpected {_short(node)!r} in an expression")


def _literal(node: ast.AST) -> float | None:
    """A number written as such (or negated), else None."""
    sign = 1
    while isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        sign, node = (-sign if isinstance(node.op, ast.USub) else sign), node.operand
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return sign * node.value
    return None


def _short(node: ast.AST) -> str:
    text = ast.unparse(node) if not isinstance(node, ast.Constant) else repr(node.value)[:40]
    return text if len(text) <= 40 else text[:37] + "..."


def _convert(node: ast.AST):
    if isinstance(node, ast.Constant) and isinstance(node.value, bool):
        return sympy.true if node.value else sympy.false
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return sympy.Integer(node.value)
    if isinstance(node, ast.Constant) and isinstance(node.value, float):
        return sympy.Float(node.value)
    if isinstance(node, ast.Name) and node.id in SYMBOLS:
        return SYMBOLS[node.id]
    if isinstance(node, ast.Name) and node.id in ("True", "False"):
        return sympy.true if node.id == "True" else sympy.false
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        x = _convert(node.operand)
        return -x if isinstance(node.op, ast.USub) else x
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_convert(node.left), _convert(node.right))
    if isinstance(node, ast.Tuple):
        return tuple(_convert(e) for e in node.elts)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _FUNCTIONS
        and not node.keywords
    ):
        return _FUNCTIONS[node.func.id](*(_convert(a) for a in node.args))
    raise ValueError(f"unexpected {_short(node)!r} in an expression")


def evaluate_expression(text: str, values: Mapping[str, float]) -> float:
    """``text`` (a plan's expression) at ``values`` (every symbol it names), in floating point: the
    checked syntax tree is walked with Python floats, never with exact (unbounded) arithmetic. A
    division by zero, a result beyond floats or a malformed term is a ValueError naming it."""
    tree = _checked_tree(text)
    try:
        result = _float_of(tree, values)
    except ZeroDivisionError:
        raise ValueError(f"{_clip(text)} divides by zero at {_point_text(values)}") from None
    except OverflowError:
        result = math.inf
    if not isinstance(result, float) or not math.isfinite(result):
        raise ValueError(f"{_clip(text)} is not a finite number at {_point_text(values)}")
    return result


def _float_of(node: ast.AST, values: Mapping[str, float]):
    """Floats for numbers, bools for conditions; the tree was checked by ``_checked_tree``."""
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, bool) else float(node.value)
    if isinstance(node, ast.Name):
        if node.id in ("True", "False"):
            return node.id == "True"
        if node.id not in values:
            raise ValueError(f"no value for the symbol {node.id}")
        return float(values[node.id])
    if isinstance(node, ast.UnaryOp):
        x = _number_of(node.operand, values)
        return -x if isinstance(node.op, ast.USub) else x
    if isinstance(node, ast.BinOp):
        x, y = _number_of(node.left, values), _number_of(node.right, values)
        if isinstance(node.op, ast.Div) and y == 0:
            raise ZeroDivisionError
        if isinstance(node.op, ast.Pow) and x == 0 and y < 0:
            raise ZeroDivisionError
        if isinstance(node.op, ast.Pow) and x < 0 and not float(y).is_integer():
            raise ValueError(f"a fractional power of a negative number in {_short(node)!r}")
        result = _BINARY[type(node.op)](x, y)
        if not math.isfinite(result):
            raise OverflowError
        return result
    if isinstance(node, ast.Call):
        name, args = node.func.id, node.args
        if name in ("Min", "Max"):
            if not args:
                raise ValueError(f"{name}() of nothing in an expression")
            numbers = [_number_of(a, values) for a in args]
            return min(numbers) if name == "Min" else max(numbers)
        if name == "Eq":
            if len(args) != 2:
                raise ValueError("Eq takes two arguments")
            return _number_of(args[0], values) == _number_of(args[1], values)
        for pair in args:  # Piecewise((value, condition), ...): the first whose condition holds
            if not (isinstance(pair, ast.Tuple) and len(pair.elts) == 2):
                raise ValueError("Piecewise takes (value, condition) pairs")
            condition = _float_of(pair.elts[1], values)
            if not isinstance(condition, bool):
                raise ValueError("a Piecewise condition must be Eq(...) or True")
            if condition:
                return _number_of(pair.elts[0], values)
        raise ValueError("no Piecewise condition holds")
    raise ValueError(f"unexpected {_short(node)!r} in an expression")


def _number_of(node: ast.AST, values: Mapping[str, float]) -> float:
    x = _float_of(node, values)
    if isinstance(x, bool) or not isinstance(x, float):
        raise ValueError(f"a condition where a number belongs in {_short(node)!r}")
    return x


def _clip(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:37] + "...")


def _point_text(values: Mapping[str, float]) -> str:
    return " ".join(f"{k}={v:g}" for k, v in values.items())


def _symbol_values(symbolic: Mapping[str, Any], values: Mapping[str, float]) -> dict[str, float]:
    """The plan's point with ``values`` changed: every symbol an integer in 1 .. MAX_SYMBOL_VALUE."""
    symbols = symbolic["symbols"]
    if not isinstance(symbols, Mapping):
        raise ValueError("symbols must be a mapping of symbol names to integers")
    if "cp" in values and "cp" not in symbols:
        raise ValueError(
            "this plan has no context parallelism (cp=1), so its expressions hold no cp; re-plan "
            "with --cp N (or a long --seq-len) to ask what another cp would cost"
        )
    point = {**symbols, **values}
    for name, value in point.items():
        if name not in SYMBOLS:
            raise ValueError(f"unknown symbol {str(name)[:40]!r} (symbols: {', '.join(SYMBOLS)})")
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SYMBOL_VALUE:
            shown = repr(value)[:40] if not isinstance(value, int) or value.bit_length() < 100 else "a huge integer"
            raise ValueError(f"symbol {name} must be an integer in 1 .. {MAX_SYMBOL_VALUE:,}, got {shown}")
    return point


def evaluate(symbolic: Mapping[str, Any], values: Mapping[str, float]) -> dict[str, float]:
    """Every part, their sums, the step time and the peak memory at ``values`` (symbol name -> value;
    missing symbols take the plan's own values). Raises ValueError on a malformed ``symbolic``, an
    expression beyond the limits, a division by zero or a step time that is not > 0."""
    point = _symbol_values(symbolic, values)

    def at(text: str) -> float:
        return evaluate_expression(text, point)

    out = {k: at(symbolic["parts"].get(k, "0")) for k in TIME_PARTS}  # plans before host_s lack it
    out["compute_s"] = sum(out[k] for k in COMPUTE_PARTS)
    out["comm_exposed_s"] = sum(out[k] for k in COMM_PARTS)
    out["step_time_s"] = at(symbolic["step_time_s"])
    out.update({k: at(symbolic["memory"][k]) for k in MEMORY_PARTS})
    out["memory_peak_bytes"] = at(symbolic["memory_peak_bytes"])
    out["model_flops_per_sample"] = at(symbolic["model_flops_per_sample"])
    if out["step_time_s"] <= 0:
        raise ValueError(f"the step time is {out['step_time_s']:g} s at {_point_text(point)}, not > 0")
    if not all(math.isfinite(v) for v in out.values()):
        raise ValueError(f"the parts do not add up to finite numbers at {_point_text(point)}")
    return out


def what_if_values(items: list[str], tokens_per_sample: int) -> dict[str, int]:
    """``name=value`` pairs (``WHAT_IF_NAMES``) to symbol values, each an integer in 1 ..
    ``MAX_SYMBOL_VALUE``; one-line errors naming the valid ones."""
    valid = ", ".join(WHAT_IF_NAMES)
    out: dict[str, int] = {}
    for item in items:
        shown = repr(item if len(item) <= 60 else item[:57] + "...")
        name, sep, raw = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in WHAT_IF_NAMES:
            raise AutoshardError(f"--what-if {shown}: expected NAME=VALUE with NAME one of {valid}")
        raw = raw.strip()
        digits = raw.removeprefix("+")
        number = digits.isascii() and digits.isdigit()
        value = (int(digits) if len(digits) <= 20 else None) if number else 0  # None: too many digits
        if value is None or value > MAX_SYMBOL_VALUE:
            raise AutoshardError(
                f"--what-if {shown}: {name} must be at most {MAX_SYMBOL_VALUE:,} (2^40), "
                f"e.g. {name}={WHAT_IF_EXAMPLES[name]}"
            )
        if value < 1:
            raise AutoshardError(
                f"--what-if {shown}: {name} must be a positive integer, e.g. {name}={WHAT_IF_EXAMPLES[name]}"
            )
        if name == "seq_len" and tokens_per_sample <= 1:
            raise AutoshardError(
                f"--what-if {shown}: this model has no sequence dimension; use one of "
                f"{', '.join(n for n in WHAT_IF_NAMES if n != 'seq_len')}"
            )
        out[WHAT_IF_NAMES[name]] = value
    return out
