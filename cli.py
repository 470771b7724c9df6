"""Command line: ``python cli.py fit --config configs/tiny.yaml``.

Subcommands ``fit``, ``validate``, ``test`` come from Lightning's ``LightningCLI``;
``estimate`` is the activation-memory planner: it takes exactly ``fit``'s arguments
(``python cli.py estimate --config configs/gpt175b.yaml --trainer.num_nodes 16``) plus its own
(``--format json``, ``--plot FILE``, ``--device_memory 80GB``, ``--cluster h100-80gb`` for the
step-time prediction, ``--search true`` to rank layouts; see ``estimate --help``).
``prepare`` tokenizes the config's corpus once into ``data.prepared_dir`` (same arguments
as ``fit``).
``export`` writes a checkpoint as a Hugging Face directory (GPT-2 or Llama, by architecture)
(``python cli.py export --ckpt_path CKPT --output DIR``).
``generate`` continues a prompt with a checkpoint
(``python cli.py generate --config ... --ckpt_path ... --prompt "def "``).
``python cli.py fit --help`` documents every option; ``--print_config`` shows a full config.

A bad input ends the run with one line ``error: ...`` on stderr, printed by rank 0 only, and
exit code 2; a non-finite loss or gradient (strategy ``nonfinite: stop``) with one line and
exit code 3. Checks that need only the config run before any class is built or any process
starts (:func:`lightning_sp.training.validation.check_fit_config`,
:func:`lightning_sp.training.launch_checks.check_before_launch`: the tokenizer fits the
vocabulary, checkpoint directories can be written); a bad input found after launch (an empty
corpus, a JSONL row without the text field) is agreed by every rank and printed once
(:mod:`lightning_sp.training.agree`).
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from typing import Any

import torch.distributed
from jsonargparse import Namespace, set_parsing_settings
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override

import lightning_sp  # noqa: F401  (registers the "megatron_sp" strategy)
from lightning_sp.errors import ConfigError
from lightning_sp.planner.layout import FitLayoutCLI
from lightning_sp.training import shutdown
from lightning_sp.training.checkpoint import CheckpointSaveError
from lightning_sp.training.data import TextDataModule
from lightning_sp.training.guard import NonFiniteError
from lightning_sp.training.launch_checks import check_before_launch
from lightning_sp.training.module import GPTModule
from lightning_sp.training.parse_errors import OneLineErrorParser
from lightning_sp.training.validation import check_fit_config

EXIT_CONFIG, EXIT_NONFINITE, EXIT_CHECKPOINT = 2, 3, 4
PEER_STOP_SECONDS = 10.0
"""How long a child rank whose step failed waits for the launcher's signal before it reports
the failure as its own (:func:`lightning_sp.training.shutdown.wait_for_stop`)."""
LIGHTNING_MODEL_CHECKPOINT = (
    "lightning.pytorch.callbacks.ModelCheckpoint",
    "lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint",
    "pytorch_lightning.callbacks.ModelCheckpoint",
)
"""Lightning's ModelCheckpoint, as a config names it; the CLI builds
:class:`lightning_sp.ModelCheckpoint` (which also saves the step that ends the run) instead."""


def _default_loggers(root: str) -> list[Namespace]:
    """CSV logs under ``root``/csv, and TensorBoard logs under ``root``/tensorboard when
    installed (``root``: ``trainer.default_root_dir``, where any Lightning run logs)."""

    def logger(name: str, folder: str) -> Namespace:
        path = f"lightning.pytorch.loggers.{name}"
        return Namespace(class_path=path, init_args=Namespace(save_dir=root, name=folder))

    loggers = [logger("CSVLogger", "csv")]
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return loggers
    return [*loggers, logger("TensorBoardLogger", "tensorboard")]


class GPTCLI(LightningCLI):
    """LightningCLI for ``GPTModule`` + ``TextDataModule``, sequence length shared by both;
    the parsed config is checked before any class is instantiated."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("parser_class", OneLineErrorParser)  # one line, a close match
        super().__init__(*args, **kwargs)

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("model.config.seq_length", "data.seq_length")

    @override
    def before_instantiate_classes(self) -> None:
        """Check the fit config before launch (one-line errors); log to CSV (and TensorBoard)
        under ``trainer.default_root_dir`` unless the config names loggers (or ``false``); build
        :class:`lightning_sp.ModelCheckpoint` where the config names Lightning's; use
        :class:`lightning_sp.ProgressBar` (short names and units) unless the config disables
        the bar or names a progress bar of its own."""
        if self.subcommand is not None:  # fit / validate / test (not estimate, prepare)
            check_fit_config(self.config[self.subcommand])
            check_before_launch(self.config[self.subcommand])  # tokenizer, writable dirs
        config = self.config.get(str(self.subcommand), self.config)
        trainer = config.get("trainer")
        if trainer is None:
            return
        if trainer.get("logger") in (None, True):  # Lightning's default logger: ours
            trainer["logger"] = _default_loggers(trainer.get("default_root_dir") or os.getcwd())
        callbacks = list(trainer.get("callbacks") or [])
        for callback in callbacks:  # last.ckpt that always continues the run
            if getattr(callback, "class_path", None) in LIGHTNING_MODEL_CHECKPOINT:
                callback.class_path = "lightning_sp.ModelCheckpoint"
        if trainer.get("enable_progress_bar") is False:
            return
        if any("ProgressBar" in str(getattr(c, "class_path", "")) for c in callbacks):
            return
        bar = Namespace(class_path="lightning_sp.ProgressBar", init_args=Namespace())
        trainer["callbacks"] = [*callbacks, bar]


