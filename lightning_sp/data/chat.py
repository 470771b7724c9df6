"""Chat SFT data: conversations rendered by a Hugging Face chat template, loss on the assistant
tokens, packed first-fit into ``seq_length + 1`` token bins, written once in the prepared format.

Input rows (JSONL or Parquet), one conversation each:

* ``{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}, ...]}``, or
* ``{"prompt": "...", "completion": "..."}`` (a user turn and an assistant turn).

Rendering is the tokenizer directory's own ``apply_chat_template`` (``tokenizer_config.json``
or ``chat_template.jinja``, read locally with ``local_files_only``, never downloaded); the loss
mask is exactly its ``return_assistant_tokens_mask=True`` output, which needs the template to
mark the assistant content with ``{% generation %} ... {% endgeneration %}`` (or
``assistant_only_loss=False`` trains on every token).

Packing: first-fit over the conversations in order (each goes into the first bin with room,
else a new one); a bin is filled up with the end-of-document token (a document of its own, no
loss). A conversation longer than ``seq_length + 1`` is truncated to it (counted in one notice)
or refused (``overflow="refuse"``). A conversation with no label that counts (no assistant
token after its first token, as written or once truncated) would train nothing: it is dropped
and counted in one notice, and a corpus of nothing else is refused (one line), so every packed
sample holds at least one loss token.

Layout (the prepared format of :mod:`lightning_sp.data.prepare`, read by the same
:class:`~lightning_sp.data.tokens.TokenSplit`): each split's token stream is the bins back to
back, so sample ``i`` is bin ``i``; ``flags.bin`` holds one uint8 per token: bit 0 = the token
is an assistant token (a label that counts), bit 1 = the token starts a document. A sample
derives its ``loss_mask``, ``documents`` and ``positions`` (restarting per conversation) from
them (:func:`flags_to_sample`): one byte per token on disk, no ``s x s`` anything. Packing,
the splits and the directory's publication are :mod:`lightning_sp.data.packing`'s, shared with
preference data.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_sp.data.packing import (
    ASSISTANT,
    FLAGS_FILE,
    START,
    Document,
    Overflow,
    check_target,
    first_fit,
    prepare_packed,
)
from lightning_sp.data.tokenizer import tokenizer_info
from lightning_sp.errors import ConfigError
from lightning_sp.model.documents import positions_in_documents

_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")


def _auto_tokenizer() -> Any:
    """``transformers.AutoTokenizer``, or one line saying what to install: chat SFT needs the
    ``chat`` extra (transformers and Jinja, which render chat templates)."""
    try:
        import jinja2  # noqa: F401  (apply_chat_template renders with it)
        from transformers import AutoTokenizer
    except ImportError as error:
        raise ConfigError(
            f"chat SFT (data.chat_template_dir) renders conversations with a Hugging Face chat "
            f"template, which needs the package {error.name or 'transformers'!r}: install the "
            "chat extra, pip install 'lightning-sp[chat]' (transformers, jinja2)"
        ) from None
    return AutoTokenizer


def load_chat_tokenizer(directory: str, assistant_only_loss: bool) -> Any:
    """The tokenizer of a local Hugging Face directory, checked for what chat SFT needs: a
    chat template, and with ``assistant_only_loss`` its generation markers (one line each)."""
    if not os.path.isdir(directory) or not os.path.isfile(
        os.path.join(directory, "tokenizer.json")
    ):
        raise ConfigError(
            f"tokenizer={directory!r} is not a Hugging Face tokenizer directory (no "
            "tokenizer.json); give the model's local directory"
        )
    tokenizer = _auto_tokenizer().from_pretrained(directory, local_files_only=True)
    template = tokenizer.chat_template
    if not template:
        raise ConfigError(
            f"tokenizer={directory!r} has no chat template (tokenizer_config.json "
            "'chat_template' or chat_template.jinja); chat SFT renders conversations with "
            "it: use the instruct model's tokenizer or add a template"
        )
    if assistant_only_loss and not _GENERATION.search(str(template)):
        raise ConfigError(
            f"tokenizer={directory!r}: its chat template has no {{% generation %}} markers, "
            "which assistant_only_loss=true needs to find the assistant tokens; wrap the "
            "assistant content in {% generation %}...{% endgeneration %} in the template, "
            "or set assistant_only_loss=false to train on every token"
        )
    return tokenizer


def chat_stop_ids(directory: str) -> tuple[int, ...]:
    """The token ids that end an assistant's turn for the chat tokenizer of ``directory``
    (local, checked as by :func:`load_chat_tokenizer`), in this order, without repeats:
    ``generation_config.json``'s ``eos_token_id`` (an id or a list) if the directory has one,
    the tokenizer's EOS token, and the special tokens the template writes after an
    assistant's content (its end-of-turn marker: Llama 3's ``<|eot_id|>``, ChatML's
    ``<|im_end|>``), found by rendering one exchange with and without the answer."""
    tokenizer = load_chat_tokenizer(directory, assistant_only_loss=False)
    ids: list[int] = []
    path = os.path.join(directory, "generation_config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [] if eos is None else [eos]
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    user = [{"role": "user", "content": "x"}]
    try:
        prompt = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(
            [*user, {"role": "assistant", "content": "y"}], tokenize=False
        )
    except Exception:  # a template that wants more (a system turn): the EOS ids only
        return tuple(dict.fromkeys(int(i) for i in ids))
    special = set(tokenizer.all_special_ids) | {
        i for i, token in tokenizer.added_tokens_decoder.items() if token.special
    }
    if str(full).startswith(str(prompt)):  # the answer's turn: "y" and what closes it
        turn = tokenizer(str(full)[len(str(prompt)) :], add_special_tokens=False)["input_ids"]
        ids += [i for i in turn if i in special]
    return tuple(dict.fromkeys(int(i) for i in ids))


def read_rows(path: str) -> list[dict[str, Any]]:
    """The rows of one ``.jsonl`` / ``.json`` (a list, or one object per line) / ``.parquet``
    file."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return list(pq.read_table(path).to_pylist())
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        where = raw[: error.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}:{where}: not UTF-8 text (byte {raw[error.start]:#04x}: {error.reason}); "
            "save the file as UTF-8"
        ) from None
    if path.endswith(".json") and text.lstrip().startswith("["):
        rows = json.loads(text)
    else:
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise ConfigError(f"{path}:{number}: not a JSON object ({error})") from None
    return rows


def conversation(row: Any, where: str) -> list[dict[str, str]]:
    """The messages of one row (``messages``, or ``prompt`` + ``completion``); one line
    naming the row when it is neither."""
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    if "messages" in row:
        messages = row["messages"]
        ok = isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in messages
        )  # fmt: skip
        if not ok:
            raise ConfigError(
                f"{where}: 'messages' must be a non-empty list of {{role, content}} objects "
                f"with string values, got {str(messages)[:80]!r}"
            )
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    if isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
        return [
            {"role": "user", "content": row["prompt"]},
            {"role": "assistant", "content": row["completion"]},
        ]
    raise ConfigError(
        f"{where}: a row needs 'messages' (a list of {{role, content}}) or string 'prompt' and "
        f"'completion'; it has keys {sorted(row)}"
    )


