"""Hugging Face weights in and out, for every model type of
:data:`~lightning_sp.interop.hf_types.HF_MODEL_TYPES` (GPT-2, Llama, Mistral, Qwen2, Qwen3,
OLMo 2, Mixtral, Qwen3-MoE, OLMoE): any layout's shard from a directory's safetensors file(s),
and a layout-free stream of our parameters to a directory ``AutoModelForCausalLM`` loads.

The Hugging Face tensors of a config (:func:`hf_layout`) come from the model itself: a
:class:`GPT` built on the ``meta`` device names our parameters and their full shapes (what
its descriptors build), the parts of its layer name the tensor holding each in the model
type's naming scheme (:meth:`~lightning_sp.interop.hf_tables.HFModelType.weights`); four
things differ between the two:

* a tensor may hold several of ours, concatenated along our dim 0 (GPT-2's ``c_attn``: query,
  key, value);
* a tensor may be stored transposed (GPT-2's ``Conv1D``: ``[in, out]``);
* a stacked expert weight ``[E, n, k]`` of ours is held by one tensor per expert (and piece:
  Mixtral's ``w1`` and ``w3`` make our ``gate_up``), the Hub's layout, which transformers'
  ``save_pretrained`` writes and export writes, or by one fused ``[E, n, k]`` tensor
  (transformers 5's in-memory layout, read too); an expert-parallel rank reads only its own
  experts' tensors, or their rows of the fused one;
* our vocabulary is padded to a multiple of ``128·t`` (parameters marked ``padded_vocab``);
  padded rows are dropped on export and zero on import (no token id reaches them, and they
  never receive probability).

A tensor the files hold that the model of ``config.json`` has no place for is refused in one
line, as a mismatch (transformers would warn and drop it); so is a ``config.json`` with both
``rope_parameters`` and the legacy ``rope_scaling`` (:func:`read_config_json`).

Import (:func:`load_hf_weights`) fills each parameter of a :class:`GPT` shard from the slice
its :class:`~lightning_sp.parallel.init.ShardSpec` names (``replicas`` included: a rank
holding a key/value group shared with other ranks reads that group), reading only that slice
(``safe_open(...).get_slice``, sharded files through ``model.safetensors.index.json``): a rank
never reads another rank's weights. Export
(:func:`~lightning_sp.interop.hf_export.save_hf`) writes through the same layout.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from lightning_sp.errors import ConfigError
from lightning_sp.interop.hf_config import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
    check_config,
    config_fields,
    read_config_json,
)
from lightning_sp.interop.hf_types import HFModelType, hf_model_type
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.gpt import GPT
from lightning_sp.model.parts.weights import ExpertWeightMap, WeightMap
from lightning_sp.model.recompute import NO_RECOMPUTE
from lightning_sp.parallel.init import ExpertSlice
from lightning_sp.parallel.state import ParallelState

IGNORED = re.compile(r"(^|\.)h\.\d+\.attn\.bias$|rotary_emb\.inv_freq$")
"""Tensors older files hold that transformers drops without a word (its
``_keys_to_ignore_on_load_unexpected``): GPT-2's causal-mask buffer ``h.N.attn.bias``, a
rotary table ``rotary_emb.inv_freq``; any other tensor the model has no place for is refused
(:meth:`HFWeights.check_unused`)."""


@dataclass(frozen=True)
class Part:
    """One of our parameters inside a Hugging Face tensor: rows ``[offset, offset + rows)``
    of our dim 0 in the (untransposed) concatenation, of a parameter whose full shape, less
    vocabulary padding, is ``shape``. With ``expert`` (a stacked expert weight ``[E, n, k]``):
    the tensor holds rows ``[offset, offset + shape[0])`` of that expert's ``[n, k]`` slice,
    and ``shape`` is the tensor's."""

    ours: str
    offset: int
    shape: tuple[int, ...]
    expert: int | None = None

    def of(self, full: Tensor) -> Tensor:
        """This part's rows of our full tensor ``full``."""
        if self.expert is None:
            return full
        return full[self.expert, self.offset : self.offset + self.shape[0]]


@dataclass(frozen=True)
class HFTensor:
    """A Hugging Face tensor: its name, its stored shape, the parts of ours it concatenates,
    and whether it is stored transposed."""

    name: str
    shape: tuple[int, ...]
    parts: tuple[Part, ...]
    transpose: bool


