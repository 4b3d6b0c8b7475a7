#!/usr/bin/env bash
# dihal's GPU paths at the paper's shapes, proven in one run the first time a GPU is at hand: on random-weight
# models of Llama-3.1-8B's and Qwen3-8B's shapes (D = 4096, vocabularies of 128k and 152k), --device cuda
# --dtype bfloat16 through extract, score, train-bridge (cpu-small, then the paper protocol), fidelity, AR
# generation, Gen.PPL, train-prior, parallel generation, a QUICK compare and, with two GPUs or more, torchrun.
# Each step prints its wall time, throughput and peak GPU memory, and a check that it ran on CUDA in bfloat16
# with finite numbers; the first failure stops the run (scripts/gpu_smoke.py). Measured on one H200 (2026-12-04):
# the Llama-shaped chain up to parallel rounding took 9.1 min, 10 with its random models
# (docs/results/paper_scale.md); give the whole run 25 min, or --models llama-3.1-8b for half.
#
#   here, once:          bash scripts/gpu_wheels.sh      (wheels into .whl/, the builtin's tokenizer into .gpu/)
#   on the GPU machine:  bash scripts/gpu_smoke.sh       (carry .whl and .gpu; no network, no install needed)
#   rehearsal on a CPU:  DEVICE=cpu bash scripts/gpu_smoke.sh     (small blocks, the real vocabularies)
set -euo pipefail
source "$(dirname "$0")/gpu_env.sh"  # wheels, dihal from this checkout, $TOKENIZER
ARGS=(--root "${DIHAL_ROOT:-runs/gpu-smoke-${DEVICE:-cuda}}" --device "${DEVICE:-cuda}" --dtype "${DTYPE:-bfloat16}")
[ -n "$TOKENIZER" ] && ARGS+=(--tokenizer "$TOKENIZER")
if [ "${DEVICE:-cuda}" = cpu ]; then  # the rehearsal: blocks of width 64, few sequences and steps
  ARGS+=(--layers 3 --sequences 96 --seq-len 32 --steps 20 --paper-steps 2 --samples 8 --tokens 1024
         --shrink "--hidden 64 --intermediate 128 --heads 4 --kv-heads 2")
fi
exec python3 scripts/gpu_smoke.py "${ARGS[@]}" "$@"
