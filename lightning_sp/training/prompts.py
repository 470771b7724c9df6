"""Prompts for ``predict`` / ``generate``: text <-> token ids with the run's tokenizer, a
dataset of prompts, and a prediction writer for the generated text."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_sp.training.strategy import MegatronSPStrategy

if TYPE_CHECKING:  # the data module imports this module
    from lightning_sp.training.data.tokenizer import TokenizerInfo


@dataclass(frozen=True)
class Codec:
    """The run's tokenizer both ways: bytes (``tokenizer`` unset: ids 0-255 are UTF-8 bytes)
    or a ``tokenizers`` object (from the run's ``tokenizer.json``); ``eos_id`` ends a
    document."""

    eos_id: int
    tokenizer: Any = None

    @classmethod
    def from_info(cls, info: TokenizerInfo) -> Codec:
        """The codec of a data module's tokenizer (``TextDataModule.info``)."""
        if info.path is None:
            return cls(info.eos_id)
        from tokenizers import Tokenizer

        return cls(info.eos_id, Tokenizer.from_file(info.path))

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))


class PromptDataset(Dataset):
    """One sample per prompt: ``{"input_ids": LongTensor[n], "prompt": str}``."""

    def __init__(self, prompts: list[str], codec: Codec) -> None:
        self.prompts = list(prompts)
        self.ids = [torch.tensor(codec.encode(p), dtype=torch.long) for p in self.prompts]

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"input_ids": self.ids[index], "prompt": self.prompts[index]}


def prompt_dataloader(prompts: list[str], codec: Codec) -> DataLoader:
    """Batches of one prompt (prompts differ in length): ``{"input_ids": [1, n], "prompt":
    [str]}``."""
    return DataLoader(PromptDataset(prompts, codec), batch_size=1, shuffle=False)


class TextPredictionWriter(BasePredictionWriter):
    """Writes what ``GPTModule.predict_step`` returns as JSON lines, one per prompt, to
    ``output_dir/predictions_dp<rank>.jsonl`` (tensor-parallel rank 0 of each data-parallel
    replica writes; its TP peers generate the same text).

    Args:
        output_dir: Directory of the files (created if missing).
    """

    def __init__(self, output_dir: str = "predictions") -> None:
        super().__init__(write_interval="batch")
        self.output_dir = output_dir

    @override
    def write_on_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        prediction: Any,
        batch_indices: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        strategy, dp_rank = trainer.strategy, 0
        if isinstance(strategy, MegatronSPStrategy):
            state = strategy.parallel_state
            if state.tensor_parallel_rank != 0:
                return
            dp_rank = state.data_parallel_rank
        os.makedirs(self.output_dir, exist_ok=True)
        path = os.path.join(self.output_dir, f"predictions_dp{dp_rank}.jsonl")
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(prediction) + "\n")
