"""The saved terms of a part whose linears keep their inputs as float8 casts (an FP8 recipe
that keeps its forward cast, :data:`~lightning_sp.parallel.fp8.KEEPS_FLOAT8_INPUT`): the
default of :meth:`~lightning_sp.model.parts.base.Part.float8_terms`, and the names of the
scales kept beside them."""

from __future__ import annotations

from lightning_sp.model.parts.base import EVERY_RANK, Terms


def float8_scale(term: str) -> str:
    """The name of the scale kept beside ``term``'s float8 input: dropped with ``term``."""
    return f"{term}_scale"


def float8_inputs(terms: Terms, kept: set[str], e: float) -> Terms:
    """``terms`` with each input its linears keep in float8 (an FP8 recipe that keeps its
    forward cast, :data:`~lightning_sp.parallel.fp8.KEEPS_FLOAT8_INPUT`): ``e·N`` bytes become
    ``N`` (1 byte an element), and its 4-byte fp32 scale, ``<term>_scale``, is kept on every
    rank (:data:`~lightning_sp.model.parts.base.EVERY_RANK`), named :func:`float8_scale` (a
    recompute module that drops the input drops its scale)."""
    out: Terms = {}
    for name, (nbytes, region) in terms.items():
        if name in kept:
            out[name] = (nbytes / e, region)
            out[float8_scale(name)] = (4.0, EVERY_RANK)
        else:
            out[name] = (nbytes, region)
    return out
