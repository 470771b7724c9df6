"""The rows of a Hugging Face weight table and the model-type record
(:data:`lightning_sp.interop.hf_types.HF_MODEL_TYPES` holds one per ``model_type``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_sp.interop.hf_config import ConfigTable, write_config
from lightning_sp.model.config import GPTConfig


@dataclass(frozen=True)
class WeightMap:
    """One of our parameters (``ours``, a global name with ``{i}`` for the layer) and the
    Hugging Face tensor that holds it (``hf``, the name ``save_pretrained`` writes);
    ``transpose``: stored ``[in, out]`` (GPT-2's ``Conv1D``) where ours is ``[out, in]``."""

    ours: str
    hf: str
    transpose: bool = False


@dataclass(frozen=True)
class ExpertWeightMap:
    """Our stacked expert weight ``ours`` (``[E, n, k]``, a global name with ``{i}``) and the
    Hub's per-expert tensors holding it: expert ``e``'s ``[n, k]`` slice is the concatenation
    along its dim 0 of ``hf`` (names with ``{i}`` and ``{e}``), equal parts (``gate_up``:
    the gate's then the up projection's). ``fused``: the one ``[E, n, k]`` tensor holding all
    experts, equal to ours (transformers 5's in-memory name, which a file saved from its
    ``state_dict`` holds; ``save_pretrained`` and the Hub write ``hf``)."""

    ours: str
    hf: tuple[str, ...]
    fused: str


def linear(ours: str, hf: str, transpose: bool = False) -> tuple[WeightMap, ...]:
    """The weight and bias rows of a linear layer (modules ``ours`` and ``hf``)."""
    weight = WeightMap(f"{ours}.weight", f"{hf}.weight", transpose)
    return weight, WeightMap(f"{ours}.bias", f"{hf}.bias")


def norm(ours: str, hf: str) -> tuple[WeightMap, ...]:
    """The weight and (LayerNorm) bias rows of a norm."""
    return linear(ours, hf)


@dataclass(frozen=True)
class HFModelType:
    """A Hugging Face model family: ``model_type``, its ``*ForCausalLM`` class, our
    architecture family it reads into (``GPTConfig.of``: dropouts and the rest), the
    ``config.json`` table and the weight table. ``optional_prefix``: a prefix that files
    written elsewhere may lack (OpenAI's GPT-2 upload has no ``transformer.``). ``renames``:
    ``(hub, in_memory)`` pieces of names that transformers' in-memory model uses instead
    (Mixtral's ``.block_sparse_moe.`` is ``.mlp.``), as a file of fused experts names them
    (:func:`~lightning_sp.interop.hf.hf_layout` with ``fused``)."""

    model_type: str
    hf_class: str
    architecture: str
    config: ConfigTable
    weights: tuple[WeightMap | ExpertWeightMap, ...]
    optional_prefix: str = ""
    renames: tuple[tuple[str, str], ...] = ()

    @property
    def title(self) -> str:
        return self.config.title

    def config_json(self, config: GPTConfig, eos_token_id: int | None = None) -> dict[str, Any]:
        """The ``config.json`` of the model equal to ``config``: class, ``model_type``, token
        ids (the end-of-document token also begins documents), then the table's keys."""
        return {
            "architectures": [self.hf_class],
            "model_type": self.model_type,
            "initializer_range": config.init_std,
            "bos_token_id": eos_token_id,
            "eos_token_id": eos_token_id,
            **write_config(self.config, config),
        }
