#!/usr/bin/env bash
# Issue 52: does the comparison's prior write? (docs/results/prior.md states the rules.) Every step is cached
# in $ROOT, so a rerun (or a later session) only adds what is missing. About 45 min for the curve of one
# backbone on 2 cores (25x of the self-conditioned prior alone is about 20), 30 for the corpus curve, and
# 10-25 min per remedy at 25x.
#   STEP=curve     the prior (plain and self-conditioned) at 1x, 5x, 25x of compare-cpu's 200 steps, pydoc
#   STEP=corpus    the plain prior at 1x, 5x, 25x on the docstrings of the scientific stack (37x pydoc's
#                  text; scripts/docstrings_corpus.py), so steps and epochs come apart
#   STEP=remedies  each remedy alone and combined, at BUDGET (the curve's pick; default 25)
#   STEP=round2    the second round at 1x (docs/results/prior.md): the cross-entropy at t <= 0.5 only, a prior
#                  twice as wide, each with and without the cross-entropy; then Diffusion-LM's clamping of the
#                  plain and the round-1 prior's steps (a sampling diagnostic)
#   MODEL          smollm2-135m (evaluator gemma3-270m) or gemma3-270m (evaluator smollm2-135m)
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-smollm2-135m}
case "$MODEL" in
  smollm2-135m) EVALUATOR=gemma3-270m ;;
  gemma3-270m) EVALUATOR=smollm2-135m ;;
  *) echo "error: MODEL=$MODEL; use smollm2-135m or gemma3-270m" >&2; exit 2 ;;
esac
ROOT=${ROOT:-runs/prior-curve-${MODEL%%-*}}
[ "$MODEL" = smollm2-135m ] && ROOT=${ROOT_SMOLLM2:-runs/prior-curve}
curve() { python3 scripts/prior_curve.py --root "$ROOT" --model "$MODEL" --evaluator "$EVALUATOR" "$@"; }
case "${STEP:-curve}" in
  curve) curve --budgets 1,5,25 --variants plain,sc --out "$ROOT/curve_${MODEL%%-*}.md" ;;
  corpus)
    [ -f runs/corpora/docstrings.jsonl ] || python3 scripts/docstrings_corpus.py runs/corpora/docstrings.jsonl
    curve --budgets 1,5,25 --variants plain --prior-args "--data corpus:$PWD/runs/corpora/docstrings.jsonl" \
      --out "$ROOT/corpus_${MODEL%%-*}.md" ;;
  remedies)
    curve --budgets "${BUDGET:-25}" --variants "${VARIANTS:-shift,ce,shift+ce,sc+shift+ce}" \
      --out "$ROOT/remedies_${MODEL%%-*}.md" ;;
  round2)
    curve --budgets 1 --variants "${VARIANTS:-ce-low,wide,wide+ce,wide+ce-low}" --out "$ROOT/round2_${MODEL%%-*}.md"
    curve --budgets 1 --variants plain,ce --generate-args=--clamp --out "$ROOT/clamp_${MODEL%%-*}.md" ;;
  *) echo "error: STEP=${STEP}; use curve, corpus, remedies or round2" >&2; exit 2 ;;
esac
