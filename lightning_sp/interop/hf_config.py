"""A Hugging Face ``config.json`` against :class:`GPTConfig`, as data: each model type lists
its :class:`ConfigField` s (one of our fields, the ``config.json`` key that holds it and how to
convert) and its :class:`Option` s (``config.json`` keys with no field of ours, which must hold
the value this GPT computes). From those lists alone:

* :func:`config_fields` reads a ``config.json`` into ``GPTConfig`` field values;
* :func:`check_config` checks a ``GPTConfig`` against one (one :class:`ConfigError` line per
  mismatch: our field, its value, the value the directory needs);
* :func:`write_config` writes the ``config.json`` keys of a ``GPTConfig``.

A model type can hold a config exactly when the config survives writing and reading back
(:func:`fits`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_sp.errors import ConfigError
from lightning_sp.model.config import GPTConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"

_MISSING = object()


@dataclass(frozen=True)
class ConfigField:
    """One of our config fields and where a ``config.json`` holds it.

    ``hf`` is the key (``None``: the model type fixes the value, ``default``). ``choices``
    maps the key's values to ours (a value outside it is one the model does not compute).
    ``read(hf)`` overrides the lookup (several keys, legacy names); ``write(config)`` the
    written value; ``value(config)`` what of ours is compared (a property such as
    ``ffn_size``; default the field). ``at_most``: ours may be smaller (``seq_length``
    against the position table).
    """

    ours: str
    hf: str | None = None
    default: Any = _MISSING
    choices: Mapping[Any, Any] | None = None
    read: Callable[[Mapping[str, Any]], Any] | None = None
    write: Callable[[GPTConfig], Any] | None = None
    value: Callable[[GPTConfig], Any] | None = None
    at_most: bool = False
    written_only: bool = False
    """Written, never read or checked (a second key a sibling field reads with its own)."""
    checked: bool = True
    """False: read and written, checked by an :class:`Option` of the same key instead."""

    def raw(self, hf: Mapping[str, Any]) -> Any:
        """The ``config.json`` value (before ``choices``), or ``default``."""
        if self.read is not None:
            return self.read(hf)
        if self.hf is None or self.hf not in hf or hf[self.hf] is None:
            return self.default
        return hf[self.hf]

    def ours_from(self, hf: Mapping[str, Any], where: str) -> Any:
        """Our field's value in the model whose ``config.json`` is ``hf``."""
        raw = self.raw(hf)
        if raw is _MISSING:
            raise ConfigError(f"{where} has no {self.hf} in {CONFIG_FILE}")
        if self.choices is None:
            return raw
        if raw not in self.choices:
            valid = ", ".join(repr(c) for c in self.choices)
            raise ConfigError(
                f"{where} uses {self.hf}={raw!r}, which this GPT does not compute; valid: {valid}"
            )
        return self.choices[raw]

    def of(self, config: GPTConfig) -> Any:
        """Our value, as compared."""
        return self.value(config) if self.value is not None else getattr(config, self.ours)

    def written(self, config: GPTConfig) -> Any:
        """The ``config.json`` value for ``config``."""
        if self.write is not None:
            return self.write(config)
        ours = self.of(config)
        if self.choices is None:
            return ours
        for theirs, value in self.choices.items():  # the first spelling is the one written
            if value == ours:
                return theirs
        valid = ", ".join(repr(v) for v in dict.fromkeys(self.choices.values()))
        raise ConfigError(f"{self.ours}={ours!r} has no {self.hf} value; valid: {valid}")


@dataclass(frozen=True)
class Option:
    """A ``config.json`` key with no field of ours: ``computes(hf)`` is the value this GPT
    computes given the rest of the config (a constant for most)."""

    hf: str
    computes: Callable[[Mapping[str, Any]], Any]
    ours: Callable[[GPTConfig], Any] | None = None
    """What a config of ours computes for the key, where that is not a constant of the model
    type (``head_dim``: ``kv_channels`` or h/a); checked against the ``config.json`` value and
    written in place of ``computes``."""

    @classmethod
    def constant(cls, hf: str, value: Any) -> Option:
        return cls(hf, lambda _: value)


