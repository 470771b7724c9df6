"""Text generation from a (tensor-parallel) :class:`~lightning_sp.model.gpt.GPT`, with a
key/value cache for incremental decoding.

The cached path reuses the GPT's own submodules (embedding, each layer's norms, its attention's
``heads`` (Q, K, V, rotated at their true positions under RoPE) and ``output``, the MLP, the
final norm and the output layer) and replaces only the attention core: each step feeds the new
tokens ``[n, b, h]``, appends their keys and values (rotated keys under RoPE) to the cache
``[b·g/t, 1, s_max, d]`` (one entry per key/value group) and attends over every cached
position. ``GPT.forward`` is
not involved, so the training path is untouched.

Sequence parallelism shards the sequence over the TP group, which one new token cannot be:
generation runs on the same weights in a GPT built with ``sequence_parallel=False``
(:func:`sequence_parallel_off` shares the parameters, it copies nothing), so it works at any
``t``; heads stay split over the TP group and the logits are gathered over the vocabulary, so
every TP rank samples the same token. Pipeline parallelism is not supported (the model must
hold the whole stack).

:func:`generate` without the cache (``use_cache=False``) runs the full forward of the model
as trained (with sequence parallelism if it has it) over the whole sequence every step: the
reference the cache is tested against, and the baseline of ``benchmarks/generate.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_sp.errors import ConfigError, finite_number, positive_int
from lightning_sp.model.gpt import GPT
from lightning_sp.parallel.comm import all_gather_sequence


@dataclass
class GenerationConfig:
    """How ``generate`` / ``predict`` sample a continuation of each prompt."""

    max_new_tokens: int = 200
    """Tokens to generate at most (fewer if the end-of-document token comes first, or the
    sequence reaches the model's seq_length)."""

    temperature: float = 0.8
    """Softmax temperature; 0 is greedy decoding (always the most likely token)."""

    top_k: int | None = 50
    """Sample among the k most likely tokens only; unset: the whole vocabulary."""

    seed: int = 0
    """Seed of the sampling generator: the same seed, prompt and checkpoint give the same text."""

    use_cache: bool = True
    """Decode incrementally with a key/value cache; false: a full forward every token."""

    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the continuation besides the end-of-document token (not included in
    it): a chat template's end of turn (``generate --chat true`` reads them from the
    tokenizer directory: :func:`~lightning_sp.data.chat.chat_stop_ids`)."""

    def validate(self) -> None:
        """:class:`ConfigError` (one line) for a bad field."""
        positive_int("max_new_tokens", self.max_new_tokens)
        for token in self.stop_token_ids:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ConfigError(
                    f"stop_token_ids={list(self.stop_token_ids)!r} must be token ids "
                    f"(integers >= 0); {token!r} is not"
                )
        if self.top_k is not None:
            positive_int("top_k", self.top_k)
        finite_number("temperature", self.temperature, "a finite number >= 0 (0 is greedy)",
                      lambda v: v >= 0)  # fmt: skip


def sequence_parallel_off(model: GPT) -> GPT:
    """``model`` itself if it runs without sequence parallelism, else a GPT built with
    ``sequence_parallel=False`` that shares ``model``'s parameters (nothing is copied)."""
    if not model.sequence_parallel:
        return model
    config = dataclasses.replace(model.config, sequence_parallel=False)
    dtype = next(model.parameters()).dtype
    view = GPT(config, model.state, layer_range=model.layer_range, dtype=dtype, device="meta")
    view.load_state_dict(model.state_dict(keep_vars=True), assign=True)
    return view.train(model.training)


# -- forward passes --------------------------------------------------------------------------------


@dataclass
class KVCache:
    """Keys and values of every layer for positions ``[0, length)``, each
    ``[b·g/t, 1, s_max, d]`` (this rank's key/value groups)."""

    keys: list[Tensor]
    values: list[Tensor]
    length: int = 0

    @classmethod
    def for_model(cls, model: GPT, batch: int) -> KVCache:
        """An empty cache for ``model``'s layers, ``batch`` sequences of up to seq_length."""
        param = next(model.parameters())
        shapes = []
        for layer in model.layers:
            attention: Any = layer.attention
            shape = (batch * attention.local_groups, 1, model.config.seq_length, attention.head_dim)
            shapes.append(shape)
        keys = [param.new_empty(shape) for shape in shapes]
        return cls(keys, [param.new_empty(shape) for shape in shapes])


def _cached_attention(layer: Any, x: Tensor, cache: KVCache, index: int) -> Tensor:
    """Attention of the new positions ``x`` ``[n, b, h]`` over the cache plus themselves."""
    attention = layer.attention
    start, (n, b, _) = cache.length, x.shape
    q, k, v = attention.heads(x, start=start)  # [b·g/t, r, n, d], [b·g/t, 1, n, d]
    end = start + n
    cache.keys[index][:, :, start:end] = k
    cache.values[index][:, :, start:end] = v
    keys, values = cache.keys[index][:, :, :end], cache.values[index][:, :, :end]
    # new position start + i sees cached positions j <= start + i
    mask = torch.full((n, end), float("-inf"), dtype=q.dtype, device=q.device).triu_(start + 1)
    scores = torch.matmul(q, keys.transpose(-1, -2)) / math.sqrt(q.shape[-1]) + mask
    context = torch.matmul(torch.softmax(scores, dim=-1), values)  # [b·g/t, r, n, d]
    return attention.output(context, b)  # [n, b, h]


