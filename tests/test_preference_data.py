"""Preference data (lightning_sp.data.preference): rows tokenized as TRL 1.16's ``DPOTrainer``
tokenizes them (its own ``_prepare_dataset`` the reference: text, conversational with a
prompt, implicit prompt), each pair two documents of one packed sample with the loss on the
answers, read back through ``TextDataModule(preference=True)``; truncation counted; each bad
input refused in one line before anything is written."""

from __future__ import annotations

import itertools
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_sp.data import TextDataModule
from lightning_sp.data.preference import fit_pair, prepare_preference, render_pair
from lightning_sp.errors import ConfigError

from corpora import chat_tokenizer, jsonl

S = 160
WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight"]


def _rows() -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for i in range(12):
        a, b = WORDS[i % 8], WORDS[(i * 3) % 8]
        question = f"what is {a} plus {b} ?"
        good, bad = f"{a} plus {b} is {WORDS[(i + 1) % 8]} .", f"it is {WORDS[(i + 5) % 8]}"
        if i % 3 == 0:  # text
            rows.append({"prompt": question, "chosen": " " + good, "rejected": " " + bad})
        elif i % 3 == 1:  # conversational, explicit prompt
            rows.append({"prompt": [{"role": "user", "content": question}],
                         "chosen": [{"role": "assistant", "content": good}],
                         "rejected": [{"role": "assistant", "content": bad}]})  # fmt: skip
        else:  # conversational, implicit prompt (a system turn too)
            head = [{"role": "system", "content": "you add ."},
                    {"role": "user", "content": question}]  # fmt: skip
            rows.append({"chosen": [*head, {"role": "assistant", "content": good}],
                         "rejected": [*head, {"role": "assistant", "content": bad}]})  # fmt: skip
    return rows


