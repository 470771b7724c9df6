"""The memory planner: ``cli.py estimate`` and ``recompute: auto``."""
