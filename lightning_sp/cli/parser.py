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
import os
import re
import sys
from typing import Any, NoReturn

from lightning.pytorch.cli import LightningArgumentParser
from typing_extensions import override

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
        valid = [
            p for p in inspect.signature(cls).parameters if p not in ("self", "args", "kwargs")
        ]
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{field} has no key {key!r}; valid: {', '.join(valid)}{hint}"


def one_line(message: str, keys: list[str], prog: str) -> str:
    """``message`` on one line, with the closest of ``keys`` to the unknown option it names
    (``difflib.get_close_matches``), and where to find every option."""
    line = " ".join(message.split())
    known = unknown_class_key(line)
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
