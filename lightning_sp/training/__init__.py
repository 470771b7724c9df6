"""The Lightning adapter: the ``megatron_sp`` strategy (:mod:`.strategy`), the processes it starts
(:mod:`.processes`), what it drives (:mod:`.protocol`), the GPT LightningModule
(:mod:`.gpt_module`, its bases :mod:`.shard_module`, :mod:`.checkpoint_hooks` and
:mod:`.optimizer_hooks`) and the checks both run on their arguments (:mod:`.checks`)."""
