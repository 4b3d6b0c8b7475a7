#!/usr/bin/env bash
# METHOD §5 (revision 2) on the embedded default, CPU-sized: smollm2-135m on pydoc, every
# row of the comparison (Diffusion-LM, SED, CoDAR, LD4LG-style, DiHAL at l* and at argmin S, DiHAL-direct,
# and the references) from one prior per seed and budget, every part under `compare-cpu` with batch 16
# (the same for every part), the temperature grid 0, 0.7, 1.0 for every curve row and reference, oracle
# and null controls for SED (rounding), CoDAR, LD4LG-style, DiHAL and DiHAL-direct, 32-token sequences,
# primary evaluator gemma3-270m.
#   default   1x the protocol's steps with every row and 5x with the claim-3 rows (Diffusion-LM, SED, CoDAR,
#             LD4LG-style, DiHAL at l*, the references), both on seed 0; N = 48 samples per row,
#             temperature and seed; then the condition-noise ablation at 1x on seed 0 (sigma:0.5,
#             prior:0.5, prior:1.0 for CoDAR and DiHAL; scripts/ablation.py prints it). Traded for the
#             3-hour budget on 2 cores (measured stage times: a 5x seed costs about 90 min, a 1x seed 40):
#             batch 16 instead of 32 for every part; one seed (SEEDS_1X=0,1 NUM_SAMPLES=64 gives the
#             README's 1x table, about 50 min more); no argmin-S or DiHAL-direct row at 5x (diagnostics,
#             not baselines); N = 48 (the intervals show the cost).
#   QUICK=1   the same rows on seed 0, N = 16, one 30-step budget, 400 sequences, no ablation (a check
#             of the whole pipeline, not a result)
#   READOUTS  DiHAL (l*)'s readouts (METHOD §5.1), each but independent a row of its own with
#             DiHAL's controls; default independent,guided,refine:2,causal. The default run ends with the
#             gamma ablation {0, 0.25, 1, 4} of guided and causal at 1x on seed 0 (scripts/ablation.py).
#   MODEL     the backbone: smollm2-135m (evaluator gemma3-270m) or gemma3-270m (evaluator smollm2-135m);
#             each model's runs go to their own store.
#   ONE_PASS=1  claim 3's one-pass class only (issue 52): Diffusion-LM, SED, DiHAL independent and guided, with
#             SED's and DiHAL's controls, at 1x on seed 0, N = 48, every prior over h_0 trained with PRIOR_RECIPE
#             (default the recipe docs/results/prior.md chose: --prior-token-ce 0.1), in its own store.
# Results: $DIHAL_ROOT/compare/<id>/{summary,compare,controls,parts}.csv, compare.json, compare_x*.png;
# $DIHAL_ROOT/claims.md. DRY_RUN=1 validates the arguments only; NUM_SAMPLES, SEQ_LEN, PROTOCOL override.
set -euo pipefail
export DIHAL_STRICT_CACHE=${DIHAL_STRICT_CACHE:-1}  # a cached artifact made by other code is recomputed (issue 45)
cd "$(dirname "$0")/.."
DRY=$([ "${DRY_RUN:-0}" = 1 ] && echo --dry-run || true)
MODEL=${MODEL:-smollm2-135m}
case "$MODEL" in
  smollm2-135m) EVALUATOR=gemma3-270m ;;
  gemma3-270m) EVALUATOR=smollm2-135m ;;
  *) echo "error: MODEL=$MODEL; use smollm2-135m or gemma3-270m (each is the other's evaluator)" >&2; exit 2 ;;
esac
READOUTS=${READOUTS:-independent,guided,refine:2,causal}
start=$(date +%s)
compare() {  # each invocation's wall time goes to $DIHAL_ROOT/timings.tsv (a run timed in pieces adds up)
  local t0=$(date +%s)
  dihal compare --model "$MODEL" --dataset pydoc --protocol "${PROTOCOL:-compare-cpu}" \
    --seq-len "${SEQ_LEN:-32}" --prior-steps 50 --sample-steps 8 --temperatures 0,0.7,1.0 --top-p 1.0 \
    --evaluator "$EVALUATOR" --readout "$READOUTS" --device "${DEVICE:-cpu}" --dtype "${DTYPE:-float32}" $DRY "$@"
  [ -n "$DRY" ] || printf '%s\t%s\t%s\n' "$(date -u +%FT%TZ)" "$(( $(date +%s) - t0 ))" "$*" >>"$DIHAL_ROOT/timings.tsv"
}
if [ "${ONE_PASS:-0}" = 1 ]; then
  export DIHAL_ROOT=${DIHAL_ROOT:-runs/compare-${MODEL%%-*}-one-pass}
  # shellcheck disable=SC2086
  compare --seeds 0 --num-samples "${NUM_SAMPLES:-48}" --budgets 1 --train-batch 16 --condition-noise prior:0.5 \
    --rows diffusion-lm,sed,dihal --controls sed,dihal --readout independent,guided ${PRIOR_RECIPE:---prior-token-ce 0.1}
elif [ "${QUICK:-0}" = 1 ]; then
  export DIHAL_ROOT=${DIHAL_ROOT:-runs/compare-${MODEL%%-*}-quick}
  compare --seeds 0 --num-samples "${NUM_SAMPLES:-16}" --budgets 1 --train-steps 30 --max-sequences 400 \
    --condition-noise prior:0.5 --controls sed,codar,ld4lg,dihal,dihal-direct
else
  export DIHAL_ROOT=${DIHAL_ROOT:-runs/compare-${MODEL%%-*}}
  N=${NUM_SAMPLES:-48}
  compare --seeds "${SEEDS_1X:-0}" --num-samples "$N" --budgets 1 --train-batch 16 --condition-noise prior:0.5 \
    --controls sed,codar,ld4lg,dihal,dihal-direct
  compare --seeds 0 --num-samples "$N" --budgets 5 --train-batch 16 --condition-noise prior:0.5 \
    --rows diffusion-lm,sed,codar,ld4lg,dihal --controls sed,codar,ld4lg,dihal
  for noise in sigma:0.5 prior:0.5 prior:1.0; do  # the ablation on seed 0 (prior:0.5's parts are reused)
    compare --seeds 0 --num-samples "$N" --budgets 1 --train-batch 16 --condition-noise "$noise" \
      --rows codar,dihal --controls '' --readout independent
  done
  for gamma in 0 0.25 1 4; do  # the gamma ablation of METHOD §5.1 (gamma 1's rows are the 1x run's, reused)
    compare --seeds 0 --num-samples "$N" --budgets 1 --train-batch 16 --condition-noise prior:0.5 \
      --rows dihal --controls '' --readout independent,guided,causal --guidance "$gamma"
  done
  [ -n "$DRY" ] || python3 scripts/ablation.py "$DIHAL_ROOT" "$DIHAL_ROOT/ablation.md"
fi
[ -n "$DRY" ] || python3 scripts/summarize.py --claims "$DIHAL_ROOT/claims.md" "$DIHAL_ROOT"
echo "wall time: $(( $(date +%s) - start )) s"
