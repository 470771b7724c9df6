"""The model-type record (:data:`lightning_sp.interop.hf_types.HF_MODEL_TYPES` holds one per
``model_type``) and the weight table of a config: the rows of its layer's parts
(:meth:`~lightning_sp.model.parts.block.Block.weights`, which name themselves in the family's
:class:`~lightning_sp.model.parts.weights.HFNames`) plus the model's own tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_sp.interop.hf_config import ConfigTable, write_config
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.parts.weights import HFNames, Weight, WeightMap, norm
from lightning_sp.model.spec import NORMS


@dataclass(frozen=True)
class HFModelType:
    """A Hugging Face model family: ``model_type``, its ``*ForCausalLM`` class, our
    architecture family it reads into (``GPTConfig.of``: dropouts and the rest), the
    ``config.json`` table and the naming scheme of its tensors. ``optional_prefix``: a prefix
    that files written elsewhere may lack (OpenAI's GPT-2 upload has no ``transformer.``)."""

    model_type: str
    hf_class: str
    architecture: str
    config: ConfigTable
    names: HFNames
    optional_prefix: str = ""

    @property
    def title(self) -> str:
        return self.config.title

    def weights(self, config: GPTConfig) -> tuple[Weight, ...]:
        """The weight table of the model equal to ``config``: the model's own tensors (token
        and position embeddings, final norm, output layer: a row for each it may have; the
        model says which it has) and its layer's parts' rows."""
        names = self.names
        own = [
            WeightMap("word_embeddings.weight", f"{names.embedding}.weight"),
            WeightMap("output.weight", f"{names.output}.weight"),
            *norm("final_norm", names.final_norm, NORMS[config.normalization].has_bias),
        ]
        if names.positions:
            own.append(WeightMap("position_embeddings", f"{names.positions}.weight"))
        return (*own, *config.block().weights(names))

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
