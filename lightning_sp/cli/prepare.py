"""``lightning-sp prepare``: tokenize the config's corpus once into ``data.prepared_dir`` (the
``fit`` parser: same config file, same ``--data.*`` overrides)."""

from __future__ import annotations

import warnings

from typing_extensions import override

from lightning_sp.cli.fit import GPTCLI, Unseeded
from lightning_sp.data import TextDataModule


class PrepareCLI(Unseeded, GPTCLI):
    """``cli.py prepare``: the ``fit`` parser (same config file, same ``--data.*`` overrides);
    only the data section is built, and its corpus is prepared. No trainer, no model."""

    @override
    def instantiate_classes(self) -> None:
        data = TextDataModule(**self.config["data"].as_dict())
        data.check_model_vocab(self.config["model.config.vocab_size"])
        data.prepare_corpus()


def main(args: list[str]) -> int:
    """Prepare the corpus of the ``fit`` command line ``args``; returns the exit status."""
    from lightning_sp.training.gpt_module import GPTModule

    with warnings.catch_warnings():  # args is sys.argv minus "prepare", as intended
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        PrepareCLI(
            GPTModule, TextDataModule, args=args, run=False, load_from_checkpoint_support=False
        )
    return 0
