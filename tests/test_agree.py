"""Errors found after launch are agreed by every rank and printed once
(runtime/agree.py): a ``ConfigError`` raised on one rank only is raised by every rank with
the same message; through ``cli.py`` with 2 ranks, an empty corpus (found by rank 0 alone, in
``prepare_data``) gives one ``error:`` line, no traceback, exit code 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_sp import ConfigError
from lightning_sp.data import TextDataModule
from lightning_sp.runtime.agree import ranks_agree
from lightning_sp.testing.spawn import run_distributed

from cli_runs import CLI, SMALL, TINY, error_lines, run


def _agree_worker(rank: int, world_size: int) -> list[str | None]:
    """Per case: the message this rank raised after the agreement (None: nothing)."""
    outcomes: list[str | None] = []
    for failing in ([1], [0, 1], []):  # rank 1 only; both (rank 0's message wins); none
        try:
            with ranks_agree():
                if rank in failing:
                    raise ConfigError(f"bad input seen by rank {rank}")
            outcomes.append(None)
        except ConfigError as error:
            outcomes.append(str(error))
    return outcomes


@pytest.mark.slow
def test_a_config_error_on_one_rank_is_raised_by_every_rank() -> None:
    ranks = run_distributed(_agree_worker, 2)
    expected = ["bad input seen by rank 1", "bad input seen by rank 0", None]
    assert ranks == [expected, expected], ranks


@pytest.mark.slow
def test_error_after_launch_is_one_line_from_two_ranks(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.py").write_text("")
    args = [CLI, "fit", "--config", TINY, *SMALL, "--data.paths", str(empty),
            "--trainer.default_root_dir", str(tmp_path / "logs")]  # fmt: skip
    result = run(args, tmp_path, timeout=300)  # a bound on a hang, not a speed assertion
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "Connection closed" not in result.stderr, (
        result.stderr[-3000:]
    )
    errors = error_lines(result.stderr)
    assert len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith("error: the corpus is empty: 1 entries"), errors
    assert result.stderr.count("the corpus is empty") == 1, result.stderr[-3000:]


@pytest.mark.parametrize(
    ("files", "kwargs", "message"),
    [
        ({"rows.jsonl": '{"text": "hello"}\n{"body": "no text"}\n'}, {},
         r"^text_field='text': .*rows.jsonl line 2 has no such field; set data.text_field"),
        ({f"d{i}.txt": "ab" for i in range(4)}, {"val_fraction": 0.25},
         r"^seq_length=64 needs at least 65 training tokens per corpus, but .* has 9; add text "
         r"or lower seq_length$"),
        ({"only.txt": "one document"}, {},
         r"^val_fraction=0.02 needs at least 2 documents, the corpus has 1"),
    ],
    ids=["jsonl_row_without_the_field", "corpus_shorter_than_a_sample", "one_document"],
)  # fmt: skip
def test_data_errors_found_after_launch_are_one_line_config_errors(
    tmp_path: Path, files: dict[str, str], kwargs: dict, message: str
) -> None:
    """The data errors that only show once the corpus is read (``prepare_data`` / ``setup``,
    after launch) are one-line ``ConfigError``s: what :func:`ranks_agree` carries to every
    rank and ``cli.py`` prints once (the 2-rank run above shows the path end to end)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, text in files.items():
        (corpus / name).write_text(text)
    data = TextDataModule(paths=str(corpus), seq_length=64, batch_size=2,
                          cache_dir=str(tmp_path / "cache"), **kwargs)  # fmt: skip
    with pytest.raises(ConfigError, match=message) as error:
        data.prepare_data()
        data.setup("fit")
    assert "\n" not in str(error.value)
