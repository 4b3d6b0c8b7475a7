#!/usr/bin/env bash
# A bridge past its training length (issue 47, METHOD §2): at layer 1 of MODEL, a learned-
# position and a rotary bridge trained alike on pydoc sequences of 64 tokens (cpu-small, 1000 steps, seed 0);
# fidelity of both in length (the rule that fixes --positions' default reads these), of the rotary one on
# held-out pydoc sequences of 256 tokens by position bin, and Gen.PPL of its 192-token samples against the
# original's; scripts/long_context.py writes the table. About 25 min for smollm2-135m on 2 CPU cores.
#   bash scripts/long_context.sh [MODEL]     (MODEL=smollm2-135m or gemma3-270m; DIHAL_ROOT changes the store)
set -euo pipefail
export DIHAL_STRICT_CACHE=${DIHAL_STRICT_CACHE:-1}
cd "$(dirname "$0")/.."
MODEL=${1:-smollm2-135m}
export DIHAL_ROOT=${DIHAL_ROOT:-runs/long-context-$MODEL}
DEV="--device ${DEVICE:-cpu} --dtype ${DTYPE:-float32}"
STEPS=${STEPS:-1000}; SAMPLES=${SAMPLES:-32}
step() { echo "== $1 ($(date +%H:%M:%S))"; }

step "extract layers 0 and 1 of $MODEL on pydoc: 64 tokens (training) and 256 (held-out past the length)"
dihal extract --model "$MODEL" --layers 0,1 --seq-len 64 $DEV
E64=$(dihal runs latest extract)
dihal extract --model "$MODEL" --layers 0,1 --seq-len 256 $DEV
E256=$(dihal runs latest extract)

for POS in learned rotary; do
  step "train the $POS-position bridge at layer 1 ($STEPS steps)"
  dihal train-bridge --layer 1 --extract "$E64" --protocol cpu-small --train-steps "$STEPS" --positions "$POS" $DEV
  BRIDGE=$(dihal runs latest bridge)
  dihal evaluate --bridge "$BRIDGE" --sample-steps 8 $DEV                 # in length: its extract's held-out split
done
step "the rotary bridge on held-out sequences of 256 tokens, and its 192-token samples"
dihal evaluate --bridge "$BRIDGE" --extract "$E256" --sample-steps 8 --limit 64 $DEV
dihal generate --bridge "$BRIDGE" --num-samples "$SAMPLES" --max-new-tokens 191 --baseline original $DEV
dihal evaluate --samples "$(dihal runs latest generate)" $DEV
python3 scripts/long_context.py "$DIHAL_ROOT"