def render(
    tokenizer: Any, messages: list[dict[str, str]], assistant_only_loss: bool, where: str
) -> tuple[list[int], list[int]]:
    """Token ids and per-token loss mask (1: assistant token) of one conversation, as
    ``apply_chat_template(..., return_assistant_tokens_mask=True)`` gives them."""
    try:
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True,
            return_assistant_tokens_mask=assistant_only_loss,
        )  # fmt: skip
    except Exception as error:  # the template's raise_exception, or a Jinja error
        roles = [m["role"] for m in messages]
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(
            f"{where}: the chat template rejected the conversation (roles {roles}): {message}"
        ) from None
    ids = list(out["input_ids"])
    mask = list(out["assistant_masks"]) if assistant_only_loss else [1] * len(ids)
    return ids, mask


def loss_tokens(mask: list[int]) -> int:
    """How many labels of one conversation count in the loss, given its per-token mask
    (:func:`render`): token ``j + 1`` is the label of token ``j``, so the first token is
    nobody's label (:func:`flags_to_sample`)."""
    return sum(1 for m in mask[1:] if m)


def _check_answers(
    paths: list[str],
    rows: int,
    unanswered: list[int],
    width: int,
    assistant_only_loss: bool,
    log: Callable[[str], None],
) -> None:
    """Refuse a corpus with no loss token at all (one line); else say how many
    conversations were dropped for having none (``unanswered``: as written, and cut off by
    ``overflow: truncate``): they would train nothing (a packed bin of them alone, a step of
    such bins, a step on nothing)."""
    written, cut = unanswered
    files = paths[0] if len(paths) == 1 else f"{paths[0]} (and {len(paths) - 1} more files)"
    if not rows:
        raise ConfigError(f"{files} holds no conversation; give chat rows")
    if written + cut == rows:
        which = "assistant token" if assistant_only_loss else "label"
        lost = f" ({cut} lost every answer to truncation at seq_length + 1 = {width})"
        fixes = ["give rows with assistant answers"]
        fixes += ["raise seq_length"] if cut else []
        fixes += ["set assistant_only_loss=false"] if assistant_only_loss else []
        raise ConfigError(
            f"{files}: none of its {rows} conversation(s) has an {which} to train on"
            f"{lost if cut else ''}, so a run would train on nothing; {', or '.join(fixes)}"
        )
    if written or cut:
        log(
            f"dropped {written + cut} of {rows} conversations without an answer token to train "
            f"on ({written} as written, {cut} cut off by truncation at seq_length + 1 = {width})"
        )


