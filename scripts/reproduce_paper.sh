#!/usr/bin/env bash
# The paper's setting: Llama-3.1-8B-Instruct and Qwen3-8B on Dolma v1.7, GPU-sized.
# It needs the hub (or a populated HF cache) and a GPU. DRY_RUN=1 validates every stage's
# arguments offline without loading weights or data.
#
# On a GPU node, every command under torchrun (each one splits its work or runs on rank 0):
#   DIHAL="torchrun --nproc_per_node 8 -m dihal.cli" bash scripts/reproduce_paper.sh
# The sizes below are the paper's; each can be set from the environment (tests/test_paper_script.py runs
# this script itself on tiny random models of both shapes, over local Dolma-format shards, that way).
set -euo pipefail
export DIHAL_STRICT_CACHE=${DIHAL_STRICT_CACHE:-1}  # a cached artifact made by other code is recomputed (issue 45)
cd "$(dirname "$0")/.."
[ "${DRY_RUN:-0}" = 1 ] && export HF_HUB_OFFLINE=1
dry() { [ "${DRY_RUN:-0}" = 1 ]; }
DRY=$(dry && echo --dry-run || true)
DIHAL=${DIHAL:-dihal}                       # the command each stage runs with (torchrun ... -m dihal.cli)
DEVICE=${DEVICE:-cuda}
DEV="--device $DEVICE --dtype ${DTYPE:-bfloat16} $DRY"
DATASET=${DATASET:-dolma:v1_7}              # Dolma v1.7 as published: its URL list on the hub (docs/guide.md)
SEQUENCES=${SEQUENCES:-20000}; SEQ_LEN=${SEQ_LEN:-128}; BATCH=${BATCH:-32}; TOKENS=${TOKENS:-4096}
EVAL_LIMIT=${EVAL_LIMIT:-256}; LIMIT=${LIMIT:-512}; EVAL_STEPS=${EVAL_STEPS:-4,8,16,32}; SAMPLE_STEPS=${SAMPLE_STEPS:-16}
NUM_SAMPLES=${NUM_SAMPLES:-1000}; GEN_BATCH=${GEN_BATCH:-50}; MAX_NEW=${MAX_NEW:-$((SEQ_LEN - 1))}
SEEDS=${SEEDS:-0,1,2}; BUDGETS=${BUDGETS:-1,5}; COMPARE_SAMPLES=${COMPARE_SAMPLES:-256}; PRIOR_STEPS=${PRIOR_STEPS:-50}
COMPARE_BATCH=${COMPARE_BATCH:-64}; TEMPERATURES=${TEMPERATURES:-0,0.7,1.0}; CONTROLS=${CONTROLS:-sed,codar,dihal,dihal-direct}
RECIPE=${RECIPE:-}                          # recipe flags on top of --protocol paper (a CPU rehearsal shrinks it)
# where the trained parts' states come from: model (the backbone's first l blocks on the device, its embedding for
# layer 0; the score reads its pool of every layer of SCORE_SEQUENCES sequences, the rest only token ids: issue 64)
# or store (every layer of every sequence extracted: 659 GiB for Llama-3.1-8B, scripts/estimate.py)
STATES=${STATES:-model}; SCORE_SEQUENCES=${SCORE_SEQUENCES:-1024}
# what each complete part keeps: its EMA weights in bfloat16 (a quarter of final+ema's bytes), so the node's disk
# holds the sweep's 31-35 bridges and the comparison's 54 parts (scripts/estimate.py: peak 37.5-58.6 GiB)
KEEP_WEIGHTS=${KEEP_WEIGHTS:-ema-bfloat16}
# model, candidate layers, its shapes for the estimate printed first (scripts/make_random_model.py's configs),
# one a line
MODELS=${MODELS:-"meta-llama/Llama-3.1-8B-Instruct 1-31 llama-3.1-8b
Qwen/Qwen3-8B 1-35 qwen3-8b"}
ONLY=${ONLY:-}                               # run one backbone of the list (e.g. each on its own node); the
                                            # others stay its compare evaluator
latest() { if dry; then echo latest; else dihal runs latest "$1"; fi; }

while read -r -u 3 MODEL LAYERS LIKE; do
  [ -n "$MODEL" ] || continue
  [ -z "$ONLY" ] || [ "$MODEL" = "$ONLY" ] || continue
  export DIHAL_ROOT=${ROOT_BASE:-runs/paper}/$(basename "$MODEL")
  echo "== $MODEL"
  python3 scripts/estimate.py --model "$MODEL" --like "$LIKE" --sequences "$SEQUENCES" --seq-len "$SEQ_LEN" \
    --seeds "$SEEDS" --budgets "$BUDGETS" --compare-samples "$COMPARE_SAMPLES"
  extract() { $DIHAL extract --model "$MODEL" --dataset "$DATASET" --text-field text --seq-len "$SEQ_LEN" \
    --batch-size "$BATCH" $DEV "$@"; }
  if [ "$STATES" = model ]; then  # the score's pool of every layer of a few sequences, the token ids of all
    extract --layers all --keep pool --max-sequences "$SCORE_SEQUENCES"
    SCORED=$(latest extract)
    extract --layers none --max-sequences "$SEQUENCES"
  else
    extract --layers all --max-sequences "$SEQUENCES"
    SCORED=$(latest extract)
  fi
  EXTRACT=$(latest extract)
  $DIHAL score --extract "$SCORED" --tokens "$TOKENS" --device "$DEVICE" $DRY
  SCORE=$(latest score)
  if dry; then LSTAR=3; else
    LSTAR=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['metrics']['l_star'])" "$DIHAL_ROOT/score/$SCORE/manifest.json")
  fi
  $DIHAL sweep --layers "$LAYERS" --protocol paper $RECIPE --extract "$EXTRACT" --score "$SCORE" \
    --states "$STATES" --keep-weights "$KEEP_WEIGHTS" --eval-limit "$EVAL_LIMIT" $DEV
  SWEEP=$(latest sweep)
  if dry; then BRIDGE=latest; else  # the sweep's bridge at l* (its first seed), read through the store's checks
    BRIDGE=$(python3 -c "import sys, dihal, pandas as pd; r = pd.read_csv(dihal.open_store().load(sys.argv[1], 'sweep').file('sweep_runs.csv')); print(r[r.layer == int(sys.argv[2])].sort_values('seed').bridge.iloc[0])" "$SWEEP" "$LSTAR")
  fi
  $DIHAL evaluate --bridge "$BRIDGE" --sample-steps "$EVAL_STEPS" --limit "$LIMIT" $DEV
  $DIHAL generate --bridge "$BRIDGE" --num-samples "$NUM_SAMPLES" --max-new-tokens "$MAX_NEW" \
    --sample-steps "$SAMPLE_STEPS" --top-p 0.95 --batch-size "$GEN_BATCH" --baseline original $DEV
  GENERATE=$(latest generate)
  $DIHAL evaluate --samples "$GENERATE" --limit "$NUM_SAMPLES" $DEV
  # the diagnostic comparison (METHOD §5): every row from one prior per seed, paper protocol,
  # second evaluator the other backbone of the list
  OTHER=$(printf '%s\n' "$MODELS" | awk -v m="$MODEL" 'NF && $1 != m {print $1; exit}')
  $DIHAL compare --extract "$EXTRACT" --score "$SCORE" --protocol paper $RECIPE --seeds "$SEEDS" \
    --num-samples "$COMPARE_SAMPLES" --prior-steps "$PRIOR_STEPS" --sample-steps "$SAMPLE_STEPS" \
    --condition-noise prior:0.5 --temperatures "$TEMPERATURES" --top-p 1.0 --budgets "$BUDGETS" \
    --controls "$CONTROLS" --evaluator "${OTHER:-$MODEL}" --batch-size "$COMPARE_BATCH" --states "$STATES" \
    --keep-weights "$KEEP_WEIGHTS" $DEV
  dry || python3 scripts/summarize.py "$DIHAL_ROOT" "$DIHAL_ROOT/summary.md"
done 3<<< "$MODELS"
