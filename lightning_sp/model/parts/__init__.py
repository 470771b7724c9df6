"""The parts a transformer layer is composed of (:mod:`.base`: the contract; :mod:`.build`: what
their modules are built from), and the layer as their composition (:mod:`.block`)."""

from lightning_sp.model.parts.attention import SelfAttention
from lightning_sp.model.parts.base import INSIDE, OUTSIDE, Gemm, MemoryOp, Part
from lightning_sp.model.parts.block import (
    FEED_FORWARDS,
    Block,
    Sublayer,
    block_of,
    block_of_shape,
)
from lightning_sp.model.parts.build import BuildContext
from lightning_sp.model.parts.dense import MLP, DenseMLP
from lightning_sp.model.parts.norm import Norm

__all__ = [
    "FEED_FORWARDS",
    "INSIDE",
    "MLP",
    "OUTSIDE",
    "Block",
    "BuildContext",
    "DenseMLP",
    "Gemm",
    "MemoryOp",
    "Norm",
    "Part",
    "SelfAttention",
    "Sublayer",
    "block_of",
    "block_of_shape",
]
