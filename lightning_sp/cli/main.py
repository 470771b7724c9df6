"""The command line: ``lightning-sp <command>``, ``python -m lightning_sp <command>``, or
``python cli.py <command>`` from the repository root; every form runs :func:`run`.

Commands, one module each in :mod:`lightning_sp.cli`:

``fit``, ``validate``, ``test``
    Lightning's ``LightningCLI`` (:mod:`~lightning_sp.cli.fit`):
    ``lightning-sp fit --config configs/tiny.yaml``; ``fit --help`` documents every option,
    ``--print_config`` shows a full config.
``estimate``
    The activation-memory planner and step-time model (:mod:`~lightning_sp.cli.estimate`): it
    takes exactly ``fit``'s arguments plus its own (``--format json``, ``--plot FILE``,
    ``--device_memory 80GB``, ``--cluster h100-80gb``, ``--search true``).
``prepare``
    Tokenizes the config's corpus once into ``data.prepared_dir``
    (:mod:`~lightning_sp.cli.prepare`; same arguments as ``fit``).
``generate``
    Continues a prompt with a checkpoint (:mod:`~lightning_sp.cli.generate`).
``export``
    Writes a checkpoint as a Hugging Face directory (:mod:`~lightning_sp.cli.export`).
``calibrate``, ``step-check``
    Measure the step-time model's kernels on this device, and compare its prediction with a
    measured step (:mod:`~lightning_sp.cli.calibrate`, :mod:`~lightning_sp.cli.step_check`).

A bad input ends the run with one line ``error: ...`` on stderr, printed by rank 0 only, and
exit code 2; a non-finite loss or gradient (strategy ``nonfinite: stop``) with one line and
exit code 3; a checkpoint that cannot be written with one line and exit code 4. Checks that
need only the config run before any class is built or any process starts
(:mod:`lightning_sp.cli.checks`); a bad input found after launch (an empty corpus, a JSONL row
without the text field) is agreed by every rank and printed once
(:mod:`lightning_sp.runtime.agree`).
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import NoReturn

from jsonargparse import set_parsing_settings

import lightning_sp  # noqa: F401  (registers the "megatron_sp" strategy)
from lightning_sp.checkpoint import CheckpointSaveError
from lightning_sp.cli.parser import program
from lightning_sp.errors import ConfigError
from lightning_sp.parallel.release import leave
from lightning_sp.runtime import shutdown
from lightning_sp.runtime.agree import LocalError
from lightning_sp.runtime.guard import NonFiniteError

EXIT_CONFIG, EXIT_NONFINITE, EXIT_CHECKPOINT = 2, 3, 4
PEER_STOP_SECONDS = 10.0
"""How long a child rank whose step failed waits for the launcher's signal before it reports
the failure as its own (:func:`lightning_sp.runtime.shutdown.wait_for_stop`)."""


def _estimate(args: list[str]) -> int:
    from lightning_sp.cli.estimate import main as estimate
    from lightning_sp.cli.estimate import read_estimate_args

    return estimate(read_estimate_args, args)


def _generate(args: list[str]) -> int:
    from lightning_sp.cli.fit import GPTCLI
    from lightning_sp.cli.generate import main as generate

    return generate(args, GPTCLI)


def _main_of(module: str) -> Callable[[list[str]], int]:
    """``lightning_sp.cli.MODULE.main``, imported when the command runs (so that another
    command does not pay for its imports)."""

    def run(args: list[str]) -> int:
        main: Callable[[list[str]], int] = importlib.import_module(
            f"lightning_sp.cli.{module}"
        ).main
        return main(args)

    return run


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "estimate": _estimate,
    "prepare": _main_of("prepare"),
    "export": _main_of("export"),
    "generate": _generate,
    "calibrate": _main_of("calibrate"),
    "step-check": _main_of("step_check"),
}
"""The commands besides Lightning's own (:data:`LIGHTNING_COMMANDS`), each
``fn(args after the command) -> exit status``; imported on use."""


LIGHTNING_COMMANDS = {
    "fit": "train (LightningCLI: --config YAML, --trainer.* --model.* --data.*)",
    "validate": "the validation loss of a checkpoint (fit's options, --ckpt_path)",
    "test": "the test loss of a checkpoint (fit's options, --ckpt_path)",
    "predict": "continue data.prompts with a checkpoint, as JSON lines",
}
"""Lightning's own commands (``LightningCLI``'s subcommands), with what each does."""

DESCRIPTIONS = {
    **LIGHTNING_COMMANDS,
    "estimate": "activation memory, model state and step time of fit's config (no GPU needed)",
    "prepare": "tokenize the config's corpus once into data.prepared_dir",
    "generate": "continue a prompt with a checkpoint (--ckpt_path, --prompt)",
    "export": "write a checkpoint as a Hugging Face directory (--ckpt_path, --output)",
    "calibrate": "measure this device's kernels into a cluster YAML for estimate --cluster",
    "step-check": "the step-time model's prediction against a measured step on this device",
}
"""Every command, in the order ``--help`` lists them."""


def overview() -> str:
    """What ``lightning-sp --help`` prints: every command and what it does."""
    name = program()
    width = max(map(len, DESCRIPTIONS))
    lines = [f"usage: {name} <command> [options]", "", "commands:"]
    lines += [f"  {command:<{width}}  {what}" for command, what in DESCRIPTIONS.items()]
    lines += ["", f"{name} <command> --help lists a command's options."]
    return "\n".join(lines)


def _no_such_command(args: list[str]) -> str | None:
    """The one-line error for a command line without a known command, else None (options
    before the command, such as ``--config``, go to LightningCLI as before)."""
    valid = ", ".join(DESCRIPTIONS)
    where = f"({program()} --help describes each)"
    if not args:
        return f"give a command: {valid} {where}"
    if args[0].startswith("-") or args[0] in DESCRIPTIONS:
        return None
    close = difflib.get_close_matches(args[0], list(DESCRIPTIONS), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown command {args[0]!r}{hint}; valid: {valid} {where}"


def main(argv: list[str] | None = None) -> None:
    """Run a command; ``argv`` defaults to the command line."""
    # the config dataclasses document each field in a docstring under it: show those in --help
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    args = sys.argv[1:] if argv is None else argv
    if args[:1] in (["-h"], ["--help"]):
        print(overview())
        return
    unknown = _no_such_command(args)
    if unknown is not None:
        raise ConfigError(unknown)
    if args and args[0] in COMMANDS:
        code = COMMANDS[args[0]](args[1:])
        if code:
            sys.exit(code)
        return
    from lightning_sp.cli.fit import GPTCLI
    from lightning_sp.data import TextDataModule
    from lightning_sp.training.gpt_module import GPTModule

    cli = GPTCLI(GPTModule, TextDataModule, args=argv, save_config_kwargs={"overwrite": True})
    # jsonargparse caches the class parsers, which hold this CLI (its instantiators): let go
    # of the run's objects, so that nothing keeps the process groups alive (see leave)
    cli.trainer = cli.model = cli.datamodule = cli.config_init = None  # type: ignore[assignment]


def _rank() -> int:
    """This process's global rank as the launchers set it (0 before any launch)."""
    for name in ("RANK", "GLOBAL_RANK"):
        if os.environ.get(name):
            return int(os.environ[name])
    local = int(os.environ.get("LOCAL_RANK", 0) or 0)
    node = int(os.environ.get("NODE_RANK", 0) or 0)
    return local + node  # non-zero on every rank but the first, which is all that matters here


