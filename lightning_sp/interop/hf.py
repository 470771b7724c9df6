"""Hugging Face GPT-2 weights in and out: any layout's shard from a ``model.safetensors``, and
a layout-free stream of our parameters to a directory ``GPT2LMHeadModel`` loads.

Our parameters map one to one onto GPT-2's (:data:`WEIGHTS`), with three differences:

* GPT-2's ``Conv1D`` stores ``[in, out]``; our linears store ``[out, in]`` (transposed).
* The fused QKV rows are ordered ``[head][q|k|v][d]`` here, so a tensor-parallel shard of rows
  is whole heads; GPT-2's columns are ``[q|k|v][head][d]`` (:func:`qkv_permutation`).
* Our vocabulary is padded to a multiple of ``128·t``; padded rows are dropped on export and
  zero on import (no token id reaches them, and they never receive probability).

Import (:func:`load_gpt2_weights`) fills each parameter of a :class:`GPT` shard from the slice
its :class:`~lightning_sp.parallel.init.ShardSpec` names, reading only that slice from the file
(``safe_open(...).get_slice``): a rank never reads another rank's weights. Export
(:func:`save_gpt2`) takes ``(global name, full tensor)`` pairs from any source (a checkpoint
reader, a model's state dict) and writes ``config.json``, ``model.safetensors`` and the
tokenizer files.
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Iterable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from lightning_sp.errors import ConfigError
from lightning_sp.interop.hf_config import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
    check_gpt2_config,
    gpt2_config,
    read_gpt2_config,
)
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.gpt import GPT


@dataclass(frozen=True)
class WeightMap:
    """One of our parameters and the GPT-2 tensor that holds it.

    ``ours`` / ``hf`` are names with ``{i}`` for the layer number (``hf`` without the
    ``transformer.`` prefix); ``conv1d``: GPT-2 stores it transposed; ``qkv``: its rows (our
    dim 0) are the fused QKV in our per-head order.
    """

    ours: str
    hf: str
    conv1d: bool = False
    qkv: bool = False


WEIGHTS = (
    WeightMap("word_embeddings.weight", "wte.weight"),
    WeightMap("position_embeddings", "wpe.weight"),
    WeightMap("final_norm.weight", "ln_f.weight"),
    WeightMap("final_norm.bias", "ln_f.bias"),
)
LAYER_WEIGHTS = (
    WeightMap("layers.{i}.ln1.weight", "h.{i}.ln_1.weight"),
    WeightMap("layers.{i}.ln1.bias", "h.{i}.ln_1.bias"),
    WeightMap("layers.{i}.attention.qkv.weight", "h.{i}.attn.c_attn.weight", conv1d=True, qkv=True),
    WeightMap("layers.{i}.attention.qkv.bias", "h.{i}.attn.c_attn.bias", qkv=True),
    WeightMap("layers.{i}.attention.proj.weight", "h.{i}.attn.c_proj.weight", conv1d=True),
    WeightMap("layers.{i}.attention.proj.bias", "h.{i}.attn.c_proj.bias"),
    WeightMap("layers.{i}.ln2.weight", "h.{i}.ln_2.weight"),
    WeightMap("layers.{i}.ln2.bias", "h.{i}.ln_2.bias"),
    WeightMap("layers.{i}.mlp.fc1.weight", "h.{i}.mlp.c_fc.weight", conv1d=True),
    WeightMap("layers.{i}.mlp.fc1.bias", "h.{i}.mlp.c_fc.bias"),
    WeightMap("layers.{i}.mlp.fc2.weight", "h.{i}.mlp.c_proj.weight", conv1d=True),
    WeightMap("layers.{i}.mlp.fc2.bias", "h.{i}.mlp.c_proj.bias"),
)
_BY_NAME = {w.ours: w for w in WEIGHTS + LAYER_WEIGHTS}


def weight_map(global_name: str) -> tuple[WeightMap, str]:
    """The :class:`WeightMap` of one of our global parameter names and the GPT-2 name."""
    layer = None
    key = global_name
    if global_name.startswith("layers."):
        _, layer, rest = global_name.split(".", 2)
        key = f"layers.{{i}}.{rest}"
    if key not in _BY_NAME:
        raise KeyError(f"{global_name!r} is not a GPT parameter with a GPT-2 counterpart")
    mapping = _BY_NAME[key]
    return mapping, mapping.hf.format(i=layer)


def gpt2_shapes(hf: dict) -> dict[str, tuple[int, ...]]:
    """GPT-2 tensor name (no prefix) -> shape, for the ``config.json`` ``hf``."""
    h, v, n = hf["n_embd"], hf["vocab_size"], hf["n_positions"]
    f = hf.get("n_inner") or 4 * h
    shapes = {"wte.weight": (v, h), "wpe.weight": (n, h), "ln_f.weight": (h,), "ln_f.bias": (h,)}
    layer = {
        "ln_1.weight": (h,), "ln_1.bias": (h,), "ln_2.weight": (h,), "ln_2.bias": (h,),
        "attn.c_attn.weight": (h, 3 * h), "attn.c_attn.bias": (3 * h,),
        "attn.c_proj.weight": (h, h), "attn.c_proj.bias": (h,),
        "mlp.c_fc.weight": (h, f), "mlp.c_fc.bias": (f,),
        "mlp.c_proj.weight": (f, h), "mlp.c_proj.bias": (h,),
    }  # fmt: skip
    for i in range(hf["n_layer"]):
        shapes.update({f"h.{i}.{name}": shape for name, shape in layer.items()})
    return shapes


def qkv_permutation(num_heads: int, head_dim: int) -> Tensor:
    """For each of our fused QKV rows ``[head][q|k|v][d]``, its GPT-2 column
    ``[q|k|v][head][d]``: ``perm[r]`` (a permutation of ``range(3h)``)."""
    rows = torch.arange(3 * num_heads * head_dim)
    head, within = rows // (3 * head_dim), rows % (3 * head_dim)
    part, d = within // head_dim, within % head_dim
    return part * (num_heads * head_dim) + head * head_dim + d


# -- reading slices -------------------------------------------------------------------------------


def _runs(index: Tensor) -> list[tuple[int, int]]:
    """``index`` (1-D, non-empty) as maximal ascending runs ``[start, stop)``, in order."""
    breaks = ((index[1:] - index[:-1]) != 1).nonzero().flatten().tolist()
    edges = [0, *(b + 1 for b in breaks), len(index)]
    return [(int(index[a]), int(index[b - 1]) + 1) for a, b in itertools.pairwise(edges)]


class GPT2Weights:
    """Read access to a GPT-2 directory's safetensors file(s), a slice at a time.

    A context manager; names are GPT-2's without the ``transformer.`` prefix, which files
    written by ``save_pretrained`` carry and OpenAI's original upload does not.
    """

    def __init__(self, directory: str | Path, field: str = "init_from") -> None:
        self.directory, self.field = Path(directory), field
        self.hf = read_gpt2_config(directory, field)
        if (self.directory / WEIGHTS_FILE).is_file():
            files = [WEIGHTS_FILE]
        else:  # sharded: model.safetensors.index.json names the file of each tensor
            index = json.loads((self.directory / WEIGHTS_INDEX_FILE).read_text())
            files = sorted(set(index["weight_map"].values()))
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
                f"{self.field}={str(self.directory)!r}: {file} is not a readable safetensors "
                f"file ({reason})"
            ) from None

    def __enter__(self) -> GPT2Weights:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _key(self, name: str) -> str | None:
        return next((k for k in (f"transformer.{name}", name) if k in self._keys), None)

    def check(self) -> None:
        """Raise :class:`ConfigError` unless every tensor ``config.json`` implies is in the
        file with its shape (one line: the tensor, its shape, the expected shape)."""
        where = f"{self.field}={str(self.directory)!r}"
        for name, shape in gpt2_shapes(self.hf).items():
            key = self._key(name)
            if key is None:
                raise ConfigError(
                    f"{where}: the weights have no tensor {name!r}, which {CONFIG_FILE} implies "
                    f"(n_layer={self.hf['n_layer']}); the files do not belong together"
                )
            found = tuple(self._keys[key].get_slice(key).get_shape())
            if found != shape:
                raise ConfigError(
                    f"{where}: tensor {key!r} has shape {list(found)} but {CONFIG_FILE} needs "
                    f"{list(shape)}; the files do not belong together"
                )

    def read(self, name: str, index: list[Tensor]) -> Tensor:
        """``tensor[index[0]][:, index[1]]...`` of GPT-2 tensor ``name``, reading only those
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


