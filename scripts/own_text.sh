#!/usr/bin/env bash
# Issue 19's recipe measurement: at l* = LAYER, bridges trained on pydoc alone, on the backbone's own
# samples alone, and on a 0.5/0.5 mix, SEEDS each under PROTOCOL; each scored on held-out pydoc, on
# this repository's prose, on the backbone's own samples drawn with another seed (held out, and
# recorded so), and by the AR hybrid's Gen.PPL under the backbone and the other builtin.
# Every extract holds MAX_SEQUENCES sequences (pydoc's validation documents are the same in all).
#   usage: scripts/own_text.sh MODEL          (DRY_RUN=1 validates every stage's arguments)
#   then:  python3 scripts/own_text.py runs/own-text-MODEL    (the table, mean +- std over seeds)
# The table pools the rows kept in benchmarks/own_text/MODEL/ (copy own_text.csv and own_text_kl_by_position.csv
# there to keep a session's bridges once its store is gone); the store's own rows win.
# SEEDS and ARMS split the work: two copies may share one root (give each OMP_NUM_THREADS=1 on 2 cores, or
# their threads contend and each bridge takes 2-3x as long), and append to their logs (>>), not truncate.
# ARMS=pydoc draws no training samples and builds no own or mix extract (it needs only the held-out ones).
# BRIDGE_ARGS='--train-steps 2000' trains a longer budget, which own_text.py keeps in rows of its own.
set -euo pipefail
export DIHAL_STRICT_CACHE=${DIHAL_STRICT_CACHE:-1}  # a cached artifact made by other code is recomputed (issue 45)
cd "$(dirname "$0")/.."
MODEL=$1
export DIHAL_ROOT=${DIHAL_ROOT:-runs/own-text-$MODEL}
DEV="--device ${DEVICE:-cpu} --dtype ${DTYPE:-float32}"
SEQ_LEN=${SEQ_LEN:-64}
LAYER=${LAYER:-1}
PROTOCOL=${PROTOCOL:-cpu-small}
SEEDS=${SEEDS:-0 1 2}
OWN=${OWN_SAMPLES:-1024}  # unprompted samples to train on
# PROMPTED=1 adds as many samples from 8-token pydoc prompts (4 per prompt; each prompt is its own batch
# of 4 rather than GEN_BATCH, so they are slower per sample; not timed)
PROMPTED=${PROMPTED:-0}
N=${MAX_SEQUENCES:-$([ "$PROMPTED" = 1 ] && echo 1536 || echo 896)}  # every extract has this many sequences
GEN_BATCH=${GEN_BATCH:-32}
# the training texts to run at each seed; 'recipe' is scripts/reproduce_cpu.sh's bridge data (--own-text 0.5 with no
# --max-sequences: the mix drawing on all the own samples, so about twice the sequences of the other arms)
ARMS=${ARMS:-pydoc own mix}
for DATA in $ARMS; do case $DATA in pydoc | own | mix | recipe) ;;
  *) echo "error: ARMS holds pydoc, own, mix or recipe, not '$DATA'" >&2; exit 2 ;; esac; done
