"""Mistakes found before launch, in one line (in-process, no Trainer): the tokenizer larger
than ``model.config.vocab_size`` and a checkpoint directory that cannot be written
(cli/checks.py, run by ``cli.py`` before any rank starts), and an unknown config
key with a close match instead of a usage dump (cli/parser.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_sp import ConfigError
from lightning_sp.cli import main as cli
from lightning_sp.errors import check_writable

from cli_runs import TINY


def _main_error(args: list[str]) -> str:
    """``cli.main(args)``'s ConfigError message (what ``cli.run`` prints as one line)."""
    with pytest.raises(ConfigError) as error:
        cli.main(args)
    return str(error.value)


def test_tokenizer_larger_than_the_vocabulary_fails_before_launch(tmp_path: Path) -> None:
    message = _main_error(["fit", "--config", TINY, "--model.config.vocab_size", "200",
                           "--trainer.default_root_dir", str(tmp_path)])  # fmt: skip
    assert message == (
        "model.config.vocab_size=200 is smaller than the tokenizer's vocabulary of 257 tokens; "
        "set model.config.vocab_size >= 257 or use a smaller tokenizer"
    )


def test_checkpoint_directory_that_cannot_be_written_fails_before_launch(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    config = tmp_path / "config.yaml"
    config.write_text(Path(TINY).read_text().replace("checkpoints/tiny", str(blocker / "ckpt")))
    message = _main_error(["fit", "--config", str(config)])
    assert message == (
        f"trainer.callbacks[0].init_args.dirpath={str(blocker / 'ckpt')!r} cannot be written: "
        f"{str(blocker)!r} is a file, not a directory; give a directory path"
    )
    check_writable("dirpath", str(tmp_path / "new" / "deeper"))  # creatable: fine
    assert not (tmp_path / "new").exists(), "the check created the directory"


@pytest.mark.parametrize(
    ("where", "expected"),
    [("yaml", "Subcommand 'fit' does not accept option 'model.config.hidden_sise'"),
     ("command line", "unrecognized arguments: --model.config.hidden_sise 64")],
)  # fmt: skip
def test_unknown_key_is_one_line_with_a_close_match(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str, expected: str
) -> None:
    typo = tmp_path / "typo.yaml"
    typo.write_text("model:\n  config:\n    hidden_sise: 64\n")
    args = ["--config", str(typo)] if where == "yaml" else ["--model.config.hidden_sise", "64"]
    with pytest.raises(SystemExit) as exited:
        cli.main(["fit", "--config", TINY, *args])
    assert exited.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    # the program's name is sys.argv[0]'s: cli.py when run, pytest's here
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"error: {expected}; did you mean 'model.config.hidden_size'? ("), (
        lines
    )
    assert lines[0].endswith(" fit --help lists every option)"), lines