class EstimateCLI(FitLayoutCLI, GPTCLI):
    """``estimate``: ``fit``'s parser plus the planner's options; builds no Trainer."""


def read_estimate_args(args: list[str]) -> EstimateCLI:
    """Parse an ``estimate`` command line (everything after ``estimate``)."""
    return EstimateCLI(
        GPTModule, TextDataModule, args=args, run=False, load_from_checkpoint_support=False
    )


class PrepareCLI(GPTCLI):
    """``cli.py prepare``: the ``fit`` parser (same config file, same ``--data.*`` overrides);
    only the data section is built, and its corpus is prepared. No trainer, no model."""

    @override
    def instantiate_classes(self) -> None:
        data = TextDataModule(**self.config["data"].as_dict())
        data.check_model_vocab(self.config["model.config.vocab_size"])
        data.prepare_corpus()


def main(argv: list[str] | None = None) -> None:
    """Run a subcommand; ``argv`` defaults to the command line."""
    # the config dataclasses document each field in a docstring under it: show those in --help
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "estimate":
        from lightning_sp.planner.report import main as estimate

        sys.exit(estimate(read_estimate_args, args[1:]))
    if args and args[0] == "prepare":
        with warnings.catch_warnings():  # args is sys.argv minus "prepare", as intended
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
            PrepareCLI(
                GPTModule,
                TextDataModule,
                args=args[1:],
                run=False,
                load_from_checkpoint_support=False,
            )
        return
    if args and args[0] == "export":
        from lightning_sp.training.hf_export import main as export

        sys.exit(export(args[1:]))
    if args and args[0] == "generate":
        from lightning_sp.training.generate_command import main as generate

        sys.exit(generate(args[1:], GPTCLI))
    GPTCLI(GPTModule, TextDataModule, args=argv, save_config_kwargs={"overwrite": True})


def _rank() -> int:
    """This process's global rank as the launchers set it (0 before any launch)."""
    for name in ("RANK", "GLOBAL_RANK"):
        if os.environ.get(name):
            return int(os.environ[name])
    local = int(os.environ.get("LOCAL_RANK", 0) or 0)
    node = int(os.environ.get("NODE_RANK", 0) or 0)
    return local + node  # non-zero on every rank but the first, which is all that matters here


def fail(message: str, code: int) -> None:
    """Print ``message`` once (rank 0) and exit with ``code``. Other ranks wait a moment so that
    Lightning's launcher, which kills the job when a child exits, lets rank 0 print first; rank
    0 then waits for its child ranks (killing those still running after a grace), so that none
    outlives it.

    With a process group still alive the exit skips the interpreter's teardown (``os._exit``
    after flushing): there, the group's C++ threads can abort the process ("terminate called
    without an active exception", SIGABRT) and turn exit code 2 into -6 (seen once in the full
    suite's two-rank empty-corpus run)."""
    shutdown.stopping()  # the children's exits are ours now: the watcher says nothing
    if _rank() == 0:
        print(f"error: {message}", file=sys.stderr)
        shutdown.end_children()
    else:
        time.sleep(2)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


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


def run() -> None:
    """``main()`` with its outcome as an exit code: 0, 2 (bad input, one line), 3 (non-finite
    step), 4 (a checkpoint could not be written, one line), 128 + N for signal N (130 Ctrl-C,
    143 SIGTERM; a SIGTERM during training first saves the step), or a dead rank's code
    (named in one line)."""
    shutdown.install()
    try:
        main()
    except ConfigError as error:  # a bad config: one line, no traceback
        fail(str(error), EXIT_CONFIG)
    except NonFiniteError as error:
        fail(str(error), EXIT_NONFINITE)
    except CheckpointSaveError as error:  # a full disk, say: every rank has the same line
        fail(str(error), EXIT_CHECKPOINT)
    except BaseException as error:
        code = ended_early()
        if code is None and _rank() != 0:  # a peer's stop broke this rank's step: its signal
            code = shutdown.wait_for_stop(PEER_STOP_SECONDS)  # follows; then exit quietly
        shutdown.end_children()
        if code is None or (isinstance(error, SystemExit) and error.code == code):
            raise
        sys.exit(code)
    code = ended_early()
    if code is not None:
        shutdown.end_children()
        sys.exit(code)


if __name__ == "__main__":
    run()
