#!/usr/bin/env bash
# docs/method.md section 5 on the embedded default, CPU-sized: smollm2-135m on pydoc, every row of
# the comparison (Diffusion-LM, SED, CoDAR, DiHAL at l* and at argmin S, DiHAL-direct, and the
# references) from one prior per seed, every trained part under the `compare-cpu` protocol
# (200 steps x 32 sequences) on 32-token sequences (the start token and 31 more; 64 would not fit
# the 2-hour CPU budget), N = 256 samples per row and seed, two seeds. Second evaluator: gemma3-270m.
# Results: runs/compare-smollm2/compare/<id>/compare.{csv,json,png}.
#   DRY_RUN=1 validates the arguments only; SEEDS, NUM_SAMPLES, SEQ_LEN, PROTOCOL override.
set -euo pipefail
cd "$(dirname "$0")/.."
export DIHAL_ROOT=${DIHAL_ROOT:-runs/compare-smollm2}
DRY=$([ "${DRY_RUN:-0}" = 1 ] && echo --dry-run || true)
start=$(date +%s)
dihal compare --model smollm2-135m --dataset pydoc --protocol "${PROTOCOL:-compare-cpu}" --seeds "${SEEDS:-0,1}" \
  --seq-len "${SEQ_LEN:-32}" --num-samples "${NUM_SAMPLES:-256}" --prior-steps 50 --sample-steps 8 \
  --condition-noise 0.5 \
  --evaluator gemma3-270m --device "${DEVICE:-cpu}" --dtype "${DTYPE:-float32}" $DRY
echo "wall time: $(( $(date +%s) - start )) s"
