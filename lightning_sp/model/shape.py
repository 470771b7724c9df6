"""The activation-shape record: everything the memory and FLOPs formulas need to know about one
layer's activations on one rank, built once from a :class:`GPTConfig`.

Symbols as in the paper: ``s`` sequence length, ``b`` micro-batch, ``h`` hidden size, ``a``
heads, ``t`` tensor-parallel size; ``f`` is the MLP width (the paper's 4h).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_sp.model.config import GPTConfig


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
    """The attention backend (:data:`lightning_sp.model.attention.ATTENTION_BACKENDS`)."""
    activation_bytes: float = 2
    """Bytes per stored activation element (2: fp16/bf16, as in the paper)."""
    mask_bytes: float = 1
    """Bytes per dropout-mask element (1: a ``bool`` mask, as in the paper)."""
    hidden_dropout: bool = True
    """Whether the residual (and embedding) dropouts are on, i.e. store masks."""
    attention_dropout: bool = True
    """Whether the attention-probability dropout is on."""

    @property
    def ffn(self) -> int:
        """The MLP width actually used: ``f`` or ``4h``."""
        return self.f or 4 * self.h

    @property
    def sbh(self) -> int:
        """``s·b·h``, the unit Table 2 counts in."""
        return self.s * self.b * self.h

    @classmethod
    def from_config(
        cls,
        config: GPTConfig,
        tensor_parallel_size: int = 1,
        micro_batch_size: int = 1,
        *,
        seq_length: int | None = None,
        activation_bytes: float = 2,
        mask_bytes: float = 1,
    ) -> ActivationShape:
        """The shape of ``config``'s layers at tensor-parallel size ``t`` and micro-batch ``b``
        (``seq_length`` overrides the config's, for shorter inputs)."""
        return cls(
            s=seq_length or config.seq_length,
            b=micro_batch_size,
            h=config.hidden_size,
            a=config.num_heads,
            t=tensor_parallel_size,
            f=config.ffn_hidden_size or 0,
            sequence_parallel=config.sequence_parallel,
            attention=config.attention,
            activation_bytes=activation_bytes,
            mask_bytes=mask_bytes,
            hidden_dropout=config.hidden_dropout > 0,
            attention_dropout=config.attention_dropout > 0,
        )
