"""Chat SFT data: conversations rendered by a local Hugging Face chat template, the assistant
mask equal to transformers' ``apply_chat_template(return_assistant_tokens_mask=True)``,
first-fit packing that holds every conversation exactly once, read back through the prepared
format; and each bad input refused in one line before anything is written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from lightning_sp.data import TextDataModule
from lightning_sp.data.chat import (
    ASSISTANT,
    START,
    first_fit,
    flags_to_sample,
    loss_tokens,
    prepare_chat,
)
from lightning_sp.data.packing import split_members
from lightning_sp.errors import ConfigError

from corpora import CHAT_TEMPLATE, chat_tokenizer, conversations, jsonl

S = 48


def _samples(data: TextDataModule) -> list[dict[str, torch.Tensor]]:
    data.setup("fit")
    assert data.train_dataset is not None and data.val_dataset is not None
    return [data.train_dataset[i] for i in range(len(data.train_dataset))] + [
        data.val_dataset[i] for i in range(len(data.val_dataset))
    ]


def _rendered(hf: object, row: dict) -> dict:
    """transformers' rendering of one corpus row (``messages``, or prompt and completion),
    with its assistant-token mask: the reference the prepared masks are checked against."""
    messages = row.get("messages") or [
        {"role": "user", "content": row["prompt"]},
        {"role": "assistant", "content": row["completion"]},
    ]
    return hf.apply_chat_template(  # type: ignore[attr-defined]
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )


def test_first_fit_places_every_item_once() -> None:
    lengths = [5, 9, 3, 7, 1, 10, 2]
    bins = first_fit(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert bins == [[0, 2, 4], [1], [3, 6], [5]]  # each into the first bin with room


def test_first_fit_fills_a_bin_exactly() -> None:
    """Issue 40: first-fit with ``<`` for ``<=`` went unnoticed (no test filled a bin
    exactly): an item whose length equals a bin's room goes into that bin."""
    bins = first_fit([6, 4, 10, 3, 7], 10)
    assert bins == [[0, 1], [2], [3, 4]], (
        f"first_fit([6, 4, 10, 3, 7], 10) = {bins}: an item that fills a bin's room exactly "
        "was put in a new bin"
    )


def test_assistant_mask_equals_transformers_and_packing_is_exact(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer_dir = chat_tokenizer(tmp_path)
    rows = conversations(14)
    source = jsonl(tmp_path / "chat.jsonl", rows)
    out = tmp_path / "prepared"
    meta = prepare_chat([str(source)], str(tokenizer_dir), str(out), S, log=lambda _: None)
    assert meta["chat"]["truncated"] == 0 and meta["chat"]["conversations"] == 14
    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    expected = {}
    for row in rows:
        rendered = _rendered(hf, row)
        assert any(rendered["assistant_masks"]) and not all(rendered["assistant_masks"])
        expected.setdefault(tuple(rendered["input_ids"]), []).append(rendered["assistant_masks"])
    data = TextDataModule(
        prepared_dir=str(out), tokenizer=str(tokenizer_dir / "tokenizer.json"), seq_length=S,
        batch_size=1,
    )  # fmt: skip
    seen: list[tuple[int, ...]] = []
    for sample in _samples(data):
        assert set(sample) == {"input_ids", "labels", "loss_mask", "documents", "positions"}
        row = torch.cat([sample["input_ids"], sample["labels"][-1:]])  # the s + 1 tokens
        documents = torch.cat([sample["documents"], sample["documents"][-1:]])
        for doc in documents.unique():
            where = (documents == doc).nonzero().squeeze(1)
            ids = tuple(row[where].tolist())
            if ids not in expected:  # the padding document: end-of-document tokens, no loss
                assert set(ids) == {hf.eos_token_id}, (
                    f"a document of tokens {ids} is neither a conversation nor the padding "
                    "(the padding not a document of its own?)"
                )
                assert not sample["loss_mask"][where[where < S]].any()
                continue
            seen.append(ids)
            mask = expected[ids][0]
            # label j is token j + 1: it counts where token j + 1 is an assistant token of
            # the same conversation
            inside = where[:-1]
            assert sample["loss_mask"][inside].tolist() == [bool(m) for m in mask[1:]], ids
            assert (
                sample["positions"][where[where < S]].tolist()
                == list(range(len(where)))[: len(where[where < S])]
            )
            if where[-1] < S:  # the conversation's last token predicts another document
                assert not sample["loss_mask"][where[-1]]
    assert sorted(seen) == sorted(tuple(k) for k, v in expected.items() for _ in v)


def _refused(tmp_path: Path, match: str, rows: list | None = None, **kwargs) -> None:
    tokenizer_dir = kwargs.pop("tokenizer_dir", None) or chat_tokenizer(tmp_path / "tok")
    source = jsonl(tmp_path / "bad.jsonl", rows if rows is not None else conversations(4))
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=match) as error:
        prepare_chat([str(source)], str(tokenizer_dir), str(out), S, log=lambda _: None, **kwargs)
    assert "\n" not in str(error.value), str(error.value)
    assert not out.exists()