def check_gpt2_directory(
    directory: str | Path, config: GPTConfig, field: str = "init_from"
) -> None:
    """Everything :func:`load_gpt2_weights` needs, checked before any work: the directory is a
    GPT-2 model, its sizes are ``config``'s, and its weights file has every tensor in shape."""
    with GPT2Weights(directory, field) as weights:
        check_gpt2_config(weights.hf, config, directory)
        weights.check()


@torch.no_grad()
def load_gpt2_weights(model: GPT, directory: str | Path, field: str = "init_from") -> int:
    """Set every parameter of ``model`` (one rank's shard, any t / p / m) to its slice of the
    GPT-2 weights in ``directory``, reading only that slice. Padded vocabulary rows become 0.
    Returns the number of elements read from the file."""
    config = model.config
    perm = qkv_permutation(config.num_heads, config.head_dim)
    elements = 0
    with GPT2Weights(directory, field) as weights:
        check_gpt2_config(weights.hf, config, directory)
        hf_shapes = gpt2_shapes(weights.hf)
        for name, param in model.named_parameters():
            mapping, hf_name = weight_map(model.global_name(name))
            extent = hf_shapes[hf_name][::-1] if mapping.conv1d else hf_shapes[hf_name]
            spec = param.shard  # type: ignore[attr-defined]
            index = []  # per dim of ours: the rows of the full tensor this shard holds
            for dim, size in enumerate(param.shape):
                start = spec.start if spec.dim == dim else 0
                rows = torch.arange(start, max(start, min(start + size, extent[dim])))
                index.append(perm[rows] if mapping.qkv and dim == 0 else rows)
            param.zero_()
            if any(len(rows) == 0 for rows in index):  # a shard of padding only
                continue
            block = weights.read(hf_name, index[::-1] if mapping.conv1d else index)
            block = block.t() if mapping.conv1d else block
            param[tuple(slice(0, n) for n in block.shape)].copy_(block)
            elements += block.numel()
    return elements


