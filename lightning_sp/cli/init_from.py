"""``model.init_from: DIR`` with the sizes left out: the architecture comes from
``DIR/config.json``.

A fit / validate / test / estimate / prepare command line that names ``model.init_from`` may
state none, some or all of the architecture fields of ``model.config``
(:class:`~lightning_sp.model.architecture.Architecture`: sizes, norms, positions, ...).
*Stated* means written in a config file or on the command line, whatever the value: the CLI
parses the same arguments a second time without defaults
(``parser.parse_args(args, defaults=False)``) and reads which keys are there. Every
architecture field not stated (``moe.*`` field by field) is set from the directory's model
(:func:`~lightning_sp.interop.hf.read_hf_config`, every family we read), and so is
``hf_model_type``; a stated one is kept and must equal the directory's (the one-line check
of :func:`~lightning_sp.interop.hf.check_hf_directory`, run here, before any other check).
Run settings (sequence length, layout, recomputation, sequence parallelism, attention
backend, dropout, seed) are never read from the directory: they stay as the config states
them, or their defaults.

The parsed namespace itself is completed, so that every check before launch
(:mod:`lightning_sp.cli.checks`), the planner (``estimate``), ``hparams.yaml`` and the
module see the resolved architecture. ``--print_config`` prints before this step: it shows
the config as given.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jsonargparse import ArgumentParser, Namespace

from lightning_sp.interop.hf import check_hf_directory, read_hf_config
from lightning_sp.model.architecture import Architecture
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.moe.config import MoEArchitecture, MoEConfig

ARCHITECTURE_FIELDS = tuple(f.name for f in dataclasses.fields(Architecture))
"""The ``model.config`` fields the directory gives when not stated."""


def stated_keys(parser: ArgumentParser, args: Any, prefix: str) -> set[str]:
    """The ``model.config`` keys (``hidden_size``, ``moe.top_k``) that the command line
    ``args`` (or a mapping, as ``LightningCLI(args=...)`` takes) states, in its config files
    or options, under ``prefix`` (``fit.`` for a subcommand, ``""`` otherwise)."""
    if isinstance(args, dict | Namespace):
        given = parser.parse_object(args, defaults=False)
    else:
        given = parser.parse_args(args, defaults=False)
    config = given.get(f"{prefix}model.config")
    if not isinstance(config, Namespace):
        return set()
    return set(config.keys())


def _plain(value: Any) -> Any:
    """A record as the namespace jsonargparse gives for it; any other value as it is."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return Namespace(
            **{f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        )
    return value


def _moe(given: Any, theirs: MoEArchitecture | None, stated: set[str]) -> Any:
    """``model.config.moe``: its stated fields, the directory's shape for the others (the
    training settings, when not stated, at their defaults)."""
    if theirs is None:
        return given
    current = dict(vars(given)) if isinstance(given, Namespace) else {}
    fields = {k: v for k, v in current.items() if f"moe.{k}" in stated}
    for f in dataclasses.fields(MoEArchitecture):
        if f"moe.{f.name}" not in stated:
            fields[f.name] = getattr(theirs, f.name)
    return _plain(MoEConfig(**fields))


def resolve_init_from(model: Namespace, stated: set[str]) -> None:
    """Complete the parsed ``model`` section (``init_from`` set) in place: each architecture
    field of ``model.config`` not in ``stated`` (and ``hf_model_type``) from the directory's
    model; then check the whole against the directory (one :class:`ConfigError` line naming
    the first stated field that differs from it, before any other check)."""
    directory = model.get("init_from")
    if directory is None:
        return
    theirs = read_hf_config(directory)
    config = model.get("config")
    if not isinstance(config, Namespace):
        config = model["config"] = Namespace()
    architecture = theirs.architecture
    for name in ARCHITECTURE_FIELDS:
        if name == "moe":
            config["moe"] = _moe(config.get("moe"), architecture.moe, stated)
        elif name not in stated:
            config[name] = _plain(getattr(architecture, name))
    if "hf_model_type" not in stated:
        config["hf_model_type"] = theirs.hf_model_type
    check_hf_directory(directory, GPTConfig.from_values(config))


def complete_from_directory(parser: ArgumentParser, args: Any, parsed: Namespace) -> None:
    """:func:`resolve_init_from` on the parsed command line ``parsed`` (its subcommand's
    section, or the whole for a command without subcommands) when it names
    ``model.init_from``; nothing otherwise (no second parse)."""
    subcommand = parsed.get("subcommand")
    prefix = f"{subcommand}." if subcommand else ""
    model = parsed.get(f"{prefix}model")
    if not isinstance(model, Namespace) or model.get("init_from") is None:
        return
    resolve_init_from(model, stated_keys(parser, args, prefix))


__all__ = ["ARCHITECTURE_FIELDS", "complete_from_directory", "resolve_init_from", "stated_keys"]