def test_bad_input_is_one_line_before_any_work(tmp_path: Path) -> None:
    rows = conversations(3)
    _refused(tmp_path, r"bad.jsonl row 2: a row needs 'messages'", [rows[0], {"text": "x"}])
    bad_role = {
        "messages": [{"role": "tool", "content": "a"}, {"role": "assistant", "content": "b"}]
    }
    _refused(
        tmp_path, r"row 1: the chat template rejected the conversation \(roles \['tool'", [bad_role]
    )
    _refused(tmp_path, r"'messages' must be a non-empty list", [{"messages": "hi"}])
    no_template = chat_tokenizer(tmp_path / "plain", template=None)
    _refused(tmp_path, "has no chat template", tokenizer_dir=no_template)
    unmarked = chat_tokenizer(
        tmp_path / "unmarked",
        template=CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", ""),
    )
    _refused(
        tmp_path,
        r"no \{% generation %\} markers.*assistant_only_loss=false",
        tokenizer_dir=unmarked,
    )
    long = {"prompt": " ".join(["fox"] * 80), "completion": "dog"}
    _refused(tmp_path, r"row 1: the conversation is \d+ tokens, longer than seq_length \+ 1 = 49",
             [long, *rows], overflow="refuse")  # fmt: skip
    _refused(tmp_path, "overflow='drop' is invalid", overflow="drop")
    latin1 = tmp_path / "latin1.jsonl"  # issue 40: a 32-line traceback before
    latin1.write_bytes(b'{"prompt": "a", "completion": "b"}\n{"prompt": "caf\xe9", '
                       b'"completion": "b"}\n')  # fmt: skip
    with pytest.raises(ConfigError, match=rf"^{latin1}:2: not UTF-8 text \(byte 0xe9: invalid "
                       r"continuation byte\); save the file as UTF-8$"):  # fmt: skip
        prepare_chat([str(latin1)], str(chat_tokenizer(tmp_path / "tok")), str(tmp_path / "o"),
                     S, log=lambda _: None)  # fmt: skip


def test_data_module_and_generate_refuse_bad_chat_settings(tmp_path: Path) -> None:
    from lightning_sp.cli.generate import chat_prompt

    tokenizer_dir = chat_tokenizer(tmp_path)
    rows = jsonl(tmp_path / "chat.jsonl", conversations(4))
    cases = [
        (dict(chat_template_dir=str(tmp_path)), "is not a Hugging Face tokenizer directory"),
        (dict(chat_template_dir=str(tokenizer_dir)), "needs paths: the chat rows"),
        (dict(chat_template_dir=str(tokenizer_dir), paths=str(rows), overflow="drop"),
         "overflow='drop' is invalid"),
    ]  # fmt: skip
    for kwargs, match in cases:
        with pytest.raises(ConfigError, match=match) as error:
            TextDataModule(prepared_dir=str(tmp_path / "p"), seq_length=S, **kwargs)
        assert "\n" not in str(error.value)
    plain = TextDataModule(paths=str(rows), seq_length=S)
    with pytest.raises(ConfigError, match=r"--chat true needs data\.chat_template_dir"):
        chat_prompt(plain, "hi")
    chat = TextDataModule(
        paths=str(rows), chat_template_dir=str(tokenizer_dir), prepared_dir=str(tmp_path / "p"),
        seq_length=S,
    )  # fmt: skip
    assert chat_prompt(chat, "the fox") == "<|user|> the fox <|end|> <|assistant|> "


