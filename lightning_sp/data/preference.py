"""Preference data for DPO: ``prompt`` / ``chosen`` / ``rejected`` rows rendered as TRL 1.16's
``DPOTrainer`` tokenizes them, each pair packed as two documents of one row, prepared once in
the chat format (:mod:`lightning_sp.data.chat`: tokens + one flags byte per token).

Rows (JSONL, JSON or Parquet), TRL's formats:

* text: ``{"prompt": str, "chosen": str, "rejected": str}``; each answer gets the tokenizer's
  EOS token unless it ends with it; sequences are ``tokenizer(prompt + answer)``;
* conversational: ``{"prompt": [messages], "chosen": [messages], "rejected": [messages]}``
  rendered with the tokenizer directory's chat template (the prompt with the generation
  prompt), or with an **implicit prompt**: ``chosen`` and ``rejected`` are whole
  conversations whose messages before the last must be equal (the prompt).

The answer tokens are those past the longest common prefix of the tokenized prompt and each
tokenized prompt + answer (TRL's rule); only they carry a loss (the flags' assistant bit).
A pair is two documents of one bin of ``seq_length + 1`` tokens, chosen first (slots ``2j``,
``2j + 1`` of the row, :func:`with_sequences`), bins filled first-fit with whole pairs, a
padding document last: a pair's two sequences always meet in one micro-batch and on one
data-parallel rank. A pair longer than a bin is truncated (each sequence keeps its start;
counted, one notice) or refused (``overflow="refuse"``).

Refused in one line naming the row, before anything is written: a row without ``chosen`` or
``rejected``, an empty answer, conversations whose prompts differ, an answer truncated away.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_sp.data.chat import read_rows
from lightning_sp.data.packing import Overflow, check_target, prepare_packed
from lightning_sp.data.tokenizer import tokenizer_info
from lightning_sp.errors import ConfigError

Sequence = tuple[list[int], list[int]]  # token ids, answer mask (1: an answer token)


def _messages(value: Any, field: str, where: str) -> list[dict[str, str]] | None:
    """``value`` as chat messages, ``None`` for text; one line for anything else."""
    if isinstance(value, str):
        return None
    ok = isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    )
    if not ok:
        raise ConfigError(
            f"{where}: {field!r} must be text or a list of {{role, content}} messages, got "
            f"{str(value)[:80]!r}"
        )
    return [{"role": m["role"], "content": m["content"]} for m in value]


def split_row(row: Any, where: str) -> tuple[Any, Any, Any]:
    """``(prompt, chosen, rejected)`` of a row, the implicit prompt extracted; one line naming
    the row for a missing field, an empty answer, or prompts that differ."""
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    for field in ("chosen", "rejected"):
        if field not in row:
            raise ConfigError(
                f"{where}: no {field!r}; a preference row needs 'chosen' and 'rejected' (and "
                f"'prompt', or conversations sharing it); it has keys {sorted(row)}"
            )
    chosen = _messages(row["chosen"], "chosen", where)
    rejected = _messages(row["rejected"], "rejected", where)
    if (chosen is None) != (rejected is None):
        raise ConfigError(f"{where}: 'chosen' and 'rejected' must both be text or both messages")
    if "prompt" in row:
        prompt = row["prompt"]
        messages = _messages(prompt, "prompt", where)
        if (messages is None) != (chosen is None):
            raise ConfigError(f"{where}: 'prompt' and the answers must both be text or messages")
        answers = (chosen, rejected) if chosen is not None else (row["chosen"], row["rejected"])
        prompt = messages if messages is not None else prompt
    elif chosen is None or rejected is None:
        raise ConfigError(f"{where}: text rows need a 'prompt'; it has keys {sorted(row)}")
    else:
        if chosen[:-1] != rejected[:-1]:
            raise ConfigError(
                f"{where}: the prompts of 'chosen' and 'rejected' differ (every message before "
                "the last must be equal when the prompt is implicit); give a 'prompt'"
            )
        prompt, answers = chosen[:-1], ([chosen[-1]], [rejected[-1]])
    for field, answer in zip(("chosen", "rejected"), answers, strict=True):
        empty = not answer if isinstance(answer, str) else not any(m["content"] for m in answer)
        if empty:
            raise ConfigError(f"{where}: {field!r} is empty; every answer needs text")
    if not prompt:
        raise ConfigError(f"{where}: the prompt is empty; DPO scores an answer to a prompt")
    return prompt, answers[0], answers[1]


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def render_pair(tokenizer: Any, row: Any, where: str) -> tuple[Sequence, Sequence]:
    """The chosen and rejected sequences of a row (ids and answer masks), tokenized as TRL's
    ``DPOTrainer`` does (see the module docstring)."""
    prompt, chosen, rejected = split_row(row, where)
    if isinstance(prompt, str):
        eos = tokenizer.eos_token or ""

        def ids(text: str) -> list[int]:
            return list(tokenizer(text)["input_ids"])

        head = ids(prompt)
        fulls = [ids(prompt + (a if a.endswith(eos) else a + eos)) for a in (chosen, rejected)]
    else:
        if not tokenizer.chat_template:
            raise ConfigError(f"{where}: conversational rows need a tokenizer with a chat template")
        try:

            def ids_of(messages: list[dict[str, str]], generation: bool = False) -> list[int]:
                out = tokenizer.apply_chat_template(
                    messages, tokenize=True, return_dict=True, add_generation_prompt=generation
                )
                return list(out["input_ids"])

            head = ids_of(prompt, generation=True)
            fulls = [ids_of(prompt + answer) for answer in (chosen, rejected)]
        except ConfigError:
            raise
        except Exception as error:
            message = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise ConfigError(f"{where}: the chat template rejected the row: {message}") from None
    start = min(_common(head, full) for full in fulls)
    pair = [(full, [0] * start + [1] * (len(full) - start)) for full in fulls]
    return pair[0], pair[1]


def fit_pair(pair: tuple[Sequence, Sequence], width: int) -> tuple[Sequence, Sequence]:
    """The pair cut to ``width`` tokens in all (each sequence keeps its start: the longer is
    cut first, neither below half unless the other is shorter)."""
    (a, ma), (b, mb) = pair
    if len(a) + len(b) <= width:
        return pair
    half = width // 2
    if len(a) <= half:
        cap_a, cap_b = len(a), width - len(a)
    elif len(b) <= width - half:
        cap_a, cap_b = width - len(b), len(b)
    else:
        cap_a, cap_b = half, width - half
    return (a[:cap_a], ma[:cap_a]), (b[:cap_b], mb[:cap_b])


def with_sequences(sample: dict[str, Tensor]) -> dict[str, Tensor]:
    """A packed preference sample (:func:`~lightning_sp.data.chat.flags_to_sample`'s fields)
    with ``sequences`` ``[s]``: each label's slot in the row (its document: chosen ``2j``,
    rejected ``2j + 1``), ``-1`` where the label is no answer token."""
    slots = torch.where(sample["loss_mask"], sample["documents"].to(torch.int64), -1)
    return {**sample, "sequences": slots}


def prepare_preference(
    paths: list[str],
    tokenizer_dir: str,
    directory: str,
    seq_length: int,
    overflow: Overflow = "truncate",
    val_fraction: float = 0.1,
    seed: int = 1234,
    log: Callable[[str], None] = print,
    identity: Any = None,
) -> dict[str, Any]:
    """Render, pack and write the pairs of ``paths`` (see the module docstring). Every row
    is checked before anything is written; returns the metadata."""
    from transformers import AutoTokenizer

    check_target(directory, overflow)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    info = tokenizer_info(os.path.join(tokenizer_dir, "tokenizer.json"))
    width = seq_length + 1
    pairs: list[tuple[Sequence, Sequence]] = []
    truncated = 0
    for path in paths:
        for number, row in enumerate(read_rows(path), 1):
            where = f"{path} row {number}"
            pair = render_pair(tokenizer, row, where)
            length = len(pair[0][0]) + len(pair[1][0])
            if length > width:
                if overflow == "refuse":
                    raise ConfigError(
                        f"{where}: the pair is {length} tokens (chosen + rejected), longer than "
                        f"seq_length + 1 = {width}; raise seq_length or set overflow='truncate'"
                    )
                pair, truncated = fit_pair(pair, width), truncated + 1
                if not all(sum(mask[1:]) for _, mask in pair):
                    raise ConfigError(
                        f"{where}: the prompt fills the pair's half of seq_length + 1 = {width} "
                        "tokens, leaving an answer no token; raise seq_length"
                    )
            pairs.append(pair)
    if len(pairs) < 2 and val_fraction > 0:
        raise ConfigError(
            f"val_fraction={val_fraction} needs at least 2 pairs, {paths} hold {len(pairs)}; "
            "add pairs or set val_fraction 0"
        )
    if truncated:
        log(f"{truncated} pair(s) longer than seq_length + 1 = {width} were truncated")
    return prepare_packed(
        directory, [list(pair) for pair in pairs], info=info, width=width,
        val_fraction=val_fraction, seed=seed, what=f"{len(pairs)} pairs", log=log,
        index_fields={"preference": True},  # its samples carry ``sequences``
        fields={
            "chat": {"tokenizer_dir": os.path.abspath(tokenizer_dir), "seq_length": seq_length,
                     "overflow": overflow, "truncated": truncated, "identity": identity},
            "preference": {"pairs": len(pairs), "truncated": truncated},
        },
    )  # fmt: skip


REFERENCE = "reference_logps"
"""The sample field of precomputed reference log-probabilities ``[K]`` (float64)."""
REFERENCE_FILE = "reference_logps.npy"
"""A prepared split's file of them, ``[samples, K]``, beside its tokens."""


def store_reference(directory: str, values: np.ndarray) -> None:
    """Write a prepared split's reference log-probabilities ``[samples, K]`` (float64) into
    ``directory`` (the split's), atomically (a crash leaves the previous file or none)."""
    path = os.path.join(directory, REFERENCE_FILE)
    partial = path + ".partial.npy"
    np.save(partial, np.asarray(values, dtype=np.float64))
    os.replace(partial, path)


__all__ = [
    "REFERENCE", "REFERENCE_FILE", "fit_pair", "prepare_preference", "render_pair", "split_row",
    "store_reference", "with_sequences",
]  # fmt: skip
