#!/usr/bin/env bash
# The whole DiHAL chain on one CPU-sized builtin model and the builtin pydoc corpus:
# extract -> score (with BOOTSTRAP draws and the robust proxies) -> train-bridge at l* (on pydoc and,
# at share OWN_TEXT, the backbone's own unprompted samples: README, "Training on the model's own text") -> fidelity on
# pydoc, on another domain (this repository's own markdown) and on the backbone's own samples
# -> generate hybrid and original -> evaluate samples -> (sweep with sweep-tiny over SWEEP_SEEDS,
# then claim 4: l*, the oracle and the worst layer under cpu-small over CONFIRM_SEEDS) -> summary.
#   usage: scripts/reproduce_cpu.sh MODEL SWEEP_LAYERS     (SKIP_SWEEP=1 leaves the sweep and claim 4
#          out; DRY_RUN=1 validates every stage's arguments with --dry-run)
set -euo pipefail
export DIHAL_STRICT_CACHE=${DIHAL_STRICT_CACHE:-1}  # a cached artifact made by other code is recomputed (issue 45)
cd "$(dirname "$0")/.."
MODEL=$1
SWEEP_LAYERS=$2
export DIHAL_ROOT=${DIHAL_ROOT:-runs/$MODEL}
DEV="--device ${DEVICE:-cpu} --dtype ${DTYPE:-float32}"
SEQ_LEN=${SEQ_LEN:-64}
dry() { [ "${DRY_RUN:-0}" = 1 ]; }
DRY=$(dry && echo --dry-run || true)
latest() { if dry; then echo latest; else dihal runs latest "$1"; fi; }

echo "== 1. extract every layer (sample for the score and the sweep)"
dihal extract --model "$MODEL" --dataset pydoc --layers all --max-sequences ${MAX_SEQUENCES:-1200} --seq-len $SEQ_LEN \
  --store-dtype ${STORE_DTYPE:-auto} $DEV $DRY
EXTRACT=$(latest extract)

echo "== 2. score the layers: the paper's S, its stability over BOOTSTRAP draws, and the robust proxies"
SCORE_ARGS="--tokens ${TOKENS:-4096} --bootstrap ${BOOTSTRAP:-8} --outlier-mads ${OUTLIER_MADS:-5}"
dihal score --extract "$EXTRACT" $SCORE_ARGS $DRY
SCORE=$(latest score)
if dry; then LSTAR=3; else
  LSTAR=$(dihal score --extract "$EXTRACT" $SCORE_ARGS --json | python3 -c "import json,sys; print(json.load(sys.stdin)['l_star'])")
fi
echo "l* = $LSTAR"

OWN_TEXT=${OWN_TEXT:-0.5}  # the measured recipe; 0 trains on pydoc alone, as the paper does
echo "== 3. train the bridge at l* (cpu-small protocol; pydoc and, at share $OWN_TEXT, the model's own samples)"
dihal train-bridge --layer "$LSTAR" --protocol cpu-small --model "$MODEL" --dataset pydoc --seq-len $SEQ_LEN \
  --own-text "$OWN_TEXT" --store-dtype ${STORE_DTYPE:-auto} $DEV $DRY ${BRIDGE_ARGS:-}
BRIDGE=$(latest bridge)

echo "== 4. bridge fidelity (teacher forced): held-out pydoc, then another domain (this repository's prose)"
dihal evaluate --bridge "$BRIDGE" --sample-steps 1,4,8,16 --limit 64 $DEV $DRY
OTHER=${OTHER_DATASET:-$DIHAL_ROOT/repo-prose.txt}  # any dataset spec; by default the repository's markdown
[ -n "${OTHER_DATASET:-}" ] || { mkdir -p "$DIHAL_ROOT"; cat README.md docs/*.md > "$OTHER"; }
dihal evaluate --bridge "$BRIDGE" --dataset "$OTHER" --sample-steps 1,4,8,16 --limit 64 $DEV $DRY

echo "== 5. generate with the hybrid and the original backbone"
dihal generate --bridge "$BRIDGE" --num-samples ${NUM_SAMPLES:-16} --max-new-tokens 48 --sample-steps 8 --top-p 0.95 \
  --baseline original --prompt "The" --prompt "This module" $DEV $DRY
GENERATE=$(latest generate)

echo "== 6. generation quality (Gen.PPL under the original backbone, diversity)"
dihal evaluate --samples "$GENERATE" $DEV $DRY

echo "== 6b. fidelity on the backbone's own (unprompted) samples: where free running leaves the training text"
dihal generate --bridge "$BRIDGE" --num-samples 64 --max-new-tokens $((SEQ_LEN - 1)) --sample-steps 8 --baseline original \
  $DEV $DRY
dihal evaluate --bridge "$BRIDGE" --samples "$(latest generate)" --sample-steps 1,4,8,16 --limit 64 $DEV $DRY

if [ "${SKIP_SWEEP:-0}" != 1 ]; then
  echo "== 7. sweep: a sweep-tiny bridge per layer and seed; every predictor's rho with its interval"
  dihal sweep --layers "$SWEEP_LAYERS" --protocol sweep-tiny --seeds ${SWEEP_SEEDS:-0,1,2} --extract "$EXTRACT" \
    --score "$SCORE" $DEV $DRY ${SWEEP_ARGS:-}
  echo "== 8. claim 4: l*, the oracle and the worst layer under cpu-small, per seed"
  dihal confirm --sweep "$(latest sweep)" --protocol cpu-small --seeds ${CONFIRM_SEEDS:-0,1,2} \
    --num-samples ${CONFIRM_SAMPLES:-64} $DEV $DRY
fi

dry || python3 scripts/summarize.py "$DIHAL_ROOT" "$DIHAL_ROOT/summary.md"
dry || python3 scripts/summarize.py --claims "$DIHAL_ROOT/claims.md" "$DIHAL_ROOT"
