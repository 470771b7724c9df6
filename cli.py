"""Command line: ``python cli.py fit --config configs/tiny.yaml``.

Subcommands ``fit``, ``validate``, ``test`` come from Lightning's ``LightningCLI``;
``estimate`` is the activation-memory planner (``python cli.py estimate --config ...``).
``python cli.py fit --help`` documents every option; ``--print_config`` shows a full config.
"""

from __future__ import annotations

import sys

from lightning.pytorch.cli import LightningCLI
from typing_extensions import override

import lightning_sp  # noqa: F401  (registers the "megatron_sp" strategy)
from lightning_sp.data import TextDataModule
from lightning_sp.module import GPTModule


def _default_loggers() -> list[dict]:
    loggers = [{"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "logs"}}]
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return loggers
    tb = {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": "logs"}}
    return [*loggers, tb]


class GPTCLI(LightningCLI):
    """LightningCLI for ``GPTModule`` + ``TextDataModule``, sequence length shared by both."""

    @override
    def add_arguments_to_parser(self, parser) -> None:  # type: ignore[no-untyped-def]
        parser.link_arguments("model.config.seq_length", "data.seq_length")
        parser.set_defaults({"trainer.logger": _default_loggers()})


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "estimate":
        from lightning_sp.planner import main as estimate

        sys.exit(estimate(argv[1:]))
    GPTCLI(GPTModule, TextDataModule, args=argv, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
