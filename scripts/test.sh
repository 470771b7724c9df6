#!/usr/bin/env bash
# Set up (scripts/setup.sh), lint (ruff), type-check (mypy) and run the whole test suite.
# Extra arguments go to pytest (`-m "not slow"`: the quick tier, tests/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check lightning_sp tests cli.py benchmarks examples
ruff format --check lightning_sp tests cli.py benchmarks examples
mypy  # files and settings: [tool.mypy] in pyproject.toml
python -m pytest "$@"
