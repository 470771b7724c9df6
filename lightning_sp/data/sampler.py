"""The training sampler: a seeded order per epoch, sharded over data-parallel replicas, with a
plain-dict state for exact mid-epoch resume; the ``DataLoader`` whose state is the sampler's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_sp.data.order import SampleOrder
from lightning_sp.errors import ConfigError

_CHUNK = 8192
"""Indices computed per step of the iterator."""


class ResumableSampler(DistributedSampler):
    """Replica ``rank`` of ``num_replicas`` reads positions ``rank, rank + R, rank + 2R, ...``
    of each epoch's :class:`SampleOrder` (``len(order) // R`` of them; the rest is dropped).

    ``num_replicas``/``rank`` are the data-parallel size and rank: the tensor- and
    pipeline-parallel ranks of one replica read the same samples. It subclasses
    ``DistributedSampler`` only so that Lightning keeps it instead of inserting its own.

    The owner reports consumed batches with :meth:`advance`; :meth:`state_dict` is then the
    position to resume from, counted in samples over all replicas (so it holds on another
    data-parallel size too, up to the rounding to whole rounds of ``R``).
    """

    def __init__(self, dataset: Dataset, order: SampleOrder, num_replicas: int, rank: int) -> None:
        super().__init__(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=order.seed
        )
        self.order = order
        self.num_samples = len(order) // num_replicas
        self.total_size = self.num_samples * num_replicas
        self.consumed_samples = 0
        self._resume: dict[str, Any] | None = None

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        start = 0
        if self._resume is not None and self._resume["epoch"] == self.epoch:
            start = min(self._resume["consumed_samples"] // self.num_replicas, self.num_samples)
        self._resume = None
        self.consumed_samples = start * self.num_replicas
        for first in range(start, self.num_samples, _CHUNK):
            rounds = np.arange(first, min(first + _CHUNK, self.num_samples), dtype=np.int64)
            yield from self.order(self.epoch, self.rank + self.num_replicas * rounds).tolist()

    def advance(self, samples: int) -> None:
        """Record that this replica trained on ``samples`` more samples (each replica the
        same number)."""
        self.consumed_samples += samples * self.num_replicas

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "consumed_samples", "epoch_samples", "seed"}``: plain ints."""
        return {
            "epoch": int(self.epoch),
            "consumed_samples": int(self.consumed_samples),
            "epoch_samples": len(self.order),
            "seed": int(self.order.seed),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue epoch ``state["epoch"]`` after its consumed samples (the next iteration
        of that epoch only; later epochs are whole).

        Raises:
            ConfigError: the state was saved for a different order (data, blend or seed).
        """
        mine = (len(self.order), int(self.order.seed))
        theirs = (int(state["epoch_samples"]), int(state["seed"]))
        if mine != theirs:
            raise ConfigError(
                f"the checkpoint's data order ({theirs[0]} samples per epoch, seed {theirs[1]}) "
                f"differs from this data ({mine[0]} samples per epoch, seed {mine[1]}); "
                "resume with the data, seq_length, blend and seed it was trained with"
            )
        self._resume = dict(state)
        self.epoch = int(state["epoch"])


class ResumableLoader(DataLoader):
    """A ``DataLoader`` whose state is its :class:`ResumableSampler`'s, so Lightning's fit loop
    knows the training data resumes mid-epoch (the datamodule's ``state_dict`` holds the same)."""

    def state_dict(self) -> dict[str, int]:
        assert isinstance(self.sampler, ResumableSampler)
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        assert isinstance(self.sampler, ResumableSampler)
        self.sampler.load_state_dict(state)