def test_parquet_rows_and_training_on_every_token(tmp_path: Path) -> None:
    """Parquet ``prompt`` / ``completion`` rows; ``assistant_only_loss=False`` counts every
    label inside a conversation (none across conversations or in the padding)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [r for r in conversations(9) if "prompt" in r]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chat.parquet")
    tokenizer_dir = chat_tokenizer(tmp_path)
    source, out = str(tmp_path / "chat.parquet"), str(tmp_path / "p")
    meta = prepare_chat([source], str(tokenizer_dir), out, S, assistant_only_loss=False,
                        val_fraction=0, log=lambda _: None)  # fmt: skip
    assert meta["chat"]["conversations"] == len(rows) == 3
    data = TextDataModule(prepared_dir=str(tmp_path / "p"), seq_length=S, batch_size=1,
                          tokenizer=str(tokenizer_dir / "tokenizer.json"))  # fmt: skip
    data.setup("fit")
    assert data.train_dataset is not None
    sample = data.train_dataset[0]
    same = sample["documents"][1:] == sample["documents"][:-1]
    padding = sample["input_ids"] == data.eos_token_id
    assert torch.equal(sample["loss_mask"][:-1], same & ~padding[1:])


def test_generate_chat_stops_at_the_templates_end_of_turn(tmp_path: Path) -> None:
    """``generate --chat true`` stops at the chat template's end of turn (``<|end|>`` here),
    not only at the end-of-document token: the ids come from the tokenizer directory (EOS,
    the template's end-of-turn marker, and ``generation_config.json``'s ``eos_token_id``), and
    a model whose most likely answer starts with ``<|end|>`` answers nothing, where without
    the template's stop ids it would go on past it."""
    import json

    from transformers import AutoTokenizer

    from lightning_sp import GPT, ParallelState
    from lightning_sp.cli.generate import chat_generation
    from lightning_sp.data.chat import chat_stop_ids
    from lightning_sp.model.generate import GenerationConfig, generate

    from models import tiny_config

    tokenizer_dir = chat_tokenizer(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    end = hf.convert_tokens_to_ids("<|end|>")
    assert chat_stop_ids(str(tokenizer_dir)) == (hf.eos_token_id, end)
    (tokenizer_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    assert chat_stop_ids(str(tokenizer_dir)) == (5, 6, hf.eos_token_id, end)
    rows = jsonl(tmp_path / "chat.jsonl", conversations(4))
    data = TextDataModule(
        paths=str(rows), chat_template_dir=str(tokenizer_dir), prepared_dir=str(tmp_path / "p"),
        seq_length=S,
    )  # fmt: skip
    plain = GenerationConfig(max_new_tokens=4, temperature=0.0)
    chat = chat_generation(data, plain)
    assert chat.stop_token_ids == (5, 6, hf.eos_token_id, end)

    model = GPT(tiny_config(vocab_size=len(hf), seq_length=S), ParallelState.single())
    prompt = hf("<|user|> the fox <|end|> <|assistant|> ")["input_ids"]
    first = generate(model, prompt, plain)[0]
    with torch.no_grad():  # <|end|> scores twice what the first answer token scored
        model.word_embeddings.weight[end] = 2 * model.word_embeddings.weight[first]
    answer = generate(model, prompt, plain, eos_id=hf.eos_token_id)
    assert answer[0] == end and len(answer) == plain.max_new_tokens  # went on past it
    assert generate(model, prompt, chat, eos_id=hf.eos_token_id) == []


def test_conversations_without_an_answer_are_dropped_and_a_corpus_of_them_refused(
    tmp_path: Path,
) -> None:
    """Issue 40: rows of user turns only were prepared ('prepared 200 conversations') and
    trained at loss 0. A conversation with no loss token (no assistant turn, or one that
    ``overflow: truncate`` cut off whole) trains nothing: it is dropped with one notice, and a
    corpus of nothing else is refused in one line; every packed sample left holds a loss
    token."""
    users = [{"messages": [{"role": "user", "content": f"the fox {i}"}]} for i in range(6)]
    long = {"prompt": " ".join(["fox"] * 80), "completion": "dog"}  # answer past s + 1
    tokenizer_dir = chat_tokenizer(tmp_path / "tok")
    rows = conversations(8)
    source = jsonl(tmp_path / "mixed.jsonl", [*rows[:4], users[0], long, *rows[4:], users[1]])
    notices: list[str] = []
    out = tmp_path / "mixed"
    meta = prepare_chat([str(source)], str(tokenizer_dir), str(out), S, log=notices.append)
    assert meta["chat"]["conversations"] == 8, (
        f"{meta['chat']['conversations']} of 11 conversations packed; 3 have no answer token "
        "(2 as written, 1 cut off by truncation): they were not dropped"
    )
    assert meta["chat"]["dropped_without_answer"] == 3, meta["chat"]
    assert any(
        "dropped 3 of 11 conversations without an answer token to train on (2 as written, 1 "
        "cut off by truncation" in n
        for n in notices
    ), notices
    data = TextDataModule(prepared_dir=str(out), seq_length=S, batch_size=1,
                          tokenizer=str(tokenizer_dir / "tokenizer.json"))  # fmt: skip
    for i, sample in enumerate(_samples(data)):
        assert sample["loss_mask"].any(), f"packed sample {i} has no loss token"
    _refused(tmp_path, r"bad.jsonl: none of its 6 conversation\(s\) has an assistant token to "
             r"train on, so a run would train on nothing", users)  # fmt: skip
    _refused(tmp_path, r"none of its 1 conversation\(s\) has an assistant token to train on "
             r"\(1 lost every answer to truncation at seq_length \+ 1 = 49\)",
             [long], val_fraction=0)  # fmt: skip


def test_a_step_with_no_loss_token_is_refused_before_the_optimizer(tmp_path: Path) -> None:
    """Issue 40: a step whose global batch has no counted label (a chat corpus prepared
    before answerless conversations were dropped: here its assistant bits cleared) ran at loss
    0 while AdamW's weight decay still moved the weights. It is refused in one line before the
    optimizer steps: the weights are the initial ones."""
    import lightning as L
    import numpy as np

    from lightning_sp import GPTModule, OptimizerConfig
    from lightning_sp.data.chat import ASSISTANT, FLAGS_FILE

    from models import tiny_config

    tokenizer_dir = chat_tokenizer(tmp_path)
    out = tmp_path / "p"
    source = jsonl(tmp_path / "chat.jsonl", conversations(8))
    prepare_chat([str(source)], str(tokenizer_dir), str(out), S, val_fraction=0,
                 log=lambda _: None)  # fmt: skip
    flags = np.fromfile(out / "train" / FLAGS_FILE, dtype=np.uint8)
    (flags & ~np.uint8(ASSISTANT)).astype(np.uint8).tofile(out / "train" / FLAGS_FILE)
    data = TextDataModule(prepared_dir=str(out), seq_length=S, batch_size=2, val_fraction=0,
                          tokenizer=str(tokenizer_dir / "tokenizer.json"))  # fmt: skip
    module = GPTModule(tiny_config("llama", vocab_size=data.vocab_size, seq_length=S),
                       OptimizerConfig(lr=1e-2, weight_decay=0.1, warmup_steps=0))  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    before: dict[str, torch.Tensor] = {}

    class Snapshot(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            before.update({k: v.detach().clone() for k, v in pl_module.state_dict().items()})

    trainer.callbacks.append(Snapshot())
    refused = None
    try:
        trainer.fit(module, datamodule=data)
    except ConfigError as error:
        refused = str(error)
    moved = [k for k, v in module.state_dict().items() if k in before and not
             torch.equal(v, before[k])]  # fmt: skip
    assert before and not moved, (
        f"the optimizer stepped on a step with no loss token (weight decay moved {moved[:3]})"
    )
    assert refused is not None and "\n" not in refused, f"no one-line refusal: {refused!r}"
    assert re.match(r"^step 0: no label of the global batch counts in the loss .*the run stops "
                    "rather than step the optimizer", refused), refused  # fmt: skip


def test_chat_sft_without_transformers_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 40: chat SFT imports transformers, an optional extra; on an install without it
    the data module ended in an ImportError traceback. Now one line naming the extra."""
    tokenizer_dir = chat_tokenizer(tmp_path)
    rows = jsonl(tmp_path / "chat.jsonl", conversations(4))
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)
    with pytest.raises(ConfigError) as error:
        TextDataModule(paths=str(rows), chat_template_dir=str(tokenizer_dir),
                       prepared_dir=str(tmp_path / "p"), seq_length=S)  # fmt: skip
    assert str(error.value) == (
        "chat SFT (data.chat_template_dir) renders conversations with a Hugging Face chat "
        "template, which needs the package 'transformers': install the chat extra, pip install "
        "'lightning-sp[chat]' (transformers, jinja2)"
    )


def test_flags_to_sample_and_loss_tokens_by_hand() -> None:
    """A packed chat bin's fields from its tokens and flags, written out by hand: label ``j``
    is token ``j + 1``, counted where that token is an assistant token of the same
    conversation (not the first token of the next one, assistant or not); documents and
    positions restart at each start flag. And :func:`loss_tokens`: the first token of a
    conversation is nobody's label, so a conversation whose only assistant token is its first
    trains nothing (it is dropped, not packed)."""
    a, start = ASSISTANT, START
    row = torch.arange(10, 18)  # s + 1 = 8 tokens
    # conversation 0: tokens 0-3 (answer 2, 3); conversation 1: tokens 4-5, its first token an
    # assistant token; padding: tokens 6-7
    flags = torch.tensor([start, 0, a, a, start | a, a, start, 0], dtype=torch.uint8)
    sample = flags_to_sample(row, flags)
    assert sample["input_ids"].tolist() == list(range(10, 17)), "input_ids are not tokens 0..s-1"
    assert sample["labels"].tolist() == list(range(11, 18)), "labels are not tokens 1..s"
    want = [False, True, True, False, True, False, False]
    assert sample["loss_mask"].tolist() == want, (
        f"loss_mask {sample['loss_mask'].int().tolist()}, by hand {[int(w) for w in want]}: "
        "label j must count where token j + 1 is an assistant token of the same conversation"
    )
    assert sample["documents"].tolist() == [0, 0, 0, 0, 1, 1, 2], (
        f"documents {sample['documents'].tolist()}: not counted from the start flags"
    )
    assert sample["positions"].tolist() == [0, 1, 2, 3, 0, 1, 0], (
        f"positions {sample['positions'].tolist()}: not restarting per conversation"
    )
    for mask, count in (([1, 0, 0], 0), ([0, 1, 1, 0], 2), ([1, 1], 1), ([1], 0)):
        assert loss_tokens(mask) == count, (
            f"loss_tokens({mask}) = {loss_tokens(mask)}, not {count}: the first token of a "
            "conversation is nobody's label and counts for no loss token"
        )


def test_a_cut_or_missing_flags_file_is_one_line_at_open(tmp_path: Path) -> None:
    """A chat split's ``flags.bin`` holds one byte per token: cut (or missing) it would shift
    or drop the loss masks and document starts of the samples it no longer covers. Building
    the data module says so in one line naming the file, before a token is read."""
    tokenizer_dir = chat_tokenizer(tmp_path)
    source = jsonl(tmp_path / "chat.jsonl", conversations(6))
    out = tmp_path / "prepared"
    prepare_chat([str(source)], str(tokenizer_dir), str(out), S, val_fraction=0,
                 log=lambda _: None)  # fmt: skip
    flags = out / "train" / "flags.bin"
    whole = flags.read_bytes()
    cases = [
        (lambda: flags.write_bytes(whole[:-3]),
         rf"^{flags} holds {len(whole) - 3} bytes, index.json says {len(whole)} tokens of 1 "
         r"byte\(s\)"),
        (lambda: flags.unlink(), rf"^{flags} is missing \({len(whole)} tokens by index.json\)"),
    ]  # fmt: skip
    for damage, match in cases:
        flags.write_bytes(whole)
        damage()
        try:
            TextDataModule(prepared_dir=str(out), tokenizer=str(tokenizer_dir / "tokenizer.json"),
                           seq_length=S, batch_size=1)  # fmt: skip
            line = None
        except ConfigError as error:
            line = str(error)
        assert line is not None, (
            "train/flags.bin cut or missing, and the data module opened the split without a "
            "word (the flags file's size not checked against index.json)"
        )
        assert re.search(match, line) and "\n" not in line, line


def test_a_truncated_conversation_keeps_its_mask_aligned(tmp_path: Path) -> None:
    """``overflow: truncate`` cuts a long conversation's ids and its assistant mask alike: the
    prepared split holds one flag per token, and read back, the truncated conversation's loss
    mask is transformers' mask of its first ``seq_length + 1`` tokens (and every other
    conversation's its own: nothing shifted)."""
    from transformers import AutoTokenizer

    tokenizer_dir = chat_tokenizer(tmp_path)
    long = {"prompt": "the quick brown fox", "completion": " ".join(["the lazy dog"] * 20)}
    rows = [*conversations(4), long]
    out = tmp_path / "prepared"
    meta = prepare_chat([str(jsonl(tmp_path / "chat.jsonl", rows))], str(tokenizer_dir),
                        str(out), S, val_fraction=0, log=lambda _: None)  # fmt: skip
    assert meta["chat"]["truncated"] == 1, meta["chat"]
    index = json.loads((out / "train" / "index.json").read_text())
    flags = (out / "train" / "flags.bin").stat().st_size
    assert flags == index["tokens"], (
        f"train/flags.bin holds {flags} flags for {index['tokens']} tokens: a truncated "
        "conversation's mask was not cut with its ids"
    )
    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    expected = {}
    for row in rows:
        rendered = _rendered(hf, row)
        ids, mask = rendered["input_ids"][: S + 1], rendered["assistant_masks"][: S + 1]
        expected[tuple(ids)] = mask
    data = TextDataModule(prepared_dir=str(out), tokenizer=str(tokenizer_dir / "tokenizer.json"),
                          seq_length=S, batch_size=1)  # fmt: skip
    found = 0
    for sample in _samples(data):
        row = torch.cat([sample["input_ids"], sample["labels"][-1:]])
        documents = torch.cat([sample["documents"], sample["documents"][-1:]])
        for doc in documents.unique():
            where = (documents == doc).nonzero().squeeze(1)
            ids = tuple(row[where].tolist())
            if ids in expected:
                got = sample["loss_mask"][where[:-1]].int().tolist()
                want = expected.pop(ids)[1 : len(where)]
                assert got == want, (
                    f"a conversation of {len(ids)} tokens read back with loss mask {got}, "
                    f"transformers' {want}: its flags are shifted"
                )
                found += 1
    assert not expected, f"{len(expected)} conversations not found whole in the samples"
    assert found == len(rows)


def test_split_members_by_hand() -> None:
    """The validation items of packed chat / preference data: ``val_fraction`` of the items,
    at least one and one short of all (none at 0), drawn without overlapping the training
    items (together each item once)."""
    for count, fraction, n_val in ((10, 0.3, 3), (10, 0.01, 1), (2, 0.9, 1), (7, 0.0, 0)):
        split = split_members(count, fraction, seed=5)
        train, val = split["train"], split["val"]
        assert len(val) == n_val, (
            f"split_members({count}, {fraction}): {len(val)} validation items, not {n_val} "
            "(val_fraction of the items, at least one and one short of all)"
        )
        assert sorted(train + val) == list(range(count)) and not set(train) & set(val), (
            f"split_members({count}, {fraction}): train {train} and val {val} do not hold "
            "each item exactly once (a validation item trained on, or one lost)"
        )
        assert train == sorted(train) and val == sorted(val), "items not in order"
