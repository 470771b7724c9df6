"""A decoder in ``[s, b, h]`` layout, built from tensor- and sequence-parallel layers; its parts
(norm, positions, MLP activation, key/value groups, biases, tied embeddings) come from the
config's descriptors (:mod:`lightning_sp.model.spec`).

A ``GPT`` is one rank's shard: its tensor-parallel slice of the layers ``layer_range`` (all of
them unless pipeline parallelism splits the stack), with the embedding if it holds the first
layer and the final norm + output layer if it holds the last.

Bytes a layer saves for backward (2-byte activations, 1-byte masks; paper §4.1), which the
code below keeps to exactly (term by term: :func:`lightning_sp.memory.formulas.layer_saved_terms`):

* norm 1 and 2: their inputs, 2sbh each (plus per-row statistics)
* attention: QKV input 2sbh; Q, K, V ``2sb·d(a + 2g)`` (one storage; 6sbh for multi-head);
  ``math``: softmax output 2as²b, its dropout mask as²b and output 2as²b; ``sdpa``: an fp32
  logsumexp 4asb bytes; projection input (the core's own output) 2sbh; residual dropout mask
  sbh
* MLP: input 2sbh; activation input 2sbf (SwiGLU: ``[gate | up]``, 4sbf); fc2 input 2sbf;
  residual dropout mask sbh

Tensor parallelism divides what lives inside the attention and MLP blocks by t; sequence
parallelism divides the rest. Context parallelism (``c > 1``) divides every term by c: each
rank holds its two load-balanced chunks of every sequence, ``[s/(c·t), b, h]`` under SP
(``[s/c, b, h]`` without), and the CP attention core stores no ``s x s`` or logsumexp term
(only q, k, v, which are the QKV storage above); see :mod:`lightning_sp.model.attention`.
The recompute modules (:mod:`lightning_sp.model.recompute`) drop terms: ``core_attn`` the
5as²b, ``layernorm`` the QKV and MLP inputs, ``mlp_act`` the fc2 input, ``residual_mask`` the
two masks; ``full`` keeps the layer input only.
"""

from __future__ import annotations

from functools import partial
from typing import Any, cast

import torch
from torch import Tensor, nn

from lightning_sp.model.attention import Attention, Rotary, token_positions
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.documents import Packing, Reduction
from lightning_sp.model.fp8 import attach_fp8
from lightning_sp.model.parts.build import BuildContext
from lightning_sp.model.parts.dense import MLP
from lightning_sp.model.parts.norm import Norm
from lightning_sp.model.recompute import NO_RECOMPUTE, recompute
from lightning_sp.model.spec import POSITIONS
from lightning_sp.parallel.comm import f_bar
from lightning_sp.parallel.context import context_token_mean
from lightning_sp.parallel.init import initialize_parameter, mark_parameter
from lightning_sp.parallel.layers import ColumnParallelLinear, column_parallel_linear
from lightning_sp.parallel.random import RNGStreams, dropout
from lightning_sp.parallel.state import ParallelState
from lightning_sp.parallel.vocab import (
    IGNORE_INDEX,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)


