#!/usr/bin/env bash
# The test command of README.md: set-up, lint and format check, then the whole suite (both tiers, in parallel).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m ruff check .
python3 -m ruff format --check .
python3 -m pytest -q -m "slow or not slow" "$@"
