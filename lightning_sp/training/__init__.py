"""Lightning integration: the ``megatron_sp`` strategy, the GPT LightningModule, callbacks,
data and the optimizer."""
