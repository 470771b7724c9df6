"""Command-line and config-file mistakes in one line: ``error: ...`` with the closest valid
option for an unknown key, instead of jsonargparse's usage dump (about 100 lines) before the
message.

``cli.py``'s parsers are :class:`OneLineErrorParser`; a misspelt key (``hidden_sise`` in a
YAML file or ``--model.config.hidden_sise`` on the command line) ends the run with
``error: Subcommand 'fit' does not accept option 'model.config.hidden_sise'; did you mean
'model.config.hidden_size'? (cli.py fit --help lists every option)`` and exit code 2.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import inspect
import math
import os
import re
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from jsonargparse.typing import register_type
from lightning.pytorch.cli import LightningArgumentParser
from typing_extensions import override

from lightning_sp.errors import ConfigError
from lightning_sp.model.recompute import RecomputePolicy
from lightning_sp.training.checks import MOVED_STRATEGY_ARGS, moved_strategy_arg
from lightning_sp.training.strategy import MegatronSPStrategy


def _policy(value: object) -> object:
    """A config file's ``recompute`` as the policy it names; a value that names none is kept
    as given, for the config's own construction to refuse in one line (jsonargparse would
    wrap the error in several)."""
    try:
        return RecomputePolicy.parse(value)
    except ConfigError:
        return value


register_type(
    RecomputePolicy,
    serializer=lambda p: p.value if isinstance(p, RecomputePolicy) else p,
    deserializer=_policy,
)
"""``model.config.recompute`` / ``recompute_rest`` are written as a preset or a list of modules
(their YAML spelling) and parsed once, into the policy the config holds."""

_UNKNOWN = (
    re.compile(r"does not accept option '([^']+)'"),
    re.compile(r"unrecognized arguments: --?([^\s=]+)"),
    re.compile(r"Key '([^']+)' is not expected"),
)


def option_keys(parser: argparse.ArgumentParser) -> list[str]:
    """Every option key ``parser`` accepts (``model.config.hidden_size``), its subcommands'
    included."""
    keys: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                keys.extend(option_keys(sub))
        elif action.dest and action.dest != argparse.SUPPRESS:
            keys.append(action.dest)
    return keys


def unknown_key(message: str) -> str | None:
    """The unknown option a parse error names, if it names one."""
    for pattern in _UNKNOWN:
        found = pattern.search(message)
        if found:
            return found.group(1)
    return None


_CLASS_OPTION = re.compile(
    r"Parser key \"([^\"]+)\".*class_path '([\w.]+)': Option '([^']+)' is not accepted"
)


def unknown_class_key(message: str) -> str | None:
    """For jsonargparse's report of an unknown key inside a class-typed field (a union of every
    subtype's error, hundreds of characters): one line naming the field, the key and the valid
    keys (the class's ``__init__`` parameters), with the closest. None for other messages."""
    found = _CLASS_OPTION.search(message)
    if found is None:
        return None
    field, class_path, key = found.groups()
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        if key in MOVED_STRATEGY_ARGS and issubclass(cls, MegatronSPStrategy):
            return moved_strategy_arg(key)  # it lives elsewhere now: say where
        valid = [
            p for p in inspect.signature(cls).parameters if p not in ("self", "args", "kwargs")
        ]
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{field} has no key {key!r}; valid: {', '.join(valid)}{hint}"


_CLASS_VALUE = re.compile(
    r"Parser key \"([^\"]+)\".*?class_path '[\w.]+': Parser key \"([^\"]+)\": (?:Expected a "
    r"(.+?)\. Got value: (.*?)|Does not validate against any of the Union subtypes Subtypes: "
    r"\[(.+?)\] .*? Given value: (.*?)) - Expected a <class 'NoneType'> Given value type"
)
_TYPE_NAMES = {
    "int": "an integer", "float": "a finite number", "bool": "true or false", "str": "a string",
    "NoneType": "null",
}  # fmt: skip


def _valid(expected: str) -> str:
    """What jsonargparse's type name ``expected`` accepts, in words."""
    literal = re.fullmatch(r"typing\.Literal\[(.*)\]", expected.strip())
    if literal:
        values = ", ".join(v.strip().strip("'\"") for v in literal.group(1).split(","))
        return f"one of {values}"
    kind = re.fullmatch(r"<class '(\w+)'>", expected.strip())
    return _TYPE_NAMES.get(kind.group(1), kind.group(1)) if kind else expected.strip()


def bad_class_value(message: str) -> str | None:
    """For jsonargparse's report of a value of the wrong type inside a class-typed field (a
    union of every subtype's error, about 500 characters: ``--model.config.moe.router_dtype
    bf16``): one line naming the field, the value and what is valid. None for other
    messages."""
    found = _CLASS_VALUE.search(message)
    if found is None:
        return None
    field, key, expected, value, union, union_value = found.groups()
    if expected is not None:
        return f"{field}.{key}={value!r} must be {_valid(expected)}"
    kinds = re.findall(r"typing\.Literal\[[^\]]*\]|<class '\w+'>", union)
    return f"{field}.{key}={union_value!r} must be {' or '.join(map(_valid, kinds))}"


def one_line(message: str, keys: list[str], prog: str) -> str:
    """``message`` on one line, with the closest of ``keys`` to the unknown option it names
    (``difflib.get_close_matches``), and where to find every option."""
    line = " ".join(message.split())
    known = unknown_class_key(line) or bad_class_value(line)
    if known is not None:
        return known
    key = unknown_key(line)
    if key is not None:
        close = difflib.get_close_matches(key, keys, n=1, cutoff=0.8)
        if not close:  # compare the last part alone: 'hidden_sise' -> 'model.config.hidden_size'
            tails = {k.rsplit(".", 1)[-1]: k for k in keys if k.count(".") == key.count(".")}
            near = difflib.get_close_matches(key.rsplit(".", 1)[-1], list(tails), n=1)
            close = [tails[near[0]]] if near else []
        if close:
            line += f"; did you mean {close[0]!r}?"
    return f"{line} ({prog} --help lists every option)"


def program() -> str:
    """How the command line was invoked, for usage lines and hints: ``lightning-sp``,
    ``python -m lightning_sp`` or ``cli.py``."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "lightning-sp"
    return "python -m lightning_sp" if name == "__main__.py" else name


def true_or_false(value: str) -> bool:
    """A command-line boolean (``true``/``1``/``yes``, ``false``/``0``/``no``, any case), the
    ``type`` of the argparse commands' boolean options; else one line."""
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"{value!r} is not true or false")


