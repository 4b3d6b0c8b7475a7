#!/usr/bin/env bash
# docs/method.md section 5 (revision 2) on the embedded default, CPU-sized: smollm2-135m on pydoc, every
# row of the comparison (Diffusion-LM, SED, CoDAR, DiHAL at l* and at argmin S, DiHAL-direct, and the
# references) from one prior per seed and budget, every part under `compare-cpu` at 1x and 5x its steps,
# the temperature grid 0, 0.7, 1.0 for every curve row and reference, oracle and null controls for SED
# (rounding), CoDAR, DiHAL and DiHAL-direct, on 32-token sequences. Primary evaluator: gemma3-270m.
#   default   2 seeds, N = 64 samples per row, temperature and seed (what was traded for the 3-hour
#             budget: N, not rows or budgets; the intervals say how much that costs)
#   QUICK=1   the same rows on one seed, N = 24, a 40-step base budget (1x and 5x), 600 sequences
# Then the condition-noise ablation (sigma:0.5, prior:0.5, prior:1.0 at 1x; scripts/ablation.py prints it).
# Results: $DIHAL_ROOT/compare/<id>/{summary,compare,controls,parts}.csv, compare.json, compare_x*.png.
#   DRY_RUN=1 validates the arguments only; SEEDS, NUM_SAMPLES, SEQ_LEN, PROTOCOL, BUDGETS override.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${QUICK:-0}" = 1 ]; then
  export DIHAL_ROOT=${DIHAL_ROOT:-runs/compare-smollm2-quick}
  SEEDS=${SEEDS:-0} NUM_SAMPLES=${NUM_SAMPLES:-24} EXTRA=(--train-steps 40 --max-sequences 600)
else
  export DIHAL_ROOT=${DIHAL_ROOT:-runs/compare-smollm2}
  SEEDS=${SEEDS:-0,1} NUM_SAMPLES=${NUM_SAMPLES:-64} EXTRA=()
fi
DRY=$([ "${DRY_RUN:-0}" = 1 ] && echo --dry-run || true)
start=$(date +%s)
dihal compare --model smollm2-135m --dataset pydoc --protocol "${PROTOCOL:-compare-cpu}" --seeds "$SEEDS" \
  --seq-len "${SEQ_LEN:-32}" --num-samples "$NUM_SAMPLES" --prior-steps 50 --sample-steps 8 \
  --condition-noise prior:0.5 --temperatures 0,0.7,1.0 --top-p 1.0 --budgets "${BUDGETS:-1,5}" \
  --controls sed,codar,dihal,dihal-direct --evaluator gemma3-270m "${EXTRA[@]}" \
  --device "${DEVICE:-cpu}" --dtype "${DTYPE:-float32}" $DRY
# the condition-noise ablation at 1x for the two trained recoveries (CoDAR's decoder, DiHAL's bridge):
# prior:0.5 (above) against sigma:0.5 (revision 1) and prior:1.0; the priors and the extract are reused
for noise in sigma:0.5 prior:1.0; do
  dihal compare --model smollm2-135m --dataset pydoc --protocol "${PROTOCOL:-compare-cpu}" --seeds "$SEEDS" \
    --seq-len "${SEQ_LEN:-32}" --num-samples "$NUM_SAMPLES" --prior-steps 50 --sample-steps 8 \
    --condition-noise "$noise" --temperatures 0,0.7,1.0 --top-p 1.0 --budgets 1 --rows codar,dihal \
    --controls '' --evaluator gemma3-270m "${EXTRA[@]}" --device "${DEVICE:-cpu}" --dtype "${DTYPE:-float32}" $DRY
done
[ -n "$DRY" ] || python3 scripts/summarize.py --claims "$DIHAL_ROOT/claims.md" "$DIHAL_ROOT"
[ -n "$DRY" ] || python3 scripts/ablation.py "$DIHAL_ROOT"
echo "wall time: $(( $(date +%s) - start )) s"
