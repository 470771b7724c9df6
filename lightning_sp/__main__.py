"""``python -m lightning_sp <command>``: the command line (:mod:`lightning_sp.cli.main`)."""

from lightning_sp.cli.main import run

if __name__ == "__main__":
    run()
