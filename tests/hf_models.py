"""Shared by the Hugging Face tests: a small random GPT-2 and a small random Llama (grouped-query
attention with 2 key/value groups, untied, rope_theta 500000) saved locally (nothing is
downloaded), our matching configs, a fixed batch, and logits gathered from any layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_sp import GPTConfig
from lightning_sp.model.gpt import GPT
from lightning_sp.parallel.layers import column_parallel_linear
from lightning_sp.parallel.state import ParallelState

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, HIDDEN, LAYERS, HEADS = 300, 32, 64, 2, 4
LLAMA_HEADS, LLAMA_GROUPS, LLAMA_FFN = 8, 2, 96  # 2 KV groups: fewer than t = 4
TOLERANCE = 1e-10
STEPS = 3


def hf_config(**overrides: Any) -> Any:
    fields = dict(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB, n_positions=64,
                  activation_function="gelu", bos_token_id=0, eos_token_id=0)  # fmt: skip
    fields.update(overrides)
    return transformers.GPT2Config(**fields)


def save_random_gpt2(directory: Path, **overrides: Any) -> Any:
    """A random GPT2LMHeadModel, every parameter perturbed, saved in ``directory``; returned
    in float64 eval mode."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(hf_config(**overrides))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param), alpha=0.05)
    model.save_pretrained(directory)
    return model.double().eval()


def our_config(**overrides: Any) -> GPTConfig:
    fields = dict(vocab_size=VOCAB, seq_length=SEQ, hidden_size=HIDDEN, num_layers=LAYERS,
                  num_heads=HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                  recompute="none")  # fmt: skip
    fields.update(overrides)
    return GPTConfig(**fields)  # type: ignore[arg-type]


def llama_hf_config(**overrides: Any) -> Any:
    """A small ``LlamaConfig`` (sdpa attention: transformers' eager path casts the softmax to
    fp32, which float64 parity cannot survive)."""
    fields = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=LLAMA_HEADS,
                  num_key_value_heads=LLAMA_GROUPS, intermediate_size=LLAMA_FFN,
                  vocab_size=VOCAB, max_position_embeddings=64, rms_norm_eps=1e-5,
                  rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=0,
                  eos_token_id=0, pad_token_id=None,
                  attn_implementation="sdpa")  # fmt: skip
    fields.update(overrides)
    return transformers.LlamaConfig(**fields)


def save_random_llama(directory: Path, max_shard_size: str | None = None, **overrides: Any) -> Any:
    """A random LlamaForCausalLM, every parameter perturbed (norm weights included), saved in
    ``directory`` (in shards with an index when ``max_shard_size`` is given); returned in
    float64 eval mode."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_hf_config(**overrides))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param), alpha=0.05)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)
    assert model.config._attn_implementation == "sdpa"
    return model.double().eval()


def llama_config(**overrides: Any) -> GPTConfig:
    """Our config of :func:`save_random_llama`'s model."""
    fields = dict(vocab_size=VOCAB, seq_length=SEQ, hidden_size=HIDDEN, num_layers=LAYERS,
                  num_heads=LLAMA_HEADS, num_query_groups=LLAMA_GROUPS,
                  ffn_hidden_size=LLAMA_FFN, recompute="none")  # fmt: skip
    fields.update(overrides)
    return GPTConfig.of("llama", **fields)


def tokens(batch: int = 4, seed: int = 1, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (batch, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


def hf_logits_and_loss(model: Any, ids: torch.Tensor, labels: torch.Tensor) -> tuple:
    with torch.no_grad():
        logits = model(ids).logits  # [b, s, v]
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    return logits, loss


def full_logits(chunks: list[GPT], state: ParallelState, ids: torch.Tensor) -> torch.Tensor | None:
    """``[b, s, v]`` logits of a model split over t and p (one chunk per stage), gathered
    over the vocabulary; returned on the last stage, ``None`` elsewhere."""
    chunk = chunks[0]
    if chunk.has_embedding:
        x = chunk.forward_layers(chunk.embed(ids))  # [s/t or s, b, h]
    else:
        x = torch.empty(_hidden(chunk, ids), dtype=_dtype(chunk))
        dist.recv(x, group=state.pp_group, group_src=state.pipeline_parallel_rank - 1)
        x = chunk.forward_layers(x)
    if not chunk.has_head:
        dist.send(x.contiguous(), group=state.pp_group, group_dst=state.pipeline_parallel_rank + 1)
        return None
    x = chunk.final_norm(x)
    local = column_parallel_linear(  # [s, b, v/t]
        x, chunk.output_weight, None, state.tp_group, chunk.sequence_parallel
    )
    if state.tensor_parallel_size > 1:
        parts = [torch.empty_like(local) for _ in range(state.tensor_parallel_size)]
        dist.all_gather(parts, local.contiguous(), group=state.tp_group)
        local = torch.cat(parts, dim=-1)
    return local[..., : chunk.config.vocab_size].transpose(0, 1)  # [b, s, v]


def _hidden(chunk: GPT, ids: torch.Tensor) -> tuple[int, int, int]:
    t = chunk.state.tensor_parallel_size
    s = ids.shape[1] // t if chunk.sequence_parallel else ids.shape[1]
    return (s, ids.shape[0], chunk.config.hidden_size)


def _dtype(chunk: GPT) -> torch.dtype:
    return next(chunk.parameters()).dtype


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def save_gpt2_with_reference(directory: Path) -> tuple[Path, Path]:
    """A saved random GPT-2 in ``directory`` and, beside it, the float64 reference logits and
    loss on a fixed batch (``<name>.reference.pt``)."""
    return save_with_reference(directory, save_random_gpt2(directory))


def save_llama_with_reference(directory: Path) -> tuple[Path, Path]:
    """A random Llama saved in shards (``model.safetensors.index.json``) in ``directory`` and,
    beside it, the float64 reference logits and loss on a fixed batch (``<name>.reference.pt``)."""
    model = save_random_llama(directory, max_shard_size="60KB")
    assert (directory / "model.safetensors.index.json").is_file()
    return save_with_reference(directory, model)


def save_with_reference(directory: Path, model: Any) -> tuple[Path, Path]:
    ids, labels = tokens()
    logits, loss = hf_logits_and_loss(model, ids, labels)
    reference = directory.parent / f"{directory.name}.reference.pt"
    torch.save({"ids": ids, "labels": labels, "logits": logits, "loss": loss}, reference)
    return directory, reference


def unpadded_elements(chunks: list[GPT]) -> int:
    """Elements of these shards' parameters, less the vocabulary padding rows: what an import
    must read from the files (and no more)."""
    total = 0
    for chunk in chunks:
        for param in chunk.parameters():
            total += param.numel()
            if getattr(param, "padded_vocab", False):
                start, rows = param.shard.start, param.shape[0]  # type: ignore[attr-defined]
                real = max(0, min(rows, chunk.config.vocab_size - start))
                total -= (rows - real) * param.shape[1]
    return total
