"""Your own tensor/sequence-parallel model on lightning_sp's layers, trained by the strategy.

    python examples/custom_mlp.py      # t=2 with sequence parallelism on 2 CPU processes

``ParallelMLP`` is a stack of pre-LayerNorm residual MLP blocks, ``x + drop(W2 gelu(W1 ln(x)))``,
built from ``lightning_sp.parallel``:

* ``ColumnParallelLinear`` (W1, output features split over the TP group) and
  ``RowParallelLinear`` (W2, input features split), whose conjugate communication (f / f̄, or
  g / ḡ under sequence parallelism) is inside the layers;
* ``scatter_to_sequence_parallel`` / ``gather_from_sequence_parallel`` at the edges of the
  sequence-parallel region;
* ``RNGStreams``: dropout on a sequence shard draws from the ``sharded`` stream, on a
  replicated tensor from the ``replicated`` one;
* ``mark_parameter`` / ``initialize_parameter``: every layout holds slices of the same model
  (LayerNorm parameters are marked ``sequence_parallel`` so their partial gradients are summed
  over the TP group).

``CustomMLPModule`` implements :class:`lightning_sp.training.protocol.ParallelModule`: the
strategy pushes the parallel state and layout in (``setup_parallel``), the module builds this
rank's shard from them in ``configure_model`` and returns it from ``stage_model()``; the
shard's ``finalize_grads`` is what the strategy calls after backward. Layouts are
``[s, b, h]`` (``[s/t, b, h]`` inside the sequence-parallel region).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_sp.parallel.buffer import GradBuffer
from lightning_sp.parallel.comm import gather_from_sequence_parallel, scatter_to_sequence_parallel
from lightning_sp.parallel.config import ParallelConfig
from lightning_sp.parallel.grads import finalize_grads
from lightning_sp.parallel.init import initialize_parameter, mark_parameter
from lightning_sp.parallel.layers import ColumnParallelLinear, RowParallelLinear
from lightning_sp.parallel.random import RNGStreams, dropout
from lightning_sp.parallel.state import ParallelState


class ParallelMLP(nn.Module):
    """One rank's shard of ``num_blocks`` residual MLP blocks of width ``hidden`` -> ``ffn``.

    ``forward(x [b, s, h], target [b, s, h]) -> mean squared error`` (a scalar, equal on every
    rank). With ``sequence_parallel`` the sequence length must be divisible by ``t``.
    """

    def __init__(
        self,
        state: ParallelState,
        *,
        hidden: int = 32,
        ffn: int = 128,
        num_blocks: int = 2,
        sequence_parallel: bool = True,
        dropout_p: float = 0.0,
        seed: int = 1234,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.state, self.sequence_parallel, self.dropout_p = state, sequence_parallel, dropout_p
        self.rng = RNGStreams(seed, state)
        sp, device = sequence_parallel, state.device
        kwargs: dict[str, Any] = {"sequence_parallel": sp, "dtype": dtype, "device": device}
        norms = [nn.LayerNorm(hidden, dtype=dtype, device=device) for _ in range(num_blocks)]
        for norm in norms:  # replicated over TP; applied to a sequence shard under SP
            mark_parameter(norm.weight, init="ones", sequence_parallel=sp)
            mark_parameter(norm.bias, init="zeros", sequence_parallel=sp)
        self.norms = nn.ModuleList(norms)
        self.fc1 = nn.ModuleList(
            ColumnParallelLinear(hidden, ffn, state, **kwargs) for _ in range(num_blocks)
        )
        self.fc2 = nn.ModuleList(
            RowParallelLinear(ffn, hidden, state, **kwargs) for _ in range(num_blocks)
        )
        for name, param in self.named_parameters():  # layout-independent: slices of one model
            initialize_parameter(param, name, seed)

    def forward(self, x: Tensor, target: Tensor) -> Tensor:
        group = self.state.tp_group
        h = x.transpose(0, 1)  # [b, s, h] -> [s, b, h], replicated
        if self.sequence_parallel:
            h = scatter_to_sequence_parallel(h, group)  # [s/t, b, h]
        generator = self.rng.sharded if self.sequence_parallel else self.rng.replicated
        for norm, fc1, fc2 in zip(self.norms, self.fc1, self.fc2, strict=True):
            inner = nn.functional.gelu(fc1(norm(h)))  # [s, b, ffn/t]
            h = h + dropout(fc2(inner), self.dropout_p, generator, self.training)  # [s/t|s, b, h]
        if self.sequence_parallel:
            h = gather_from_sequence_parallel(h, group)  # [s, b, h]
        return nn.functional.mse_loss(h, target.transpose(0, 1))

    def finalize_grads(self, buffer: GradBuffer | None = None) -> None:
        """LayerNorm / row-parallel-bias gradients summed over TP (under SP), all averaged
        over DP (through the optimizer's gradient ``buffer``, if it has one): the
        :class:`~lightning_sp.training.protocol.StageModel` contract."""
        finalize_grads(self, self.state, buffer)


def regression_data(samples: int = 64, seq: int = 8, hidden: int = 32) -> TensorDataset:
    """Seeded inputs ``[n, s, h]`` and targets ``sin(x)`` (the same on every rank)."""
    x = torch.randn(samples, seq, hidden, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, torch.sin(x))


class CustomMLPModule(LightningModule):
    """Trains :class:`ParallelMLP` with any ``megatron_sp`` layout of ``p = 1``, or on one
    process under any other strategy (the :class:`~lightning_sp.training.protocol.ParallelModule`
    protocol: the strategy pushes the state and layout in through :meth:`setup_parallel`)."""

    supports_pipeline_parallel = False

    def __init__(
        self,
        hidden: int = 32,
        dropout_p: float = 0.0,
        lr: float = 1e-2,
        sequence_parallel: bool = True,
    ) -> None:
        super().__init__()
        self.hidden, self.dropout_p, self.lr = hidden, dropout_p, lr
        self._sequence_parallel = sequence_parallel
        self._parallel: tuple[ParallelState, ParallelConfig] | None = None
        self.mlp: ParallelMLP | None = None

    @property
    def sequence_parallel(self) -> bool:
        """Whether the shard is sequence parallel under ``megatron_sp`` (this module's own
        setting, as ``GPTModule``'s is ``model.config.sequence_parallel``)."""
        return self._sequence_parallel

    def setup_parallel(self, state: ParallelState, config: ParallelConfig) -> None:
        """Receive this rank's state and the run's layout (before ``configure_model``)."""
        self._parallel = (state, config)

    @override
    def configure_model(self) -> None:
        if self.mlp is not None:
            return
        if self._parallel is not None:  # under megatron_sp
            state, sp = self._parallel[0], self._sequence_parallel
        else:
            state, sp = ParallelState.single(self.device), False
        dtype = torch.get_default_dtype()
        self.mlp = ParallelMLP(
            state, hidden=self.hidden, sequence_parallel=sp, dropout_p=self.dropout_p, dtype=dtype
        )

    def stage_model(self) -> ParallelMLP:
        """This rank's shard (the ``ParallelModule`` protocol)."""
        if self.mlp is None:
            raise RuntimeError("the model is created in configure_model")
        return self.mlp

    @override
    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = self.stage_model()(x, y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    @override
    def train_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(hidden=self.hidden), batch_size=8)


if __name__ == "__main__":
    import lightning as L

    from lightning_sp.training.strategy import MegatronSPStrategy

    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        max_steps=20,
        strategy=MegatronSPStrategy(tensor_parallel_size=2),
        enable_checkpointing=False,
        logger=False,
    )
    trainer.fit(CustomMLPModule())
    print(f"final loss {float(trainer.callback_metrics['train/loss']):.4f}")
