"""Small corpora and tokenizers written to a temporary directory for the data tests."""

from __future__ import annotations

import json
from pathlib import Path

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "hums"]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def document(i: int, words: int = 80) -> str:
    """Document ``i``: English-ish words, different for every ``i``."""
    return f"document {i}: " + " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(words))


TEXT = (
    "def add(a, b):\n    return a + b\n\n"
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
    "for i in range(10):\n    print(i * i)\n\n"
)


def python_files(folder: Path) -> Path:
    """``folder``, made, holding 8 small Python files for Trainer runs (byte-level or BPE)."""
    folder.mkdir()
    for i in range(8):
        (folder / f"doc{i}.py").write_text(TEXT * (4 + i))
    return folder


def text_files(root: Path, n: int = 6, words: int = 80) -> Path:
    """``n`` plain-text documents under ``root/docs``."""
    for i in range(n):
        write(root / "docs" / f"doc{i:02d}.txt", document(i, words) + "\n")
    return root / "docs"


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def bpe_tokenizer(root: Path, eos: str | None = "<|endoftext|>", vocab_size: int = 120) -> Path:
    """A small BPE ``tokenizer.json`` trained on the standard words (EOS as a special token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    special = ["[UNK]"] + ([eos] if eos else [])
    corpus = [document(i) for i in range(20)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size,
                                                        special_tokens=special))  # fmt: skip
    out = root / "tokenizer.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return out


def word_tokenizer(root: Path, vocab_size: int) -> Path:
    """A word-level ``tokenizer.json`` whose word ``w<i>`` is id ``i``, plus ``<|endoftext|>``
    as id ``vocab_size - 1``: vocabularies of any size (e.g. past uint16) in no time."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size - 2)}
    vocab["[UNK]"] = vocab_size - 2
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    out = root / f"words{vocab_size}" / "tokenizer.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return out


CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('role ' + m['role'] + ' is not supported') }}{% endif %}"
    "{{ '<|' + m['role'] + '|> ' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + ' <|end|>' }}"
    "{% endgeneration %}{% else %}{{ m['content'] + ' <|end|>' }}{% endif %} "
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}"
)
"""A chat template with generation markers (assistant content and its end marker are the
assistant tokens) that refuses roles other than system / user / assistant."""


def chat_tokenizer(root: Path, template: str | None = CHAT_TEMPLATE) -> Path:
    """A Hugging Face tokenizer directory (BPE on the standard words, the role markers and
    ``<|end|>`` as special tokens, EOS ``<|endoftext|>``) with ``template`` as its chat template
    (none when ``None``)."""
    from transformers import PreTrainedTokenizerFast

    source = bpe_tokenizer(root / "bpe")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(source), eos_token="<|endoftext|>")
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]}
    )
    if template is not None:
        tokenizer.chat_template = template
    out = root / "chat-tokenizer"
    tokenizer.save_pretrained(str(out))
    return out


def conversations(n: int) -> list[dict]:
    """``n`` chat rows of different lengths: ``messages`` rows (some with a system turn and
    two exchanges) and ``prompt`` / ``completion`` rows."""
    rows: list[dict] = []

    def words(i: int, k: int, j: int) -> str:
        return " ".join(WORDS[(i * 3 + j + m) % len(WORDS)] for m in range(k))

    for i in range(n):
        if i % 3 == 2:
            rows.append({"prompt": words(i, 2 + i % 4, 1), "completion": words(i, 3 + i % 5, 2)})
            continue
        messages = [{"role": "system", "content": words(i, 2, 0)}] if i % 2 else []
        messages += [
            {"role": "user", "content": words(i, 3 + i % 3, 1)},
            {"role": "assistant", "content": words(i, 2 + i % 6, 2)},
        ]
        if i % 4 == 0:
            messages += [
                {"role": "user", "content": words(i, 2, 3)},
                {"role": "assistant", "content": words(i, 4, 4)},
            ]
        rows.append({"messages": messages})
    return rows