# -- export ---------------------------------------------------------------------------------------


def to_gpt2_tensor(global_name: str, full: Tensor, config: GPTConfig) -> tuple[str, Tensor]:
    """One of our full parameters (any vocabulary padding) as GPT-2's named tensor."""
    mapping, hf_name = weight_map(global_name)
    tensor = full.detach()
    if mapping.ours == "word_embeddings.weight":
        tensor = tensor[: config.vocab_size]  # drop padding
    if mapping.qkv:
        reordered = torch.empty_like(tensor)
        reordered[qkv_permutation(config.num_heads, config.head_dim)] = tensor
        tensor = reordered
    if mapping.conv1d:
        tensor = tensor.t()
    return f"transformer.{hf_name}", tensor.contiguous().clone()


def save_gpt2(
    config: GPTConfig,
    tensors: Iterable[tuple[str, Tensor]],
    output: str | Path,
    *,
    eos_token_id: int | None = None,
    tokenizer_file: str | Path | None = None,
    eos_token: str | None = None,
) -> Path:
    """Write a Hugging Face GPT-2 directory from ``(global name, full tensor)`` pairs.

    ``tensors`` must hold each of our global parameters (``GPT.global_name``) once, whole
    (vocabulary padding allowed); a repeat (a pipeline stage's copy of the tied embedding) must
    be equal. Writes ``config.json``, ``model.safetensors`` and, given ``tokenizer_file`` (a
    ``tokenizers`` ``tokenizer.json``), that file with a ``tokenizer_config.json`` naming
    ``eos_token``. Returns the directory.
    """
    out: dict[str, Tensor] = {}
    for name, full in tensors:
        key, tensor = to_gpt2_tensor(name, full, config)
        if key in out and not torch.equal(out[key], tensor):
            raise ValueError(f"{name} given twice with different values")
        out[key] = tensor
    hf = gpt2_config(config, eos_token_id=eos_token_id)
    missing = [n for n in gpt2_shapes(hf) if f"transformer.{n}" not in out]
    if missing:
        raise ValueError(f"no tensor for GPT-2's {missing[0]} (and {len(missing) - 1} more)")
    dtypes = {t.dtype for t in out.values()}
    hf["dtype"] = str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else "float32"
    path = Path(output)
    path.mkdir(parents=True, exist_ok=True)
    save_file(out, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    (path / CONFIG_FILE).write_text(json.dumps(hf, indent=2) + "\n")
    if tokenizer_file is not None:
        shutil.copyfile(tokenizer_file, path / "tokenizer.json")
        tokenizer_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": config.seq_length,
            "bos_token": eos_token,
            "eos_token": eos_token,
        }
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return path