def _trl_sequences(tokenizer_dir: Path, rows: list[dict[str, Any]]) -> list[tuple]:
    """TRL's ``DPOTrainer._prepare_dataset`` on each row: (prompt + chosen, prompt +
    rejected, prompt length)."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    host = types.SimpleNamespace(_tokenizer=tokenizer)
    args = DPOConfig(output_dir=str(tokenizer_dir / "trl"), report_to=[], use_cpu=True)
    out = []
    for row in rows:  # one at a time: the formats differ from row to row
        data = DPOTrainer._prepare_dataset(host, Dataset.from_list([row]), tokenizer, args, "x")  # type: ignore[arg-type]
        x = data[0]
        prompt = list(x["prompt_ids"])
        out.append((prompt + list(x["chosen_ids"]), prompt + list(x["rejected_ids"]), len(prompt)))
    return out


def test_pairs_tokenized_as_trl_and_packed_as_documents(tmp_path: Path) -> None:
    pytest.importorskip("trl")
    tokenizer_dir = chat_tokenizer(tmp_path)
    rows = _rows()
    source = jsonl(tmp_path / "pairs.jsonl", rows)
    out = tmp_path / "prepared"
    data = TextDataModule(paths=str(source), chat_template_dir=str(tokenizer_dir),
                          prepared_dir=str(out), seq_length=S, batch_size=1,
                          val_fraction=0.2, preference=True)  # fmt: skip
    data.prepare_corpus(log=lambda _: None)
    data.setup("fit")
    assert data.train_dataset is not None and data.val_dataset is not None
    samples = [data.train_dataset[i] for i in range(len(data.train_dataset))]
    samples += [data.val_dataset[i] for i in range(len(data.val_dataset))]
    expected = {(tuple(c), tuple(r)): n for c, r, n in _trl_sequences(tokenizer_dir, rows)}
    found = 0
    for sample in samples:
        tokens = torch.cat([sample["input_ids"], sample["labels"][-1:]])
        docs = sample["documents"]
        edge = torch.tensor([True])
        starts = torch.cat([edge, docs[1:] != docs[:-1], edge]).nonzero().flatten().tolist()
        documents = [tokens[a:b].tolist() for a, b in itertools.pairwise(starts)]
        slots = sample["sequences"]
        for j in range(0, len(documents) - 1, 2):
            key = (tuple(documents[j]), tuple(documents[j + 1]))
            if key not in expected:
                continue
            prompt = expected.pop(key)
            for k in (j, j + 1):  # the labels of each answer token carry slot k, no others
                a = starts[k]
                want = torch.zeros_like(slots, dtype=torch.bool)
                want[a + prompt - 1 : a + len(documents[k]) - 1] = True
                assert torch.equal(slots == k, want), (
                    f"sequence {k}: answer slots differ from TRL's"
                )
            found += 1
    assert not expected and found == len(rows), f"{len(expected)} pairs not found as TRL's"


def _refused(tmp_path: Path, rows: list, match: str, **kwargs: Any) -> None:
    tokenizer_dir = chat_tokenizer(tmp_path)
    source = jsonl(tmp_path / "bad.jsonl", rows)
    out = tmp_path / "prepared"
    with pytest.raises(ConfigError) as error:
        prepare_preference([str(source)], str(tokenizer_dir), str(out), kwargs.pop("s", S),
                           log=lambda _: None, **kwargs)  # fmt: skip
    line = str(error.value)
    assert match in line and "\n" not in line, line
    assert not out.exists(), "something was written before the error"


GOOD = {"prompt": "what is one plus one ?", "chosen": " two", "rejected": " three"}


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"prompt": "x", "chosen": " y"}, "row 2: no 'rejected'"),
        ({"prompt": "x", "rejected": " y"}, "row 2: no 'chosen'"),
        ({"prompt": "x", "chosen": "", "rejected": " y"}, "row 2: 'chosen' is empty"),
        ({"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
          "rejected": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]},
         "row 2: the prompts of 'chosen' and 'rejected' differ"),
    ],
)  # fmt: skip
def test_bad_rows_fail_in_one_line(tmp_path: Path, bad: dict, match: str) -> None:
    _refused(tmp_path, [GOOD, bad], match)


def test_long_pairs_truncated_with_one_notice_or_refused(tmp_path: Path) -> None:
    long = {"prompt": "what is one plus one ?", "chosen": " two" * 40, "rejected": " three" * 40}
    _refused(tmp_path, [GOOD, long], "row 2: the pair is", s=80, overflow="refuse")
    tokenizer_dir = chat_tokenizer(tmp_path / "t")
    source = jsonl(tmp_path / "long.jsonl", [GOOD, long, GOOD])
    notices: list[str] = []
    meta = prepare_preference([str(source)], str(tokenizer_dir), str(tmp_path / "p"), 80,
                              log=notices.append)  # fmt: skip
    assert meta["preference"]["truncated"] == 1, meta["preference"]
    assert sum("were truncated" in n for n in notices) == 1, notices


def test_fit_pair_keeps_each_start_and_cuts_its_mask_alike() -> None:
    """A pair longer than ``width`` tokens, cut by hand: each sequence keeps its start (the
    prompt), the longer is cut first, neither below half unless the other is shorter, and
    each answer mask is cut to its own sequence's length (a mask of another length shifts
    every flag after it in the packed bin)."""
    width = 11  # half = 5

    def seq(first: int, n: int) -> tuple[list[int], list[int]]:
        return list(range(first, first + n)), [0, 0] + [1] * (n - 2)

    cases = [  # (chosen length, rejected length) -> kept lengths
        ((4, 5), (4, 5)),  # fits: as is
        ((3, 10), (3, 8)),  # chosen under half: rejected takes the rest
        ((10, 4), (7, 4)),  # rejected under the other half: chosen takes the rest
        ((9, 9), (5, 6)),  # both long: half each, the odd token to rejected
    ]
    for (n_c, n_r), (k_c, k_r) in cases:
        got = fit_pair((seq(100, n_c), seq(200, n_r)), width)
        want = (seq(100, k_c), seq(200, k_r))
        assert got == want, (
            f"fit_pair of chosen {n_c} + rejected {n_r} tokens into {width} must keep each "
            f"sequence's start and cut its mask to its own length: got {got}, by hand {want}"
        )


def test_answer_starts_where_either_answer_leaves_the_prompt(tmp_path: Path) -> None:
    """TRL's rule: the prompt is the shortest common prefix of the tokenized prompt with each
    tokenized prompt + answer. Here the chosen answer merges with the prompt's last word
    ("the quick bro" + "wn fox": "brown" is one token), the rejected does not ("bro" stays
    "br" "o"): both answers start after "quick", the tokens written out by hand."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(chat_tokenizer(tmp_path)), local_files_only=True)
    row = {"prompt": "the quick bro", "chosen": "wn fox", "rejected": " dog"}
    chosen, rejected = render_pair(tokenizer, row, "row 1")
    eos = "<|endoftext|>"
    want = {
        "chosen": (["the", "quick", "brown", "fox", eos], [0, 0, 1, 1, 1]),
        "rejected": (["the", "quick", "br", "o", "dog", eos], [0, 0, 1, 1, 1, 1]),
    }
    for name, (ids, mask) in (("chosen", chosen), ("rejected", rejected)):
        tokens = tokenizer.convert_ids_to_tokens(ids)
        assert (tokens, mask) == want[name], (
            f"{name}: the answer must start at the shortest common prefix of the prompt with "
            f"either sequence: tokens {tokens} with answer mask {mask}, by hand {want[name]}"
        )


def test_a_pair_cut_to_an_answerless_sequence_is_refused(tmp_path: Path) -> None:
    """A pair truncated so that one of its sequences keeps no answer token (its prompt fills
    its half of the bin) is refused in one line naming the row, also when the other keeps
    one: DPO compares the two answers' log-probabilities, and an empty one is no answer. Here
    the prompt is 17 tokens, ``seq_length + 1 = 35``: chosen keeps 17 tokens (the prompt
    only), rejected 18 (one answer token)."""
    from transformers import AutoTokenizer

    tokenizer_dir = chat_tokenizer(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    assert len(hf(GOOD["prompt"])["input_ids"]) == 17, "the prompt is not 17 tokens"
    long = {"prompt": GOOD["prompt"], "chosen": " two" * 10, "rejected": " three" * 10}
    source = jsonl(tmp_path / "long.jsonl", [long])
    try:
        prepare_preference([str(source)], str(tokenizer_dir), str(tmp_path / "p"), 34,
                           val_fraction=0, log=lambda _: None)  # fmt: skip
        line = None
    except ConfigError as error:
        line = str(error)
    assert line is not None, (
        "row 1, truncated to a chosen sequence of its prompt only (no answer token), was "
        "prepared without a word"
    )
    assert line.startswith("row 1: the prompt fills the pair's half", len(str(source)) + 1), line
    assert "\n" not in line, line
    assert not (tmp_path / "p").exists(), "something was written before the error"
