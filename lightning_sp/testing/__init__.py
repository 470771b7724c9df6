"""Helpers shared by the test suite and the benchmarks (which must not import ``tests``)."""
