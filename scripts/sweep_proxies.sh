#!/usr/bin/env bash
# The two sweeps behind README's "Which predictor to trust": every predictor (S, each proxy, dihal's
# r2_token and r2_context, depth) against the sweep-tiny bridge loss of every layer, 2 seeds, on
# 800 pydoc sequences of 32 tokens. About 1 h 40 min per backbone on 2 CPU cores.
#   usage: scripts/sweep_proxies.sh smollm2-135m 1-29     scripts/sweep_proxies.sh gemma3-270m 1-17
#   SKIP_INIT=zero starts every bridge's skip A at zero instead of the ridge map r2_token measures
#   (issue 37's tautology check); it shares the extract and the score with the ridge sweep.
set -euo pipefail
export DIHAL_STRICT_CACHE=${DIHAL_STRICT_CACHE:-1}  # a cached artifact made by other code is recomputed (issue 45)
cd "$(dirname "$0")/.."
MODEL=$1
LAYERS=$2
export DIHAL_ROOT=${DIHAL_ROOT:-runs/sweep-$MODEL}
DEV="--device ${DEVICE:-cpu} --dtype ${DTYPE:-float32}"
dihal extract --model "$MODEL" --dataset pydoc --layers all --max-sequences 800 --seq-len 32 --store-dtype auto $DEV
EXTRACT=$(dihal runs latest extract)
dihal score --extract "$EXTRACT" --tokens 4096 --bootstrap 5 --outlier-mads 5
dihal sweep --layers "$LAYERS" --protocol sweep-tiny --seeds 0,1 --train-steps 100 --extract "$EXTRACT" \
  --score "$(dihal runs latest score)" --skip-init "${SKIP_INIT:-ridge}" $DEV