class TransformerLayer(nn.Module):
    """A transformer layer composed of the config's parts (:func:`~lightning_sp.model.parts.
    block.block_of`): for each sublayer, ``x + drop(mixer(norm(x)))`` (pre-norm) or ``x +
    drop(norm(mixer(x)))`` (post-norm); GPT-2 and Llama are attention then MLP, pre-norm.
    Modules by the parts' names: ``ln1``, ``attention``, ``ln2``, ``mlp``.

    ``[s/t, b, h]`` under sequence parallelism, else ``[s, b, h]``, in and out.
    """

    def __init__(self, ctx: BuildContext, layer_number: int) -> None:
        """Built from ``ctx`` whole (its config is a :class:`GPTConfig`; its policy, this
        layer's), as global layer ``layer_number``."""
        super().__init__()
        config, rng = cast(GPTConfig, ctx.config), ctx.rng
        self.layer_number = layer_number
        self.recompute = ctx.recompute
        """This layer's policy (its parts query it through their build context)."""
        self.attention_backend = config.attention
        self.block = config.block()
        for sub in self.block.sublayers:
            self.add_module(sub.norm.name, sub.norm.build(ctx))
            self.add_module(sub.name, sub.mixer.build(ctx))
        self.rng = rng
        self.dropout_p = config.hidden_dropout
        # a residual stream sharded along s draws its masks per rank; a replicated one must not
        self.residual_generator = rng.sharded if config.sequence_parallel else rng.replicated

    def _drop(self, x: Tensor) -> Tensor:
        return dropout(
            x, self.dropout_p, self.residual_generator, self.training,
            regenerate=self.recompute.acts("residual_mask", self.attention_backend),
        )  # fmt: skip

    def _forward(
        self, x: Tensor, documents: Tensor | None = None, positions: Tensor | None = None
    ) -> Tensor:
        sequence = {"documents": documents, "positions": positions}
        for sub in self.block.sublayers:
            norm, mixer = getattr(self, sub.norm.name), getattr(self, sub.name)
            kw = sequence if sub.mixer.reads_sequence else {}  # attention's, not a per-token FFN's
            if sub.placement == "post":  # the norm on the branch's output
                y = norm(mixer(x, **kw))
            elif self.recompute.acts("layernorm", self.attention_backend):  # in the input linears
                y = mixer(x, norm, **kw)
            else:
                y = mixer(norm(x), **kw)
            x = x + self._drop(y)  # [s/t or s, b, h]
        return x

    def forward(
        self, x: Tensor, documents: Tensor | None = None, positions: Tensor | None = None
    ) -> Tensor:
        """``documents``, ``positions``: see :meth:`GPT.forward`."""
        if self.recompute.full and self.training and torch.is_grad_enabled():
            fn = partial(self._forward, documents=documents, positions=positions)
            return recompute(fn, self.rng, x)
        return self._forward(x, documents, positions)


