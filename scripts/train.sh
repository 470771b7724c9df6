#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: the tiny GPT on 2 CPU processes
# (tensor parallel 2, sequence parallel, selective recompute). Extra arguments go to cli.py fit.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python cli.py fit --config configs/tiny.yaml "$@"
