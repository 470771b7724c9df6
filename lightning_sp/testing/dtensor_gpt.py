"""The comparison: the same GPT written in plain PyTorch and parallelised with DTensor (what
the benchmarks measure ours against; ``tests/test_benchmarks.py`` checks it equals our GPT).

This is what a user who does not use this project would write: ``nn.Linear`` /
``nn.LayerNorm`` / ``nn.Embedding`` modules, ``F.dropout``, ``torch.utils.checkpoint`` for
recomputation, and ``torch.distributed.tensor.parallel.parallelize_module`` with
``ColwiseParallel`` / ``RowwiseParallel`` / ``SequenceParallel`` / ``PrepareModuleInput``
(the plan torchtitan and Lightning's tensor-parallel docs use), on a 1-D ``DeviceMesh``.

The math is :mod:`lightning_sp.model.gpt`'s, module for module, in the same ``[s, b, h]``
layout and with the same parameter names, so a state dict of our one-process ``GPT`` loads
into it (:func:`load_from_lightning_sp`): pre-LayerNorm, QKV rows ordered
``[head][q|k|v][head_dim]`` (a column shard is whole heads), causal softmax attention with
dropout on the probabilities, GeLU MLP ``h -> 4h -> h``, dropout after the embedding and on
both residual branches, tied input/output embeddings, mean cross entropy (vocabulary-parallel
through ``loss_parallel``). Policies: ``selective`` wraps the attention core in
``torch.utils.checkpoint``, ``full`` the whole layer.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils.checkpoint import checkpoint

from lightning_sp.parallel.layers import interleave

GPTConfig = Any
"""A :class:`lightning_sp.model.config.GPTConfig`, named loosely (``testing`` sits below
``model`` in the layers of ``tests/test_imports.py``); read: the sizes, the dropouts,
``attention``, ``layernorm_eps`` and ``layer_recompute(n).name``."""


def dropout(x: Tensor, p: float, training: bool, native: bool = False) -> Tensor:
    """``F.dropout`` (on CPU it saves a noise tensor of ``x``'s dtype for backward), or with
    ``native`` ``torch.native_dropout``, whose backward saves only a 1-byte ``bool`` mask."""
    if not native or not training or p == 0.0:
        return F.dropout(x, p, training)
    return torch.native_dropout(x, p, True)[0]


def attention_core(
    q: Tensor, k: Tensor, v: Tensor, dropout_p: float, training: bool, native: bool = False
) -> Tensor:
    """Causal softmax(QKᵀ/√d) V with dropout on the probabilities (our
    :func:`lightning_sp.model.gpt.attention_core` with PyTorch's dropout)."""
    s = q.shape[1]
    causal = torch.full((s, s), float("-inf"), dtype=q.dtype, device=q.device).triu_(1)
    scores = torch.baddbmm(
        causal.expand(q.shape[0], s, s), q, k.transpose(1, 2), alpha=1.0 / math.sqrt(q.shape[-1])
    )
    probs = dropout(torch.softmax(scores, dim=-1), dropout_p, training, native)
    return torch.bmm(probs, v)


class Attention(nn.Module):
    """Self-attention: ``qkv`` (column parallel) -> core -> ``proj`` (row parallel). The core is
    :func:`attention_core`, or ``F.scaled_dot_product_attention`` where ``config.attention`` is
    ``"sdpa"`` (the plain GPT of :mod:`benchmarks.gpu`).

    Heads are inferred from the local QKV width, so the same code runs whole or sharded.
    """

    def __init__(self, config: GPTConfig, selective: bool, native_dropout: bool = False) -> None:
        super().__init__()
        h = config.hidden_size
        self.head_dim = config.head_dim
        self.dropout_p = config.attention_dropout
        self.native_dropout = native_dropout
        self.selective = selective
        self.sdpa = config.attention == "sdpa"
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)

    def _core(self, q: Tensor, k: Tensor, v: Tensor, heads: int) -> Tensor:
        if not self.sdpa:
            return attention_core(q, k, v, self.dropout_p, self.training, self.native_dropout)
        n, s, d = q.shape  # [b·a, s, d] -> [b, a, s, d] (what the fused kernels take)
        q, k, v = (x.view(n // heads, heads, s, d) for x in (q, k, v))
        p = self.dropout_p if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True).view(n, s, d)

    def forward(self, x: Tensor) -> Tensor:
        qkv = self.qkv(x)  # [s, b, 3h/t], a local tensor after ColwiseParallel
        s, b, width = qkv.shape
        heads = width // (3 * self.head_dim)
        qkv = qkv.view(s, b, heads, 3 * self.head_dim)
        q, k, v = (
            y.reshape(s, b * heads, self.head_dim).transpose(0, 1)
            for y in qkv.split(self.head_dim, dim=-1)
        )
        if self.selective and self.training and torch.is_grad_enabled():
            context = checkpoint(self._core, q, k, v, heads, use_reentrant=False)
        else:
            context = self._core(q, k, v, heads)
        context = context.transpose(0, 1).reshape(s, b, heads * self.head_dim)
        return self.proj(context)


class MLP(nn.Module):
    """``fc1`` (column parallel) -> GeLU -> ``fc2`` (row parallel)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.ffn_size)
        self.fc2 = nn.Linear(config.ffn_size, config.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class DTensorLayer(nn.Module):
    """Pre-LayerNorm transformer layer: ``x + drop(attn(ln1(x)))``, then the same with MLP.

    ``recompute``: ``none``, ``selective`` (checkpoint the attention core) or ``full``
    (checkpoint the whole layer). ``native_dropout``: see :func:`dropout`.
    """

    def __init__(self, config: GPTConfig, recompute: str, native_dropout: bool = False) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.hidden_size, eps=config.layernorm_eps)
        self.attention = Attention(config, recompute == "selective", native_dropout)
        self.ln2 = nn.LayerNorm(config.hidden_size, eps=config.layernorm_eps)
        self.mlp = MLP(config)
        self.dropout_p = config.hidden_dropout
        self.native_dropout = native_dropout
        self.full = recompute == "full"

    def _forward(self, x: Tensor) -> Tensor:
        drop = self.dropout_p, self.training, self.native_dropout
        x = x + dropout(self.attention(self.ln1(x)), *drop)
        return x + dropout(self.mlp(self.ln2(x)), *drop)

    def forward(self, x: Tensor) -> Tensor:
        if self.full and self.training and torch.is_grad_enabled():
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class Positions(nn.Module):
    """Learned position embeddings added to ``[s, b, h]`` (a module, so that
    ``SequenceParallel`` can replicate its weight and add it to a sequence shard)."""

    def __init__(self, seq_length: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(seq_length, hidden_size))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.weight[: x.shape[0]].unsqueeze(1)


class DTensorGPT(nn.Module):
    """The whole GPT: ``forward(input_ids [b, s], labels [b, s]) -> mean cross entropy``.

    The vocabulary has ``config.vocab_size`` rows: the benchmarks pick a size that our model
    does not pad (a multiple of ``make_vocab_size_divisible_by · t``), so that both compute
    the same softmax over the same logits.
    """

    def __init__(self, config: GPTConfig, native_dropout: bool = False) -> None:
        super().__init__()
        self.config = config
        self.native_dropout = native_dropout
        rows = config.vocab_size
        self.word_embeddings = nn.Embedding(rows, config.hidden_size)
        self.positions = Positions(config.seq_length, config.hidden_size)
        self.layers = nn.ModuleList(
            DTensorLayer(config, config.layer_recompute(n).name, native_dropout)
            for n in range(config.num_layers)
        )
        self.final_norm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_eps)
        self.output = nn.Linear(config.hidden_size, rows, bias=False)
        self.output.weight = self.word_embeddings.weight
        self.parallel = False

    def tie_weights(self) -> None:
        """Point the output layer at the (possibly re-registered) embedding table."""
        self.output.weight = self.word_embeddings.weight

    def forward(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        x = self.word_embeddings(input_ids.t())  # [s(/t), b, h]
        x = self.positions(x)
        if isinstance(x, DTensor):
            x = x.to_local()
        x = dropout(x, self.config.hidden_dropout, self.training, self.native_dropout)
        for layer in self.layers:
            x = layer(x)
        logits = self.output(self.final_norm(x))  # [s, b, v(/t)]
        targets = labels.t().reshape(-1)
        if isinstance(logits, DTensor):
            with loss_parallel():
                return F.cross_entropy(logits.flatten(0, 1), targets)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets)


def layer_plan(sequence_parallel: bool) -> dict[str, Any]:
    """The tensor-parallel plan of one layer (torchtitan's, in ``[s, b, h]``: sequence dim 0)."""
    if not sequence_parallel:
        return {
            "attention.qkv": ColwiseParallel(),
            "attention.proj": RowwiseParallel(),
            "mlp.fc1": ColwiseParallel(),
            "mlp.fc2": RowwiseParallel(),
        }
    seq = Shard(0)
    gather = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
    return {
        "ln1": SequenceParallel(sequence_dim=0),
        "attention": gather,
        "attention.qkv": ColwiseParallel(),
        "attention.proj": RowwiseParallel(output_layouts=seq),
        "ln2": SequenceParallel(sequence_dim=0),
        "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "mlp.fc1": ColwiseParallel(),
        "mlp.fc2": RowwiseParallel(output_layouts=seq),
    }


def parallelize(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool) -> nn.Module:
    """Apply DTensor tensor (+ sequence) parallelism to a :class:`DTensorGPT` or a bare
    :class:`DTensorLayer` on the 1-D ``mesh``, in place; returns ``model``."""
    if isinstance(model, DTensorLayer):
        return parallelize_module(model, mesh, layer_plan(sequence_parallel))
    assert isinstance(model, DTensorGPT)
    seq = Shard(0) if sequence_parallel else Replicate()
    plan: dict[str, Any] = {
        "word_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(
            input_layouts=seq, output_layouts=Shard(-1), use_local_output=False
        ),
    }
    if sequence_parallel:
        plan["positions"] = SequenceParallel(sequence_dim=0)
        plan["final_norm"] = SequenceParallel(sequence_dim=0)
    parallelize_module(model, mesh, plan)
    for layer in model.layers:
        parallelize_module(layer, mesh, layer_plan(sequence_parallel))
    model.tie_weights()
    model.parallel = True
    return model


def dtensor_names(tensors: dict[str, Tensor], head_dim: int) -> dict[str, Tensor]:
    """Tensors of a one-process ``lightning_sp.GPT`` (weights, or their gradients) under this
    module's names: the positions renamed, our three ``query``/``key``/``value`` linears joined
    into one ``qkv`` with rows ``[head][q|k|v][d]``."""
    renamed = {
        ("positions.weight" if k == "position_embeddings" else k): v for k, v in tensors.items()
    }
    for key in [k for k in renamed if ".query." in k]:
        parts = [renamed.pop(key.replace(".query.", f".{n}.")) for n in ("query", "key", "value")]
        heads = parts[0].shape[0] // head_dim
        renamed[key.replace(".query.", ".qkv.")] = interleave(parts, heads)
    return renamed


def load_from_lightning_sp(model: nn.Module, state_dict: dict[str, Tensor]) -> None:
    """Copy a one-process ``lightning_sp.GPT`` (or ``TransformerLayer``) state dict into a
    :class:`DTensorGPT` (or :class:`DTensorLayer`) before it is parallelised."""
    head_dim = next(m for m in model.modules() if isinstance(m, Attention)).head_dim
    renamed = dtensor_names(state_dict, head_dim)
    if isinstance(model, DTensorGPT):
        renamed["output.weight"] = renamed["word_embeddings.weight"]
    missing, unexpected = model.load_state_dict(renamed, strict=False)
    if missing or unexpected:
        raise KeyError(f"state dicts differ: missing {missing}, unexpected {unexpected}")