dry() { [ "${DRY_RUN:-0}" = 1 ]; }
DRY=$(dry && echo --dry-run || true)
# run a stage (its output to the log) and print the id of the artifact it made or reused, read from its own
# report line, so that two copies of this script sharing a root never pick up each other's artifacts
made() {
  if dry; then dihal "$@" --dry-run >&2; echo latest; return; fi
  local id
  id=$(dihal "$@" | tee -a /dev/stderr | sed -nE 's/^(done|cache hit): [a-z]+ ([0-9a-f]{12}) .*/\2/p' | tail -1)
  [ -n "$id" ] || { echo "error: no artifact id in the output of dihal $1" >&2; exit 1; }
  echo "$id"
}
OTHER=${EVALUATOR:-$(python3 -c "print({'smollm2-135m': 'gemma3-270m', 'gemma3-270m': 'smollm2-135m'}.get('$MODEL', ''))")}
[ -n "$OTHER" ] || { echo "error: name a second evaluator with EVALUATOR=..." >&2; exit 2; }
mkdir -p "$DIHAL_ROOT"; cat README.md docs/*.md > "$DIHAL_ROOT/repo-prose.txt"

echo "== 1. the backbone's own text: to train on (seed 100), and held out (seed 200)"
GEN="generate --baseline original-only --model $MODEL --max-new-tokens $((SEQ_LEN - 1)) --batch-size $GEN_BATCH $DEV"
needs_own() { [ "$ARMS" != pydoc ]; }  # only the pydoc arm trains on no own samples (it is still scored on them)
TRAIN_FREE=skipped; needs_own && TRAIN_FREE=$(made $GEN --num-samples "$OWN" --seed 100)
OWN_DATA=("--dataset" "generate:$TRAIN_FREE")
MIX_DATA=("--dataset" "pydoc" "--dataset" "generate:$TRAIN_FREE" "--mix" "0.5,0.5")
if [ "$PROMPTED" = 1 ] && needs_own; then
  TRAIN_PROMPTED=$(made $GEN --prompts-from pydoc --prompt-tokens 8 --num-prompts $((OWN / 4)) --num-samples 4 \
    --max-new-tokens $((SEQ_LEN - 9)) --seed 100); dry && TRAIN_PROMPTED=prompted
  OWN_DATA+=("--dataset" "generate:$TRAIN_PROMPTED" "--mix" "0.5,0.5")
  MIX_DATA=("--dataset" "pydoc" "--dataset" "generate:$TRAIN_FREE" "--dataset" "generate:$TRAIN_PROMPTED"
    "--mix" "0.5,0.25,0.25")
fi
HELD=$(made $GEN --num-samples 64 --seed 200)

echo "== 2. three extracts of layers 0 and $LAYER: pydoc, own text, and the mix"
ALL="extract --model $MODEL --layers 0,$LAYER --seq-len $SEQ_LEN $DEV"  # every sequence of its data
EX="$ALL --max-sequences $N"
PYDOC=$(made $EX --dataset pydoc)
if needs_own; then
  OWNX=$(made $EX "${OWN_DATA[@]}")
  MIX=$(made $EX "${MIX_DATA[@]}")
fi
case " $ARMS " in *" recipe "*)
  RECIPE=$(made $ALL "${MIX_DATA[@]}") ;; esac

for SEED in $SEEDS; do  # seeds outermost: a run cut short still has every kind of data at its first seeds
  for DATA in $ARMS; do
    case $DATA in pydoc) E=$PYDOC ;; own) E=$OWNX ;; mix) E=$MIX ;; recipe) E=$RECIPE ;; esac
    echo "== 3. $DATA, seed $SEED: train, then fidelity on pydoc, prose and held-out own samples, then Gen.PPL"
    B=$(made train-bridge --layer "$LAYER" --protocol "$PROTOCOL" --extract "$E" --seed "$SEED" $DEV ${BRIDGE_ARGS:-})
    dihal evaluate --bridge "$B" --extract "$PYDOC" --sample-steps 8 --limit 64 $DEV $DRY  # pydoc held out by all
    dihal evaluate --bridge "$B" --dataset "$DIHAL_ROOT/repo-prose.txt" --sample-steps 8 --limit 64 $DEV $DRY
    dihal evaluate --bridge "$B" --samples "$HELD" --sample-steps 8 --limit 64 $DEV $DRY
    G=$(made generate --bridge "$B" --num-samples ${NUM_SAMPLES:-64} --max-new-tokens ${MAX_NEW:-48} --sample-steps 8 \
      --baseline original --batch-size $GEN_BATCH --seed "$SEED" $DEV)
    dihal evaluate --samples "$G" $DEV $DRY
    dihal evaluate --samples "$G" --evaluator "$OTHER" $DEV $DRY
  done
done
KEPT=benchmarks/own_text/$MODEL  # earlier sessions' rows, kept in the repository (scripts/own_text.py --earlier)
dry || python3 scripts/own_text.py "$DIHAL_ROOT" $([ -d "$KEPT" ] && echo --earlier "$KEPT")