@dataclass(frozen=True)
class ConfigTable:
    """What a model type's ``config.json`` says: its fields and options, and the keys only
    written (``extra(config)``: dropouts)."""

    title: str
    """The model's name in messages (``GPT-2``, ``Llama``)."""
    fields: tuple[ConfigField, ...]
    options: tuple[Option, ...] = ()
    extra: Callable[[GPTConfig], dict[str, Any]] = field(default=lambda config: {})
    checks: tuple[Callable[[Mapping[str, Any], GPTConfig, str], None], ...] = ()
    """Further checks ``check(hf, config, where)`` raising :class:`ConfigError` (one line),
    for keys that hold a range of values this GPT computes (Mistral's ``sliding_window``)."""


def read_config_json(directory: str | Path, field: str = "init_from") -> dict[str, Any]:
    """The ``config.json`` of a local Hugging Face directory (``field`` names the option that
    gave it in error messages). :class:`ConfigError` when the directory or its ``config.json``
    is missing or unreadable, or holds both ``rope_parameters`` and a legacy ``rope_scaling``
    (transformers 5 applies the legacy one in place of the other: one of them would be
    read differently)."""
    path = Path(directory)
    where = f"{field}={str(directory)!r}"
    advice = "give a local Hugging Face model directory (as written by save_pretrained)"
    if not path.is_dir():
        raise ConfigError(f"{where} is not a directory; {advice}")
    if not (path / CONFIG_FILE).is_file():
        raise ConfigError(f"{where} has no {CONFIG_FILE}; {advice}")
    try:
        hf = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as error:
        reason = str(error).splitlines()[0]
        raise ConfigError(f"{where}: {CONFIG_FILE} is not readable JSON ({reason})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{where}: {CONFIG_FILE} is not a JSON object")
    if hf.get("rope_scaling") and hf.get("rope_parameters"):  # which one holds is unclear
        raise ConfigError(
            f"{where}: {CONFIG_FILE} has both rope_parameters={hf['rope_parameters']!r} and the "
            f"legacy rope_scaling={hf['rope_scaling']!r}; transformers applies rope_scaling "
            "and drops rope_parameters: keep one of the two keys"
        )
    return hf