def fail(message: str, alone: bool = False) -> None:
    """Print ``message`` once (rank 0); the caller then leaves (:func:`leave`). Other ranks
    wait a moment so that Lightning's launcher, which kills the job when a child exits, lets
    rank 0 print first; rank 0 then waits for its child ranks (killing those still running
    after a grace), so that none outlives it. ``alone``: only this rank has the error
    (:class:`~lightning_sp.runtime.agree.LocalError`): a child rank hands it to rank 0, which
    prints it on finding this rank ended (:func:`lightning_sp.runtime.shutdown.report`), or
    prints it itself where no launcher collects it."""
    shutdown.stopping()  # the children's exits are ours now: the watcher says nothing
    if _rank() == 0:
        print(f"error: {message}", file=sys.stderr)
        shutdown.end_children()
    else:
        if alone and not shutdown.report(message):
            print(f"error: {message}", file=sys.stderr)
        time.sleep(2)


def ended_early() -> int | None:
    """The exit code when a signal or a dead rank ended the run (the reason printed once, by
    rank 0); None otherwise."""
    # a signal (to this process, or agreed by all) comes first: children then end by it
    signalled = shutdown.received() or shutdown.agreed()
    dead = shutdown.find_dead_rank() if _rank() == 0 and not signalled else None
    if dead is not None:
        code, message = dead
        if not shutdown.dead_rank_reported():
            print(f"error: {message}; the other ranks stopped", file=sys.stderr)
        return code
    signum = shutdown.received() or shutdown.agreed()
    if not signum:
        return None
    if _rank() == 0:
        saved = (
            "; the step it ended on was saved (last.ckpt continues the run)"
            if shutdown.agreed()
            else ""
        )
        print(f"error: stopped by {shutdown.signal_name(signum)}{saved}", file=sys.stderr)
    return shutdown.exit_code(signum)


def _exit_status(error: SystemExit) -> int:
    """The status Python exits with for ``error``: its code, 0 for None, else 1 after printing
    the message (``sys.exit("message")``)."""
    if error.code is None or isinstance(error.code, int):
        return error.code or 0
    print(error.code, file=sys.stderr)
    return 1


def run() -> NoReturn:
    """``main()`` with its outcome as an exit code: 0, 2 (bad input, one line), 3 (non-finite
    step), 4 (a checkpoint could not be written, one line), 128 + N for signal N (130 Ctrl-C,
    143 SIGTERM; a SIGTERM during training first saves the step), a dead rank's code (named in
    one line), or 1 with the traceback of an unexpected error. Every way out goes through
    :func:`~lightning_sp.parallel.release.leave`."""
    shutdown.install()
    code = 0
    try:
        main()
    except ConfigError as error:  # a bad config: one line, no traceback
        fail(str(error), alone=isinstance(error, LocalError))
        code = EXIT_CONFIG
    except NonFiniteError as error:
        fail(str(error))
        code = EXIT_NONFINITE
    except CheckpointSaveError as error:  # a full disk, say: every rank has the same line
        fail(str(error))
        code = EXIT_CHECKPOINT
    except BaseException as error:
        early = ended_early()
        if early is None and _rank() != 0:  # a peer's stop broke this rank's step: its signal
            early = shutdown.wait_for_stop(PEER_STOP_SECONDS)  # follows; then exit quietly
        shutdown.end_children()
        if isinstance(error, SystemExit) and (early is None or error.code == early):
            code = _exit_status(error)
        elif early is None:  # not ours: its traceback, as Python would print it
            traceback.print_exc()
            code = 1
        else:
            code = early
    else:
        early = ended_early()
        if early is not None:
            shutdown.end_children()
            code = early
    # after the except clauses, so that no traceback holds the run's objects: the process
    # groups end now, not in the interpreter's finalization, where gloo aborts the process
    leave(code)


if __name__ == "__main__":
    run()
