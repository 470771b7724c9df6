"""Prompts for ``predict`` / ``generate``: text <-> token ids with the run's tokenizer, and a
dataset of prompts (:class:`~lightning_sp.callbacks.predictions.TextPredictionWriter` writes
what the model generates from them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Dataset

if TYPE_CHECKING:  # the data module imports this module
    from lightning_sp.data.tokenizer import TokenizerInfo


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
