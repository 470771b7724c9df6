"""Memory and compute accounting: the paper's activation formulas (:mod:`.formulas`), model
state (:mod:`.model_state`: parameters, gradients, optimizer state), saved-tensor measurement
(:mod:`.saved`), fake-tensor measurement at full scale (:mod:`.fake`) and FLOPs
(:mod:`.flops`)."""
