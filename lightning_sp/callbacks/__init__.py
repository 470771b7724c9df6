"""Lightning callbacks: activation memory per layer (:mod:`.memory`), throughput and MFU
(:mod:`.throughput`), the progress bar (:mod:`.progress`), the checkpoint callback whose
``last.ckpt`` continues the run (:mod:`.model_checkpoint`), the prediction writer
(:mod:`.predictions`), and what they read from a run (:mod:`.monitoring`)."""