class GPT(nn.Module):
    """One rank's shard of a GPT (see module docstring).

    ``forward(input_ids [b, s], labels [b, s]) -> mean cross-entropy loss`` (fp32 scalar).
    Weights are initialised from ``config.seed`` so that every layout holds slices of the
    same model; only this rank's shard is ever allocated.

    Under context parallelism (``state.context_parallel_size = c > 1``) ``input_ids`` and
    ``labels`` are this CP rank's shards ``[b, s/c]`` of the full batch, i.e.
    ``shard_for_context_parallel(x, 1, c, cp_rank)`` of the ``[b, s]`` tensors every CP rank
    reads (the data path shards, the model never sees the full sequence); the loss returned is
    the token mean over the whole CP group, identical on its ranks and equal to one process's.
    Its gradients are this rank's share: sum them over the CP group
    (:func:`~lightning_sp.parallel.grads.finalize_grads` does).
    """

    def __init__(
        self,
        config: GPTConfig,
        state: ParallelState,
        *,
        layer_range: range | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        config.recompute.check_resolved()
        self.config, self.state = config, state
        self.layer_range = layer_range if layer_range is not None else range(config.num_layers)
        self.has_embedding = self.layer_range.start == 0
        self.has_head = self.layer_range.stop == config.num_layers
        self.rng = RNGStreams(config.seed, state, chunk=self.layer_range.start)
        device = device if device is not None else state.device
        kwargs: dict[str, Any] = {"dtype": dtype, "device": device}
        sp, group = config.sequence_parallel, state.tp_group
        self.sequence_parallel, self.tp_group = sp, group
        self.padded_vocab_size = config.padded_vocab_size(state.tensor_parallel_size)
        self.tied = config.tie_embeddings
        # tied: the embedding table is also the output layer's weight; a stage that has only
        # the head still owns a copy, whose gradients pipeline parallelism sums with stage 0's
        if self.has_embedding or (self.has_head and self.tied):
            self.word_embeddings = VocabParallelEmbedding(
                self.padded_vocab_size, config.hidden_size, state,
                sequence_parallel=sp, init_std=config.init_std, **kwargs,
            )  # fmt: skip
            self.word_embeddings.weight.padded_vocab = True  # type: ignore[attr-defined]
        if self.has_head and not self.tied:
            self.output = ColumnParallelLinear(
                config.hidden_size, self.padded_vocab_size, state,
                sequence_parallel=sp, bias=False, init_std=config.init_std, **kwargs,
            )  # fmt: skip
            self.output.weight.padded_vocab = True  # type: ignore[attr-defined]
        self.learned_positions = POSITIONS[config.position_embedding].learned
        if self.has_embedding and self.learned_positions:
            self.position_embeddings = nn.Parameter(
                torch.empty(config.seq_length, config.hidden_size, **kwargs)
            )
            mark_parameter(self.position_embeddings, std=config.init_std, sequence_parallel=sp)
        self.rotary = None if self.learned_positions else Rotary(config)
        start = self.layer_range.start
        ctx = BuildContext(config, state, self.rng, NO_RECOMPUTE, self.rotary, kwargs)
        self.layers = nn.ModuleList(
            TransformerLayer(ctx.for_layer(config.layer_recompute(n - start)), n)
            for n in self.layer_range
        )
        # float8 GEMMs in the layers' linears (the embeddings and the head stay as they are)
        attach_fp8(self.layers, config, torch.device(device), dtype or torch.get_default_dtype())
        if self.has_head:
            self.final_norm = Norm(config.normalization, "final_norm").build(ctx)
        self.reset_parameters()

    @property
    def output_weight(self) -> Tensor:
        """The output layer's weight shard ``[v_pad/t, h]`` (the embedding's when tied)."""
        return self.word_embeddings.weight if self.tied else self.output.weight

    @property
    def vocab_start(self) -> int:
        """The global index of this rank's first vocabulary row."""
        return self.state.tensor_parallel_rank * (
            self.padded_vocab_size // self.state.tensor_parallel_size
        )

    def reset_parameters(self) -> None:
        """(Re-)initialise every parameter of this shard from ``config.seed``."""
        for name, param in self.named_parameters():
            initialize_parameter(param, self.global_name(name), self.config.seed)

    def global_name(self, name: str) -> str:
        """A parameter's name in the unsharded, unsplit model (global layer numbers)."""
        if name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            return f"layers.{self.layers[int(index)].layer_number}.{rest}"
        return name

    def embed(self, input_ids: Tensor, start: int = 0, positions: Tensor | None = None) -> Tensor:
        """Token (+ learned position) embeddings with dropout for positions ``[start, start +
        s)``, or under context parallelism (``s`` the local sequence, ``s/c``) this CP rank's
        chunks' true positions: ``[b, s] -> [s/t or s, b, h]``; ``positions`` (``[b, s]``, e.g.
        restarting per document) replaces them."""
        ids = input_ids.t()  # [s, b] (s: the local s/c under CP)
        x = self.word_embeddings(ids)  # [s/t, b, h] under SP (ḡ), else [s, b, h] (f̄)
        if self.learned_positions:
            if positions is not None:  # per token, an index: [s, b, h]
                added = self.position_embeddings[positions.t()]
            elif self.state.context_parallel_size > 1:  # an index: its backward adds into rows
                where = token_positions(start, ids.shape[0], self.state, ids.device)
                added = self.position_embeddings[where].unsqueeze(1)
            else:
                added = self.position_embeddings[start : start + ids.shape[0]].unsqueeze(1)
            if self.sequence_parallel:
                shard = x.shape[0]
                added = added[self.state.tensor_parallel_rank * shard :][:shard]
            x = x + added
        generator = self.rng.sharded if self.sequence_parallel else self.rng.replicated
        return dropout(x, self.config.hidden_dropout, generator, self.training)

    def forward_layers(
        self, x: Tensor, documents: Tensor | None = None, positions: Tensor | None = None
    ) -> Tensor:
        """Run this shard's transformer layers: ``[s/t or s, b, h]`` in and out."""
        for layer in self.layers:
            x = layer(x, documents, positions)
        return x

    def loss(self, x: Tensor, labels: Tensor, reduction: Reduction = "mean") -> Tensor:
        """Final norm, output layer (the tied embedding or its own) and cross entropy.

        ``x``: ``[s/t or s, b, h]``; ``labels``: ``[b, s]``, where :data:`IGNORE_INDEX` marks a
        token whose loss is masked; returns an fp32 scalar: ``reduction="mean"`` the mean over
        the counted tokens (0, not NaN, when none counts), ``"sum"`` their sum (what a global
        token mean over many micro-batches and ranks divides later:
        :class:`~lightning_sp.pipeline.token_mean.TokenMean`). Under context parallelism
        (``s`` the local ``s/c``) both are over the tokens of the whole CP group
        (:func:`~lightning_sp.parallel.context.context_token_mean`; the sum all-reduced, its
        backward each rank's own share).
        """
        logits = self.logits(x)  # [s, b, v/t], never gathered over the vocabulary
        target = labels.t()  # [s, b]
        mask = target != IGNORE_INDEX  # [s, b], True where the token counts
        losses = vocab_parallel_cross_entropy(  # [s, b], 0 where masked
            logits, target, self.vocab_start, self.config.vocab_size, self.tp_group, mask
        )
        if reduction == "sum":
            total = losses.sum()
            cp = self.state.context_parallel_size > 1
            return f_bar(total, self.state.cp_group) if cp else total
        if self.state.context_parallel_size > 1:
            return context_token_mean(losses.sum(), mask.sum(), self.state.cp_group)
        return losses.sum() / mask.sum().clamp(min=1)

    def logits(self, x: Tensor) -> Tensor:
        """Final norm and output layer: ``[s/t or s, b, h] -> [s, b, v_pad/t]``."""
        return column_parallel_linear(
            self.final_norm(x), self.output_weight, None, self.tp_group, self.sequence_parallel
        )

    def forward(
        self, input_ids: Tensor, labels: Tensor, packing: Packing | Reduction = "mean"
    ) -> Tensor:
        """The loss of ``input_ids`` against ``labels`` (``[b, s]``, this CP rank's chunks),
        reduced as ``packing.reduction`` says. ``packing`` (:class:`~lightning_sp.model.
        documents.Packing`; a reduction name for an unpacked batch): ``documents``, ``[b, s]``
        ids of the **whole** sequence (also under context parallelism), block-causal
        attention; ``positions``, ``[b, s]`` of each (local) token, e.g. restarting per
        document (:mod:`lightning_sp.model.documents`)."""
        if not (self.has_embedding and self.has_head):
            raise RuntimeError("GPT.forward needs the whole stack; run stages through the pipeline")
        packing = Packing.of(packing)
        self.check_sequence(input_ids.shape[-1])
        x = self.embed(input_ids, positions=packing.positions)
        x = self.forward_layers(x, packing.documents, packing.positions)
        return self.loss(x, labels, packing.reduction)

    def check_sequence(self, s: int) -> None:
        """``ValueError`` (one line) unless ``s`` tokens fit this model and its layout; ``s``
        is the local sequence (``s/c`` of the full one under context parallelism)."""
        t, c = self.state.tensor_parallel_size, self.state.context_parallel_size
        if s * c > self.config.seq_length:
            whole = f"{s} x context_parallel_size {c} = {s * c}" if c > 1 else f"{s}"
            raise ValueError(
                f"input sequence length {whole} exceeds seq_length={self.config.seq_length}"
            )
        if c > 1 and s % 2:
            raise ValueError(
                f"local sequence length {s} under context_parallel_size={c} is odd: each CP "
                "rank holds two equal chunks (shard_for_context_parallel of a sequence "
                f"divisible by 2c = {2 * c})"
            )
        if self.sequence_parallel and s % t:
            raise ValueError(
                f"input sequence length {s} is not divisible by tensor_parallel_size={t} "
                "with sequence_parallel=True"
            )


__all__ = ["GPT", "MLP", "Attention", "Packing", "Reduction", "TransformerLayer"]
