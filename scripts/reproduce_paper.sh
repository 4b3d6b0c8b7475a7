#!/usr/bin/env bash
# The paper's setting: Llama-3.1-8B-Instruct and Qwen3-8B on Dolma v1.7, GPU-sized.
# It needs the hub (or a populated HF cache) and a GPU. DRY_RUN=1 validates every stage's
# arguments offline without loading weights or data.
set -euo pipefail
export DIHAL_STRICT_CACHE=${DIHAL_STRICT_CACHE:-1}  # a cached artifact made by other code is recomputed (issue 45)
cd "$(dirname "$0")/.."
[ "${DRY_RUN:-0}" = 1 ] && export HF_HUB_OFFLINE=1
dry() { [ "${DRY_RUN:-0}" = 1 ]; }
DRY=$(dry && echo --dry-run || true)
DEV="--device ${DEVICE:-cuda} --dtype ${DTYPE:-bfloat16} $DRY"
latest() { if dry; then echo latest; else dihal runs latest "$1"; fi; }

# model, candidate layers, its shapes for the estimate printed first (scripts/make_random_model.py's configs)
for spec in "meta-llama/Llama-3.1-8B-Instruct 1-31 llama-3.1-8b" "Qwen/Qwen3-8B 1-35 qwen3-8b"; do
  set -- $spec
  MODEL=$1; LAYERS=$2
  export DIHAL_ROOT=runs/paper/$(basename "$MODEL")
  echo "== $MODEL"
  python3 scripts/estimate.py --model "$MODEL" --like "$3" --sequences 20000 --seq-len 128
  dihal extract --model "$MODEL" --dataset allenai/dolma --dataset-config v1_7 --text-field text \
    --layers all --max-sequences 20000 --seq-len 128 --batch-size 32 $DEV
  EXTRACT=$(latest extract)
  dihal score --extract "$EXTRACT" --tokens 4096 --device cuda $DRY
  SCORE=$(latest score)
  if dry; then LSTAR=3; else
    LSTAR=$(dihal score --extract "$EXTRACT" --tokens 4096 --device cuda --json | python3 -c "import json,sys; print(json.load(sys.stdin)['l_star'])")
  fi
  dihal sweep --layers "$LAYERS" --protocol paper --extract "$EXTRACT" --score "$SCORE" --eval-limit 256 $DEV
  BRIDGE=$(latest bridge)
  dry || BRIDGE=$(python3 -c "import json; print(__import__('pandas').read_csv('$DIHAL_ROOT/sweep/'+'$(latest sweep)'+'/sweep.csv').set_index('layer').loc[$LSTAR,'bridge'])")
  dihal evaluate --bridge "$BRIDGE" --sample-steps 4,8,16,32 --limit 512 $DEV
  dihal generate --bridge "$BRIDGE" --num-samples 1000 --max-new-tokens 127 --sample-steps 16 --top-p 0.95 \
    --batch-size 50 --baseline original $DEV
  GENERATE=$(latest generate)
  dihal evaluate --samples "$GENERATE" --limit 1000 $DEV
  # the diagnostic comparison (docs/method.md section 5): every row from one prior per seed, paper protocol,
  # second evaluator the other 8B backbone
  OTHER=$([ "$MODEL" = "Qwen/Qwen3-8B" ] && echo meta-llama/Llama-3.1-8B-Instruct || echo Qwen/Qwen3-8B)
  dihal compare --extract "$EXTRACT" --score "$SCORE" --protocol paper --seeds 0,1,2 --num-samples 256 \
    --prior-steps 50 --sample-steps 16 --condition-noise prior:0.5 --temperatures 0,0.7,1.0 --top-p 1.0 \
    --budgets 1,5 --controls sed,codar,dihal,dihal-direct --evaluator "$OTHER" --batch-size 64 $DEV
  dry || python3 scripts/summarize.py "$DIHAL_ROOT" "$DIHAL_ROOT/summary.md"
done
