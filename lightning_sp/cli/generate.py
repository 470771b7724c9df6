"""``python cli.py generate --config X.yaml --ckpt_path CKPT --prompt "def "``: continue a
prompt with a trained model and print the text.

The config is read by the same LightningCLI parser as ``fit`` (so every ``fit`` override is
accepted); the model is restored from the checkpoint by Lightning's own load path
(``Trainer.predict(ckpt_path=...)`` -> ``MegatronSPStrategy.load_checkpoint``, which reshards
a checkpoint of any layout) into ``--tensor_parallel_size`` processes (default 1: one process,
whatever layout trained it; ``p = 1``, one data-parallel replica) with sequence parallelism
off (one new token cannot be split along the sequence; the weights are the same), and
:meth:`GPTModule.predict_step` samples with a key/value cache. Rank 0 prints the prompt and
its continuation.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
from typing_extensions import override

from lightning_sp.cli.checks import check_generate_layout, check_resume
from lightning_sp.cli.fit import Unseeded
from lightning_sp.cli.parser import OneLineArgumentParser
from lightning_sp.data import TextDataModule
from lightning_sp.data.chat import chat_stop_ids, load_chat_tokenizer
from lightning_sp.errors import ConfigError, positive_int
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.generate import GenerationConfig
from lightning_sp.training.gpt_module import GPTModule
from lightning_sp.training.strategy import MegatronSPStrategy


def _parser() -> argparse.ArgumentParser:
    defaults = GenerationConfig()
    parser = OneLineArgumentParser(
        "generate",
        description="Continue a prompt with a trained checkpoint. Other options (--config, "
        "--model.*, --data.*, --trainer.*) are read as by `fit`.",
    )
    parser.add_argument("--ckpt_path", required=True, help="checkpoint saved by fit")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument(
        "--chat",
        type=_true_or_false,
        default=False,
        help="true: --prompt is a user message, rendered with the chat template "
        "of data.chat_template_dir (add_generation_prompt), answered by the model up to the "
        "template's end of turn (or an EOS id of the directory's generation_config.json)",
    )
    parser.add_argument("--max_new_tokens", type=int, default=defaults.max_new_tokens,
                        help="tokens to generate at most (fewer at end of document)")  # fmt: skip
    parser.add_argument("--temperature", type=float, default=defaults.temperature,
                        help="softmax temperature; 0 is greedy")  # fmt: skip
    parser.add_argument("--top_k", type=int, default=defaults.top_k,
                        help="sample among the k most likely tokens")  # fmt: skip
    parser.add_argument("--tensor_parallel_size", type=int, default=1,
                        help="processes to generate with (t); any checkpoint layout loads "
                        "into it (default 1: one process)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=defaults.seed,
                        help="sampling seed: the same seed gives the same text")  # fmt: skip
    return parser


def _true_or_false(value: str) -> bool:
    if value.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"{value!r} is not true or false")
    return value.lower() == "true"


def chat_prompt(data: Any, message: str) -> str:
    """``message`` as the user turn of the data's chat template, ending where the assistant's
    answer starts (``add_generation_prompt=True``): the text the model continues."""
    directory = getattr(data, "chat_template_dir", None)
    if directory is None:
        raise ConfigError(
            "--chat true needs data.chat_template_dir, the tokenizer directory whose chat "
            "template renders the message (the one the run was fine-tuned with)"
        )
    tokenizer = load_chat_tokenizer(directory, assistant_only_loss=False)
    messages = [{"role": "user", "content": message}]
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def chat_generation(data: Any, generation: GenerationConfig) -> GenerationConfig:
    """``generation`` stopping also at the end of an assistant's turn of the data's chat
    template (:func:`~lightning_sp.data.chat.chat_stop_ids` of ``data.chat_template_dir``)."""
    stops = chat_stop_ids(data.chat_template_dir)
    return dataclasses.replace(generation, stop_token_ids=(*generation.stop_token_ids, *stops))


def main(argv: list[str], cli_class: Any) -> int:
    """Run the subcommand; ``cli_class`` is the LightningCLI class of ``fit`` (for
    ``GPTModule`` and ``TextDataModule``, built with ``run=False`` to read the config).
    Returns the exit status."""
    args, rest = _parser().parse_known_args(argv)
    if not Path(args.ckpt_path).exists():
        raise ConfigError(
            f"ckpt_path={args.ckpt_path!r} does not exist; give a checkpoint saved by fit "
            "(e.g. checkpoints/tiny/last.ckpt)"
        )
    generation = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
    )
    generation.validate()
    t = positive_int("tensor_parallel_size", args.tensor_parallel_size)

    class Reader(Unseeded, cli_class):
        """The config's model and data (with the checkpoint's adapters when the config names
        none); no seed, no Trainer (this command builds its own, after its checks: no banner
        before a one-line error)."""

        adapters_from_checkpoint = args.ckpt_path

        @override
        def instantiate_trainer(self, **kwargs: Any) -> Any:
            return None

    with warnings.catch_warnings():  # args is sys.argv minus the generate options, as intended
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        cli = Reader(GPTModule, TextDataModule, args=rest, run=False, save_config_callback=None)
    module, data = cli.model, cli.datamodule
    module.generation = generation
    # one new token cannot be split along the sequence: the same weights, built without SP
    module.config = dataclasses.replace(module.config, sequence_parallel=False)
    check_generate_layout(module.config, t)  # before any rank starts
    if Path(args.ckpt_path).is_dir():  # the architecture it was trained with (adapters, base)
        check_resume(args.ckpt_path, cli.config.model, module.config)
    prompt = chat_prompt(data, args.prompt) if args.chat else args.prompt
    if args.chat:  # stop at the template's end of turn too, not only at end of document
        module.generation = generation = chat_generation(data, generation)
    data.prompts = [prompt]
    trainer = L.Trainer(
        accelerator=cli.config.trainer.accelerator,
        devices=t,
        precision=cli.config.trainer.precision,
        strategy=MegatronSPStrategy(tensor_parallel_size=t),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    predictions = trainer.predict(module, datamodule=data, ckpt_path=args.ckpt_path)
    if trainer.is_global_zero and predictions:
        result: dict[str, Any] = predictions[0]  # type: ignore[assignment]
        print(result["prompt"] + result["completion"], flush=True)
        prompt_tokens = len(data.codec.encode(prompt))
        if at_context_length(prompt_tokens, len(result["token_ids"]), generation, module.config):
            print(context_notice(module.config.seq_length), file=sys.stderr, flush=True)
    return 0


def at_context_length(
    prompt_tokens: int, new_tokens: int, generation: GenerationConfig, config: GPTConfig
) -> bool:
    """Whether :func:`~lightning_sp.model.generate.generate` stopped because the text filled
    the context (``config.seq_length`` tokens, the last one sampled from a full window), not at
    an end-of-document token or at ``generation.max_new_tokens``."""
    return (
        new_tokens < generation.max_new_tokens
        and prompt_tokens + new_tokens == config.seq_length + 1
    )


def context_notice(seq_length: int) -> str:
    """The one line ``generate`` prints when it stopped at the context length."""
    return (
        f"notice: stopped at the context length (model.config.seq_length={seq_length} tokens), "
        "before an end-of-document token or --max_new_tokens; shorten the prompt for more"
    )
