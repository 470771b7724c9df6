"""How a run ends, on every rank at once: signals and dead ranks (:mod:`.shutdown`), errors found
after launch agreed by every rank (:mod:`.agree`), the non-finite guard (:mod:`.guard`)."""
