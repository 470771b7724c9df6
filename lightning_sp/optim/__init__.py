"""The optimizer: AdamW with fp32 master weights and its schedule (:mod:`.adamw`), the
distributed optimizer (ZeRO-1, :mod:`.distributed`), and the settings a resume applies
(:mod:`.resume`)."""
