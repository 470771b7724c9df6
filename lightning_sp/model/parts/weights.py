"""A part's weights as Hugging Face names them: the rows of a weight table and the naming scheme
each part receives.

Each part owns its Hugging Face names as data: a table per naming *convention* (``gpt2``,
``llama``, ``mixtral``: a key of the part's own table) from its modules to the family's, under
a layer (``query`` -> ``self_attn.q_proj``), and :meth:`~lightning_sp.model.parts.base.Part.
weights` lists the parameters it has (biases, query/key norms, the activation's input
projections, as its options say) and how each maps to a tensor:

* several of ours in one tensor (GPT-2's ``c_attn``: query, key, value), concatenated along
  our dim 0 in the order the model holds them, when they name the same tensor;
* a linear's weight stored ``[in, out]`` (GPT-2's ``Conv1D``: :attr:`HFNames.conv1d`);
* a stacked expert weight ``[E, n, k]`` held by one tensor per expert and piece
  (:class:`ExpertWeightMap`).

The tensor-parallel split is not here: it is the parameter's own
:class:`~lightning_sp.parallel.init.ShardSpec` (a rank reads the rows it names). A family
names its scheme with one :class:`HFNames` (the layer prefix, each part's convention, the
model's own tensors); :mod:`lightning_sp.interop` reads and writes any family from these.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

V = TypeVar("V")


@dataclass(frozen=True)
class WeightMap:
    """One of our parameters (``ours``, a global name with ``{i}`` for the layer; a part's
    rows name it under the part's module) and the Hugging Face tensor that holds it (``hf``,
    the name ``save_pretrained`` writes; a part's rows: under the layer prefix);
    ``transpose``: stored ``[in, out]`` (GPT-2's ``Conv1D``) where ours is ``[out, in]``."""

    ours: str
    hf: str
    transpose: bool = False
    in_memory: str = ""
    """The name transformers' in-memory model uses where it differs from ``hf`` (Mixtral's
    router: ``mlp.gate``), as a file saved from its ``state_dict`` (fused experts) holds it."""

    def in_memory_form(self) -> WeightMap | None:
        """This row as transformers' in-memory model names it, where that differs from the
        Hub's (``None``: the same)."""
        return WeightMap(self.ours, self.in_memory, self.transpose) if self.in_memory else None


@dataclass(frozen=True)
class ExpertWeightMap:
    """Our stacked expert weight ``ours`` (``[E, n, k]``) and the Hub's per-expert tensors
    holding it: expert ``e``'s ``[n, k]`` slice is the concatenation along its dim 0 of ``hf``
    (names with ``{e}``; globally also ``{i}``), equal parts (``gate_up``: the gate's then the
    up projection's). ``fused``: the one ``[E, n, k]`` tensor equal to ours that transformers 5
    holds in memory (a file saved from its ``state_dict``; ``save_pretrained`` writes ``hf``)."""

    ours: str
    hf: tuple[str, ...]
    fused: str = ""

    def in_memory_form(self) -> WeightMap | None:
        """The fused tensor, equal to ours, as a plain row (``None`` without one)."""
        return WeightMap(self.ours, self.fused) if self.fused else None

    def pieces(
        self, shape: tuple[int, ...], layer: str
    ) -> list[tuple[str, int, int, tuple[int, ...]]]:
        """The Hub's tensors of layer ``layer`` holding ours of full shape ``shape`` (``[E,
        n, k]``), expert by expert and piece by piece: ``(name, expert, first row of the
        piece in that expert's [n, k], the tensor's shape [n / pieces, k])``."""
        rows = shape[1] // len(self.hf)
        return [
            (piece.format(i=layer, e=expert), expert, j * rows, (rows, *shape[2:]))
            for expert in range(shape[0])
            for j, piece in enumerate(self.hf)
        ]


Weight = WeightMap | ExpertWeightMap
"""A row of a weight table."""


@dataclass(frozen=True)
class HFNames:
    """A Hugging Face family's naming scheme, the descriptor every part receives: where a
    layer's tensors live, which convention of each part's own table the family follows, how
    it stores linears, and the model's own tensors (outside any layer)."""

    layer: str
    """The prefix of layer ``{i}``'s tensors (``model.layers.{i}``, ``transformer.h.{i}``)."""
    norm: str
    """The norms' convention (:data:`lightning_sp.model.parts.norm.HF_NORMS`)."""
    attention: str
    """The attention's convention (:data:`lightning_sp.model.parts.attention.HF_ATTENTION`)."""
    feed_forward: str
    """The feed-forward part's convention (``HF_MLP`` in ``parts/dense.py``, ``HF_MOE`` in
    ``moe/part.py``)."""
    embedding: str
    """The token embedding's module (``model.embed_tokens``)."""
    final_norm: str
    """The final norm's module (``model.norm``)."""
    output: str = "lm_head"
    """The output layer's module (absent from a tied model's files)."""
    positions: str = ""
    """The learned position table's module (GPT-2's ``transformer.wpe``); empty: none."""
    conv1d: bool = False
    """Linear weights stored ``[in, out]`` (GPT-2's ``Conv1D``)."""


def convention(table: Mapping[str, V], key: str, part: str) -> V:
    """``table[key]``: a part's names under the convention ``key``; a ``KeyError`` naming the
    part and the conventions it has otherwise."""
    if key not in table:
        raise KeyError(f"the {part} part has no {key!r} Hugging Face names; it has {list(table)}")
    return table[key]


def join(*names: str) -> str:
    """Dotted names joined, empty ones left out (a part's own parameters have no module)."""
    return ".".join(n for n in names if n)


def linear(ours: str, hf: str, bias: bool, names: HFNames) -> tuple[WeightMap, ...]:
    """A linear layer's weight (stored transposed under :attr:`HFNames.conv1d`) and, with
    ``bias``, its bias: modules ``ours`` and ``hf``."""
    weight = WeightMap(join(ours, "weight"), join(hf, "weight"), names.conv1d)
    return (weight, WeightMap(join(ours, "bias"), join(hf, "bias"))) if bias else (weight,)


def norm(ours: str, hf: str, bias: bool) -> tuple[WeightMap, ...]:
    """A norm's weight and, with ``bias`` (LayerNorm), its bias: modules ``ours`` and ``hf``."""
    weight = WeightMap(join(ours, "weight"), join(hf, "weight"))
    return (weight, WeightMap(join(ours, "bias"), join(hf, "bias"))) if bias else (weight,)


def under(rows: tuple[Weight, ...], ours: str, hf: str = "") -> tuple[Weight, ...]:
    """``rows`` with ``ours.`` before our names and ``hf.`` (if given) before theirs."""

    def prefixed(name: str) -> str:
        return join(hf, name) if name else ""

    return tuple(
        WeightMap(join(ours, w.ours), join(hf, w.hf), w.transpose, prefixed(w.in_memory))
        if isinstance(w, WeightMap)
        else ExpertWeightMap(
            join(ours, w.ours), tuple(join(hf, p) for p in w.hf), prefixed(w.fused)
        )
        for w in rows
    )
