"""The activation-shape record: everything the memory and FLOPs formulas need to know about one
layer's activations on one rank (built by :meth:`GPTConfig.activation_shape`).

Symbols as in the paper: ``s`` sequence length, ``b`` micro-batch, ``h`` hidden size, ``a``
heads, ``t`` tensor-parallel size; ``f`` is the MLP width (the paper's 4h), ``g`` the key/value
groups (``g = a``: multi-head attention; ``g < a``: grouped-query), ``c`` the context-parallel
size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from lightning_sp.model.spec import ACTIVATIONS, NORMS, ActivationKind, NormKind


@dataclass(frozen=True)
class AdapterShape:
    """LoRA adapters on a layer's linears, the base frozen (:mod:`lightning_sp.model.lora`):
    what their saved bytes depend on (:meth:`~lightning_sp.model.parts.base.Part.
    adapter_terms`)."""

    r: int
    """The adapters' rank."""
    targets: frozenset[str]
    """The adapted linears by path under a layer (``attention.query``, ``mlp.fc2``)."""
    dropout: bool = False
    """Whether ``lora_dropout > 0`` (each adapter then keeps a 1-byte mask of its input)."""


@dataclass(frozen=True)
class ActivationShape:
    """One rank's view of a layer's activations (the paper's symbols, plus element sizes)."""

    s: int
    """Sequence length."""
    b: int
    """Micro-batch size (sequences per forward)."""
    h: int
    """Hidden size."""
    a: int
    """Attention heads (all of them; a/t live on one rank)."""
    t: int = 1
    """Tensor-parallel size."""
    f: int = 0
    """MLP width; 0 means the paper's 4h."""
    sequence_parallel: bool = False
    """Whether the activations outside the tensor-parallel region are split by t."""
    attention: str = "math"
    """The attention backend (:data:`lightning_sp.model.cores.ATTENTION_BACKENDS`)."""
    activation_bytes: float = 2
    """Bytes per stored activation element (2: fp16/bf16, as in the paper)."""
    mask_bytes: float = 1
    """Bytes per dropout-mask element (1: a ``bool`` mask, as in the paper)."""
    hidden_dropout: bool = True
    """Whether the residual (and embedding) dropouts are on, i.e. store masks."""
    attention_dropout: bool = True
    """Whether the attention-probability dropout is on."""
    g: int = 0
    """Key/value groups; 0 means ``a`` (multi-head attention)."""
    activation: str = "gelu"
    """The MLP activation (:data:`lightning_sp.model.spec.ACTIVATIONS`)."""
    norm: str = "layernorm"
    """The normalisation (:data:`lightning_sp.model.spec.NORMS`)."""
    c: int = 1
    """Context-parallel size: each rank holds ``s/c`` tokens of every sequence (``s`` stays the
    whole sequence length)."""
    d: int = 0
    """Head dimension; 0 means ``h/a``."""
    e: int = 1
    """Expert-parallel size: the ranks that share out a mixture-of-experts layer's experts
    (each holds ``E/e`` of them and runs them on the rows the group sends it)."""
    etp: int = 1
    """Expert tensor parallel size: 1 (experts whole on every TP rank) or ``t`` (each expert's
    ``f_e`` split over the TP group, which gathers the rows dispatched to its experts)."""
    documents: bool = False
    """Whether attention is document-masked (block-causal over packed documents,
    ``data.document_mask``): what the backend's document path saves besides the causal one
    (:attr:`~lightning_sp.model.cores.AttentionBackend.document_copy`)."""
    lora: AdapterShape | None = None
    """LoRA adapters with the base frozen (None: every weight trains): adapters add their
    low-rank activations and masks, a frozen linear without one keeps no input of its own."""
    fp8: str | None = None
    """The FP8 recipe of the layer's tensor-parallel linears (``tensorwise``, ``rowwise``;
    None: off): what their GEMMs run at, and whether they keep their inputs in float8
    (:data:`~lightning_sp.parallel.fp8.KEEPS_FLOAT8_INPUT`)."""
    norm_stats_bytes: float = 0
    """Bytes per element of a LayerNorm's saved mean and rstd; 0 means ``activation_bytes``
    (what PyTorch's CPU kernel saves). Its CUDA kernel saves them in its accumulate type,
    fp32 for 2-byte activations (:meth:`on_cuda`)."""
    kernel_rng_bytes: float = 0
    """Bytes of generator state a fused attention kernel call saves (0 on a CPU; 16 on CUDA,
    the Philox seed and offset as two int64, with or without dropout: :meth:`on_cuda`)."""
    block: object | None = field(default=None, compare=False, repr=False)
    """The layer's parts (a :class:`~lightning_sp.model.parts.block.Block`, which sits above
    this module and so is not named in the type); None: the
    pre-norm attention + dense MLP of ``norm`` and ``activation``. Not compared: the sizes
    and options above are what two shapes are compared by."""

    def on_cuda(self) -> ActivationShape:
        """This shape as PyTorch's CUDA kernels save it: LayerNorm's statistics in fp32 (fp64
        for 8-byte activations) and the fused attention kernel's 16-byte Philox state. An H200
        measured exactly these over the CPU's terms: 65,552 bytes per layer at s=2048, b=4,
        h=2048 (``8sb + 16``; ``benchmarks/results/gpu/session3/fp8_step.json``). What
        :meth:`GPTConfig.activation_shape` returns for a CUDA ``device``."""
        stats = max(4.0, self.activation_bytes)
        return dataclasses.replace(self, norm_stats_bytes=stats, kernel_rng_bytes=16)

    @property
    def ffn(self) -> int:
        """The MLP width actually used: ``f`` or ``4h``."""
        return self.f or 4 * self.h

    @property
    def groups(self) -> int:
        """Key/value groups: ``g`` or ``a``."""
        return self.g or self.a

    @property
    def head_dim(self) -> int:
        """The head dimension: ``d`` or ``h/a``."""
        return self.d or self.h // self.a

    @property
    def kv_heads(self) -> int:
        """Key/value heads over the whole tensor-parallel group, replicas counted:
        ``max(g, t)`` (with fewer groups than ranks each rank holds one, shared)."""
        return max(self.groups, self.t)

    @property
    def sbh(self) -> int:
        """``s·b·h``, the unit Table 2 counts in."""
        return self.s * self.b * self.h

    @property
    def mlp(self) -> ActivationKind:
        return ACTIVATIONS[self.activation]

    @property
    def norm_kind(self) -> NormKind:
        return NORMS[self.norm]