def _vocab_logits(model: GPT, x: Tensor) -> Tensor:
    """Final norm and output layer, gathered over the vocabulary: ``[n or n/t, b, h] -> [n, b,
    vocab_size]`` (identical on every TP rank)."""
    local = model.logits(x)  # [n, b, v/t]
    full = all_gather_sequence(local.movedim(-1, 0).contiguous(), model.tp_group).movedim(0, -1)
    return full[..., : model.config.vocab_size]  # [n, b, v] without the padding rows


@torch.no_grad()
def forward_cached(model: GPT, input_ids: Tensor, cache: KVCache) -> Tensor:
    """Feed ``input_ids`` ``[b, n]`` at positions ``cache.length`` on (``model`` without
    sequence parallelism); return the logits of the last one, ``[b, vocab_size]``."""
    x = model.embed(input_ids, start=cache.length)  # [n, b, h] (f̄ over TP; dropout off)
    layers: list[Any] = list(model.layers)  # TransformerLayer: its block's sublayers
    for index, layer in enumerate(layers):
        for sub in layer.block.sublayers:  # attention over the cache; other mixers as they are
            norm, mixer = getattr(layer, sub.norm.name), getattr(layer, sub.name)
            if sub.name == "attention":
                run = functools.partial(_cached_attention, layer, cache=cache, index=index)
            else:
                run = mixer
            x = x + (norm(run(x)) if sub.placement == "post" else run(norm(x)))  # [n, b, h]
    cache.length += input_ids.shape[1]
    return _vocab_logits(model, x[-1:])[0]


@torch.no_grad()
def forward_full(model: GPT, input_ids: Tensor) -> Tensor:
    """The model's own forward over all of ``input_ids`` ``[b, n]`` (sequence parallel if the
    model is; the sequence is padded at the end to a multiple of ``t``, which causal
    attention keeps from the positions before); the logits of position ``n - 1``."""
    n, t = input_ids.shape[1], model.state.tensor_parallel_size
    pad = (-n) % t if model.sequence_parallel else 0
    ids = nn.functional.pad(input_ids, (0, pad))
    return _vocab_logits(model, model.forward_layers(model.embed(ids)))[n - 1]


# -- sampling --------------------------------------------------------------------------------------


def sample(logits: Tensor, config: GenerationConfig, generator: torch.Generator) -> int:
    """One token id from ``logits`` ``[vocab]``: greedy at temperature 0, else top-k sampling
    with ``generator`` (on the CPU, so every rank draws the same)."""
    logits = logits.detach().to("cpu", torch.float64)
    if config.temperature == 0:
        return int(logits.argmax())
    logits = logits / config.temperature
    if config.top_k is not None and config.top_k < logits.numel():
        cutoff = torch.topk(logits, config.top_k).values[-1]
        logits = logits.masked_fill(logits < cutoff, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))


@torch.no_grad()
def generate(
    model: GPT, prompt: list[int], config: GenerationConfig, eos_id: int | None = None
) -> list[int]:
    """The tokens that follow ``prompt`` (one sequence), without the end-of-document token
    ``eos_id`` or the token of ``config.stop_token_ids`` that stops it. At most
    ``config.max_new_tokens`` and at most up to the model's ``seq_length`` in all. Every rank
    of the TP group must call it with the same arguments; they return the same tokens.
    Dropout is off while generating."""
    config.validate()
    if not (model.has_embedding and model.has_head):
        raise ConfigError(
            "pipeline_parallel_size > 1: generation needs the whole model on each rank; "
            "generate with pipeline_parallel_size=1"
        )
    seq_length = model.config.seq_length
    if not prompt:
        raise ConfigError("prompt is empty; give at least one character")
    if len(prompt) > seq_length:
        raise ConfigError(
            f"prompt is {len(prompt)} tokens, longer than model.config.seq_length={seq_length}; "
            f"shorten it to at most {seq_length} tokens"
        )
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(config.seed)
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], dtype=torch.long, device=device)  # [1, n]
    cached = sequence_parallel_off(model) if config.use_cache else None
    cache = KVCache.for_model(cached, batch=1) if cached is not None else None
    stops = set(config.stop_token_ids) | ({eos_id} if eos_id is not None else set())
    out: list[int] = []
    try:
        while len(out) < config.max_new_tokens and ids.shape[1] <= seq_length:
            if cached is not None and cache is not None:
                fed = ids[:, cache.length :]  # the prompt first, then one token a step
                logits = forward_cached(cached, fed, cache)[0]
            else:
                logits = forward_full(model, ids)[0]
            token = sample(logits, config, generator)
            if token in stops:
                break
            out.append(token)
            if ids.shape[1] == seq_length:
                break
            ids = torch.cat([ids, ids.new_tensor([[token]])], dim=1)
    finally:
        model.train(was_training)
    return out