def positive(kind: type[int] | type[float]) -> Callable[[str], Any]:
    """An ``argparse`` type: ``kind`` of the text, finite and above 0, else a one-line
    ``ArgumentTypeError`` naming the value and what is valid."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value <= 0:
            what = "integer" if kind is int else "finite number"
            raise argparse.ArgumentTypeError(f"{text!r} is not a positive {what}")
        return value

    return parse


class OneLineArgumentParser(argparse.ArgumentParser):
    """``argparse`` for the commands that are not Lightning's (``generate``, ``export``,
    ``calibrate``, ``step-check``): named as the user ran it (:func:`program`), and a parse
    error is one line and exit code 2 (no usage dump)."""

    def __init__(self, command: str, **kwargs: Any) -> None:
        super().__init__(prog=f"{program()} {command}", **kwargs)

    @override
    def error(self, message: str) -> NoReturn:
        line = " ".join(message.split())
        print(f"error: {line} ({self.prog} --help lists every option)", file=sys.stderr)
        sys.exit(2)


class OneLineErrorParser(LightningArgumentParser):
    """``LightningArgumentParser`` whose parse errors are one line on stderr and exit code 2
    (no usage dump); errors jsonargparse handles itself (``exit_on_error`` off) are unchanged."""

    @override
    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "")
        print(f"error: {one_line(message, option_keys(parser), prog)}", file=sys.stderr)
        sys.exit(2)
