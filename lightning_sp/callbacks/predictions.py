"""``TextPredictionWriter``: the text ``predict`` generates, as JSON lines."""

from __future__ import annotations

import json
import os
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter
from typing_extensions import override

from lightning_sp.training.strategy import MegatronSPStrategy


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