def config_fields(table: ConfigTable, hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The ``GPTConfig`` field values of the model whose ``config.json`` is ``hf``
    (``seq_length``: the full position table). :class:`ConfigError` for a value this GPT
    does not compute."""
    return {f.ours: f.ours_from(hf, where) for f in table.fields if not f.written_only}


@dataclass(frozen=True)
class Mismatch:
    """One reason a model type does not hold a config: our field, the one-line message, and for
    a record field (``moe``) each of its fields that differs, with our value."""

    field: str
    message: str
    differs: tuple[tuple[str, Any], ...] = ()


def _record_differences(value: Any, needed: Any) -> list[tuple[str, Any, Any]]:
    """``(field, ours, theirs)`` for each field in which two records of one dataclass differ."""
    if not (dataclasses.is_dataclass(value) and type(value) is type(needed)):
        return []
    return [
        (f.name, getattr(value, f.name), getattr(needed, f.name))
        for f in dataclasses.fields(value)
        if getattr(value, f.name) != getattr(needed, f.name)
    ]


def _field_mismatch(
    f: ConfigField, hf: Mapping[str, Any], config: GPTConfig, where: str
) -> Mismatch | None:
    needed, value = f.ours_from(hf, where), f.of(config)
    shown = _yaml(needed) if dataclasses.is_dataclass(needed) else repr(needed)
    theirs = f"{f.hf}={f.raw(hf)!r}" if f.hf is not None else f"its {f.ours}={shown}"
    if f.at_most:
        if not isinstance(needed, int) or value > needed:
            return Mismatch(
                f.ours, f"{f.ours}={value!r} exceeds {theirs} of {where}; use {f.ours} <= {needed}"
            )
        return None
    if value == needed:
        return None
    differences = _record_differences(value, needed)
    if differences:  # a record (moe): the fields that differ, in YAML
        ours = ", ".join(f"{f.ours}.{name}={a!r}" for name, a, _ in differences)
        theirs = ", ".join(f"{f.ours}.{name}={b!r}" for name, _, b in differences)
        want = ", ".join(f"{name}: {_yaml(b)}" for name, _, b in differences)
        return Mismatch(
            f.ours,
            f"{ours} does not match {theirs} of {where}; set {f.ours}: {{{want}}}",
            tuple((name, a) for name, a, _ in differences),
        )
    return Mismatch(
        f.ours,
        f"{f.ours}={value!r} does not match {theirs} of {where}; set {f.ours}: {_yaml(needed)}",
    )


def mismatches(
    table: ConfigTable, hf: Mapping[str, Any], config: GPTConfig, where: str
) -> list[Mismatch]:
    """Every reason ``config`` is not the model whose ``config.json`` is ``hf``, in the table's
    order (empty: it is). ``where`` names the model in messages."""
    found = []
    for f in table.fields:
        if not f.written_only and f.checked:
            mismatch = _field_mismatch(f, hf, config, where)
            if mismatch is not None:
                found.append(mismatch)
    for option in table.options:
        computed = option.ours(config) if option.ours is not None else option.computes(hf)
        given = hf.get(option.hf, computed)
        if given is not None and given != computed:
            found.append(Mismatch(
                option.hf,
                f"{where} sets {option.hf}={given!r}; this GPT computes {option.hf}={computed!r}",
            ))  # fmt: skip
    for check in table.checks:
        try:
            check(hf, config, where)
        except ConfigError as error:
            found.append(Mismatch("", str(error)))
    return found


def check_config(table: ConfigTable, hf: Mapping[str, Any], config: GPTConfig, where: str) -> None:
    """Raise :class:`ConfigError` (one line naming our field, or the option) unless ``config``
    is the model whose ``config.json`` is ``hf``. ``where`` names the model in messages."""
    found = mismatches(table, hf, config, where)
    if found:
        raise ConfigError(found[0].message)


def write_config(table: ConfigTable, config: GPTConfig) -> dict[str, Any]:
    """The ``config.json`` keys of ``table`` for the model equal to ``config`` (positions:
    ``seq_length``)."""
    hf: dict[str, Any] = dict(table.extra(config))
    for f in table.fields:
        if f.hf is not None:
            hf[f.hf] = f.written(config)
    for option in table.options:
        hf[option.hf] = option.ours(config) if option.ours is not None else option.computes(hf)
    return hf


def fit_mismatches(table: ConfigTable, config: GPTConfig) -> list[Mismatch]:
    """Why the model type does not hold ``config`` exactly (written and read back, it
    checks): empty if it does."""
    try:
        hf = write_config(table, config)
    except ConfigError as error:  # a value with no config.json spelling
        return [Mismatch(str(error).split("=", 1)[0], str(error))]
    return mismatches(table, hf, config, f"a {table.title} model")


def fits(table: ConfigTable, config: GPTConfig) -> str | None:
    """``None`` if the model type holds ``config`` exactly, else the first reason."""
    found = fit_mismatches(table, config)
    return found[0].message if found else None


def _yaml(value: Any) -> str:
    """A value as one writes it in a YAML config."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # its non-defaults
        default = type(value)()
        items = [
            f"{f.name}: {_yaml(getattr(value, f.name))}"
            for f in dataclasses.fields(value)
            if getattr(value, f.name) != getattr(default, f.name)
        ]
        return "{" + ", ".join(items) + "}"
    return str(value)
