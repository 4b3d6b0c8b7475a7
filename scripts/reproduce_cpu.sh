#!/usr/bin/env bash
# The whole DiHAL chain on one CPU-sized builtin model and the builtin pydoc corpus:
# extract -> score -> train-bridge at l* -> evaluate bridge -> generate hybrid and original
# -> evaluate samples -> (sweep with sweep-tiny) -> summary table.
#   usage: scripts/reproduce_cpu.sh MODEL SWEEP_LAYERS     (SKIP_SWEEP=1 leaves the sweep out;
#          DRY_RUN=1 validates every stage's arguments with --dry-run)
set -euo pipefail
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

echo "== 2. score the layers"
dihal score --extract "$EXTRACT" --tokens ${TOKENS:-4096} $DRY
SCORE=$(latest score)
if dry; then LSTAR=3; else
  LSTAR=$(dihal score --extract "$EXTRACT" --tokens ${TOKENS:-4096} --json | python3 -c "import json,sys; print(json.load(sys.stdin)['l_star'])")
fi
echo "l* = $LSTAR"

echo "== 3. train the bridge at l* (cpu-small protocol, all of pydoc)"
dihal train-bridge --layer "$LSTAR" --protocol cpu-small --model "$MODEL" --dataset pydoc --seq-len $SEQ_LEN \
  --store-dtype ${STORE_DTYPE:-auto} $DEV $DRY ${BRIDGE_ARGS:-}
BRIDGE=$(latest bridge)

echo "== 4. bridge fidelity (teacher forced, held-out sequences)"
dihal evaluate --bridge "$BRIDGE" --sample-steps 4,8,16 --limit 64 $DEV $DRY

echo "== 5. generate with the hybrid and the original backbone"
dihal generate --bridge "$BRIDGE" --num-samples ${NUM_SAMPLES:-16} --max-new-tokens 48 --sample-steps 8 --top-p 0.95 \
  --baseline original --prompt "The" --prompt "This module" $DEV $DRY
GENERATE=$(latest generate)

echo "== 6. generation quality (Gen.PPL under the original backbone, diversity)"
dihal evaluate --samples "$GENERATE" $DEV $DRY

if [ "${SKIP_SWEEP:-0}" != 1 ]; then
  echo "== 7. sweep: a sweep-tiny bridge per layer, Spearman rho against S"
  dihal sweep --layers "$SWEEP_LAYERS" --protocol sweep-tiny --extract "$EXTRACT" --score "$SCORE" $DEV $DRY ${SWEEP_ARGS:-}
fi

dry || python3 scripts/summarize.py "$DIHAL_ROOT" "$DIHAL_ROOT/summary.md"