def flags_to_sample(row: Tensor, flags: Tensor) -> dict[str, Tensor]:
    """A packed chat sample from its ``s + 1`` tokens and flags: ``input_ids``, ``labels``,
    ``loss_mask`` (the label is an assistant token of the same conversation), ``documents``
    and ``positions`` (restarting per conversation), each ``[s]``."""
    documents = (flags & START).ne(0).cumsum(0).to(torch.int32) - 1  # [s + 1]
    same = documents[1:] == documents[:-1]
    return {
        "input_ids": row[:-1],
        "labels": row[1:],
        "loss_mask": (flags[1:] & ASSISTANT).ne(0) & same,
        "documents": documents[:-1],
        "positions": positions_in_documents(documents[:-1]),
    }


def prepare_chat(
    paths: list[str],
    tokenizer_dir: str,
    directory: str,
    seq_length: int,
    assistant_only_loss: bool = True,
    overflow: Overflow = "truncate",
    val_fraction: float = 0.1,
    seed: int = 1234,
    log: Callable[[str], None] = print,
    identity: Any = None,
) -> dict[str, Any]:
    """Render, mask, pack and write the conversations of ``paths`` (see module docstring).
    Every row is checked before anything is written; returns the metadata (``identity``,
    recorded in it, tells a caller when the directory is up to date)."""
    check_target(directory, overflow)
    tokenizer = load_chat_tokenizer(tokenizer_dir, assistant_only_loss)
    info = tokenizer_info(os.path.join(tokenizer_dir, "tokenizer.json"))
    width = seq_length + 1
    rendered: list[Document] = []
    truncated = rows = 0
    unanswered = [0, 0]  # conversations without a loss token: as written, cut off by truncation
    for path in paths:
        for number, row in enumerate(read_rows(path), 1):
            where = f"{path} row {number}"
            ids, mask = render(tokenizer, conversation(row, where), assistant_only_loss, where)
            rows += 1
            cut = len(ids) > width
            if cut:
                if overflow == "refuse":
                    raise ConfigError(
                        f"{where}: the conversation is {len(ids)} tokens, longer than "
                        f"seq_length + 1 = {width}; raise seq_length or set "
                        "overflow='truncate'"
                    )
                truncated += 1
                if not loss_tokens(mask[:width]) and loss_tokens(mask):
                    unanswered[1] += 1  # truncation cut off every answer token
                    continue
                ids, mask = ids[:width], mask[:width]
            if not loss_tokens(mask):  # it trains nothing: dropped, counted below
                unanswered[0] += 1
                continue
            rendered.append((ids, mask))
    _check_answers(paths, rows, unanswered, width, assistant_only_loss, log)
    if len(rendered) < 2 and val_fraction > 0:
        raise ConfigError(
            f"val_fraction={val_fraction} needs at least 2 conversations, {paths} hold "
            f"{len(rendered)}; add conversations or set val_fraction 0"
        )
    if truncated:
        log(f"{truncated} conversation(s) longer than seq_length + 1 = {width} were truncated")
    return prepare_packed(
        directory, [[conv] for conv in rendered], info=info, width=width,
        val_fraction=val_fraction, seed=seed, what=f"{len(rendered)} conversations", log=log,
        fields={"chat": {
            "tokenizer_dir": os.path.abspath(tokenizer_dir),
            "seq_length": seq_length,
            "assistant_only_loss": assistant_only_loss,
            "overflow": overflow,
            "truncated": truncated,
            "conversations": len(rendered),
            "dropped_without_answer": sum(unanswered),
            "identity": identity,
        }},
    )  # fmt: skip


__all__ = [
    "ASSISTANT",
    "FLAGS_FILE",
    "START",
    "conversation",
    "first_fit",
    "flags_to_sample",
    "load_chat_tokenizer",
    "loss_tokens",
    "prepare_chat",
    "read_rows",
    "render",
]
