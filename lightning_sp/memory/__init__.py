"""Memory and compute accounting: the paper's formulas (:mod:`.formulas`), saved-tensor
measurement (:mod:`.saved`), fake-tensor measurement at full scale (:mod:`.fake`) and FLOPs
(:mod:`.flops`)."""
