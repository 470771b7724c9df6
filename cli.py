"""``python cli.py <command>`` from the repository root: the package's command line,
:mod:`lightning_sp.cli.main` (installed as ``lightning-sp`` and ``python -m lightning_sp``)."""

from lightning_sp.cli.main import run

if __name__ == "__main__":
    run()