def _mapping(
    table: dict[str, WeightMap | ExpertWeightMap], global_name: str, title: str
) -> tuple[WeightMap | ExpertWeightMap, str]:
    """The table row of one of our global parameter names, and its layer number."""
    layer, key = "", global_name
    if global_name.startswith("layers."):
        _, layer, rest = global_name.split(".", 2)
        key = f"layers.{{i}}.{rest}"
    if key not in table:
        raise KeyError(f"{global_name!r} has no {title} counterpart")
    return table[key], layer


def full_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Our global parameter names and full shapes, vocabulary padding removed (a one-process
    model of ``config`` built on the ``meta`` device: nothing is allocated)."""
    meta_config = dataclasses.replace(config, recompute=NO_RECOMPUTE, sequence_parallel=False)
    model = GPT(meta_config, ParallelState.single(), device="meta")
    shapes = {}
    for name, param in model.named_parameters():
        shape = tuple(param.shape)
        if getattr(param, "padded_vocab", False):
            shape = (config.vocab_size, *shape[1:])
        shapes[name] = shape
    return shapes


def hf_layout(
    model_type: HFModelType, config: GPTConfig, fused: bool = False
) -> dict[str, HFTensor]:
    """Every Hugging Face tensor of the ``model_type`` model equal to ``config``, by name:
    the Hub's form (one tensor per expert), or with ``fused`` transformers' in-memory form
    (one ``[E, n, k]`` tensor per stacked weight, equal to ours, so a plain part; every name
    as its model holds it: the rows' ``in_memory`` names)."""
    grouped: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    transposed: dict[str, bool] = {}
    layout = {}
    table = {w.ours: w for w in model_type.weights(config)}
    for name, shape in full_shapes(config).items():
        mapping, layer = _mapping(table, name, model_type.title)
        if fused:  # the row as the in-memory model names it (a fused expert tensor: plain)
            mapping = mapping.in_memory_form() or mapping
        if isinstance(mapping, ExpertWeightMap):  # [E, n, k]: per expert, n split in pieces
            for hf_name, expert, offset, piece in mapping.pieces(shape, layer):
                layout[hf_name] = HFTensor(
                    hf_name, piece, (Part(name, offset, piece, expert),), False
                )
            continue
        hf_name = mapping.hf.format(i=layer)
        grouped.setdefault(hf_name, []).append((name, shape))
        transposed[hf_name] = mapping.transpose
    for hf_name, members in grouped.items():
        offsets = itertools.accumulate((shape[0] for _, shape in members), initial=0)
        parts = tuple(Part(n, o, s) for (n, s), o in zip(members, offsets, strict=False))
        shape = (sum(s[0] for _, s in members), *members[0][1][1:])
        stored = shape[::-1] if transposed[hf_name] else shape
        layout[hf_name] = HFTensor(hf_name, stored, parts, transposed[hf_name])
    return layout


# -- reading slices -------------------------------------------------------------------------------


def _runs(index: Tensor) -> list[tuple[int, int]]:
    """``index`` (1-D, non-empty) as maximal ascending runs ``[start, stop)``, in order."""
    breaks = ((index[1:] - index[:-1]) != 1).nonzero().flatten().tolist()
    edges = [0, *(b + 1 for b in breaks), len(index)]
    return [(int(index[a]), int(index[b - 1]) + 1) for a, b in itertools.pairwise(edges)]


class HFWeights:
    """Read access to a Hugging Face directory's safetensors file(s), a slice at a time: a
    context manager with ``hf`` (its ``config.json``) and ``model_type``."""

    def __init__(self, directory: str | Path, field: str = "init_from") -> None:
        self.directory, self.field = Path(directory), field
        self.where = f"{field}={str(directory)!r}"
        self.hf = read_config_json(directory, field)
        self.model_type = hf_model_type(self.hf, self.where)
        if (self.directory / WEIGHTS_FILE).is_file():
            files = [WEIGHTS_FILE]
        elif not (self.directory / WEIGHTS_INDEX_FILE).is_file():
            raise ConfigError(
                f"{self.where} has no {WEIGHTS_FILE}; save the model with "
                "save_pretrained(..., safe_serialization=True) (pytorch_model.bin is not read)"
            )
        else:  # sharded: model.safetensors.index.json names the file of each tensor
            try:
                index = json.loads((self.directory / WEIGHTS_INDEX_FILE).read_text())
                files = sorted(set(index["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
                raise ConfigError(
                    f"{self.where}: {WEIGHTS_INDEX_FILE} is not a readable index "
                    f"({type(error).__name__}: {error})"
                ) from None
        self._stack = ExitStack()
        self._keys: dict[str, Any] = {}  # tensor name -> the open file holding it
        for file in files:
            handle = self._open(file)
            self._keys.update(dict.fromkeys(handle.keys(), handle))

    def _open(self, file: str) -> Any:
        try:
            return self._stack.enter_context(safe_open(str(self.directory / file), "pt"))
        except Exception as error:  # missing, truncated or not safetensors
            self._stack.close()
            reason = (str(error).splitlines() or [type(error).__name__])[0]
            raise ConfigError(
                f"{self.where}: {file} is not a readable safetensors file ({reason})"
            ) from None

    def __enter__(self) -> HFWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    @property
    def model_name(self) -> str:
        """The model in messages: ``the Llama model in '<dir>'``."""
        return f"the {self.model_type.title} model in {str(self.directory)!r}"

    def config_fields(self) -> dict[str, Any]:
        """The ``GPTConfig`` field values of this model (``seq_length``: its position table)."""
        return config_fields(self.model_type.config, self.hf, self.model_name)

    def check_config(self, config: GPTConfig) -> None:
        """:class:`ConfigError` (one line naming our field) unless ``config`` is this model."""
        check_config(self.model_type.config, self.hf, config, self.model_name)

    def _key(self, name: str) -> str | None:
        prefix = self.model_type.optional_prefix
        short = name.removeprefix(prefix) if prefix else name
        return next((k for k in (name, short) if k in self._keys), None)

    @property
    def in_memory_names(self) -> bool:
        """Whether the files hold transformers' in-memory names where they differ from the
        Hub's (its ``state_dict`` saved as is: fused ``[E, n, k]`` expert tensors), found at
        layer 0."""
        forms = (row.in_memory_form() for row in self.model_type.weights(self._config()))
        return any(self._key(f.hf.format(i=0)) is not None for f in forms if f is not None)

    def _config(self) -> GPTConfig:
        return GPTConfig.of(self.model_type.architecture, **self.config_fields())

    def layout(self) -> dict[str, HFTensor]:
        """The tensors ``config.json`` implies (:func:`hf_layout` of its model, whose
        ``seq_length`` is the whole position table), in the files' form."""
        return hf_layout(self.model_type, self._config(), self.in_memory_names)

    def check(self) -> None:
        """Raise :class:`ConfigError` unless every tensor ``config.json`` implies is in the
        files with its shape (one line: the tensor, its shape, the expected shape)."""
        for name, tensor in self.layout().items():
            key = self._key(name)
            if key is None:
                raise ConfigError(
                    f"{self.where}: the weights have no tensor {name!r}, which {CONFIG_FILE} "
                    "implies; the files do not belong together"
                )
            found = tuple(self._keys[key].get_slice(key).get_shape())
            if found != tensor.shape:
                raise ConfigError(
                    f"{self.where}: tensor {key!r} has shape {list(found)} but {CONFIG_FILE} "
                    f"needs {list(tensor.shape)}; the files do not belong together"
                )

    def check_unused(self) -> None:
        """Raise :class:`ConfigError` (one line naming the tensor) if the files hold a tensor
        the model of ``config.json`` has no place for, where transformers would warn and drop
        it (an extra layer, an unused ``*.bias``): the files and the config do not describe
        one model. Not counted: the buffers transformers drops without a word
        (:data:`IGNORED`), and a tied model's ``lm_head.weight`` (the embedding is the output
        layer, in transformers too)."""
        config = self._config()
        used = {self._key(name) for name in self.layout()}
        for key in self._keys:
            if key in used or IGNORED.search(key):
                continue
            if config.tie_embeddings and key.removeprefix("model.") == "lm_head.weight":
                continue
            raise ConfigError(
                f"{self.where}: the weights hold tensor {key!r}, which {CONFIG_FILE} has no "
                "place for (transformers would drop it with a warning); the files do not "
                "belong together, or the model has parts this GPT does not compute"
            )

    def read(self, name: str, index: list[Tensor]) -> Tensor:
        """``tensor[index[0]][:, index[1]]...`` of tensor ``name``, reading only those
        elements: every dim but one must be a contiguous range; the one may be any list of
        ascending runs (read one run at a time)."""
        key = self._key(name)
        assert key is not None, name
        view = self._keys[key].get_slice(key)
        split = next((d for d, i in enumerate(index) if len(_runs(i)) > 1), 0)
        pieces = []
        for start, stop in _runs(index[split]):
            slices = [slice(int(i[0]), int(i[-1]) + 1) for i in index]
            slices[split] = slice(start, stop)
            pieces.append(view[tuple(slices)])
        return torch.cat(pieces, split)


def read_hf_config(directory: str | Path, field: str = "init_from", **overrides: Any) -> GPTConfig:
    """The ``GPTConfig`` of the Hugging Face model in ``directory`` (any supported
    ``model_type``): its family's fields (``GPTConfig.of``), the sizes and options its
    ``config.json`` gives (``seq_length``: its whole position table), then ``overrides``.
    :class:`ConfigError` (one line) for a directory we cannot read."""
    with HFWeights(directory, field) as weights:
        fields = {**weights.config_fields(), "hf_model_type": weights.model_type.model_type}
        return GPTConfig.of(weights.model_type.architecture, **{**fields, **overrides})


def check_hf_directory(directory: str | Path, config: GPTConfig, field: str = "init_from") -> None:
    """Everything :func:`load_hf_weights` needs, checked before any work: the directory is a
    supported model, ``config`` is that model, and its weights have every tensor in shape."""
    with HFWeights(directory, field) as weights:
        weights.check_config(config)
        weights.check()
        weights.check_unused()


@torch.no_grad()
def load_hf_weights(model: GPT, directory: str | Path, field: str = "init_from") -> int:
    """Set every parameter of ``model`` (one rank's shard, any t / p / m) to its slice of the
    Hugging Face weights in ``directory``, reading only that slice. Padded vocabulary rows
    become 0. Returns the number of elements read from the files. :class:`ConfigError` (one
    line) before any read for files that are not ``model``'s (:func:`check_hf_directory`'s
    checks)."""
    config = model.config
    elements = 0
    with HFWeights(directory, field) as weights:
        weights.check_config(config)
        weights.check()  # a tensor missing or of another shape: one line, before any read
        weights.check_unused()
        layout = weights.layout()
        parts = {part.ours: (tensor, part) for tensor in layout.values() for part in tensor.parts}
        experts: dict[str, list[tuple[HFTensor, Part]]] = {}
        for tensor in layout.values():
            for part in tensor.parts:
                if part.expert is not None:
                    experts.setdefault(part.ours, []).append((tensor, part))
        for name, param in model.named_parameters():
            global_name = model.global_name(name)
            if global_name in experts:
                elements += _load_experts(weights, param, experts[global_name])
                continue
            tensor, part = parts[global_name]
            spec = param.shard  # type: ignore[attr-defined]
            first_expert = getattr(param, "expert_start", None)  # a fused expert tensor
            sliced: ExpertSlice | None = getattr(param, "expert_slice", None)
            index = []  # per dim of ours: the rows of the HF tensor this shard holds
            for dim, size in enumerate(param.shape):
                start = spec.start if spec.dim == dim else 0
                if dim == 0 and first_expert is not None:  # this EP rank's E/e experts
                    start = first_expert
                if sliced is not None and dim == sliced.dim:  # expert TP: this rank's blocks
                    rows = torch.cat([torch.arange(s, s + n) for _, s, n in sliced.blocks(size)])
                else:
                    rows = torch.arange(start, max(start, min(start + size, part.shape[dim])))
                index.append(rows + part.offset if dim == 0 else rows)
            param.zero_()
            if any(len(rows) == 0 for rows in index):  # a shard of padding only
                continue
            block = weights.read(tensor.name, index[::-1] if tensor.transpose else index)
            block = block.t() if tensor.transpose else block
            param[tuple(slice(0, n) for n in block.shape)].copy_(block)
            elements += block.numel()
    return elements


def _load_experts(weights: HFWeights, param: Tensor, parts: list[tuple[HFTensor, Part]]) -> int:
    """Fill this rank's experts (``expert_start`` on, ``param.shape[0]`` of them) of a
    stacked expert weight from their per-expert tensors; returns the elements read. Under
    expert tensor parallelism each expert is read whole and this rank's slice of it kept."""
    start: int = getattr(param, "expert_start", 0)
    sliced: ExpertSlice = getattr(param, "expert_slice", ExpertSlice(1))
    whole = list(param.shape[1:])  # one expert's [n, k], unsliced
    whole[sliced.dim - 1] *= sliced.size
    experts: dict[int, Tensor] = {}
    elements = 0
    for tensor, part in parts:
        assert part.expert is not None
        local = part.expert - start
        if not 0 <= local < param.shape[0]:
            continue  # another EP rank's expert: not read
        block = weights.read(tensor.name, [torch.arange(n) for n in part.shape])
        full = experts.setdefault(local, param.new_zeros(whole))
        full[part.offset : part.offset + part.shape[0]].copy_(block)
        elements += block.numel()
    for local, full in experts.items():
        param[local].copy_(sliced.take(full.unsqueeze(0), param.shape[sliced.dim])[0])
    return elements
