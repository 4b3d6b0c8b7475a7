#!/usr/bin/env bash
# The paper's trained parts on a GPU, profiled (issue 64 item 5; scripts/gpu_profile.py): on a random-weight
# model of Llama-3.1-8B's shape (4 blocks), one extract of 1,024 sequences of 128 tokens (layers 0 and 3),
# then 50 steps of the paper bridge and of the paper prior, each under torch.profiler: tokens per second, MFU
# against the device's bf16 peak, the share of the run waiting for data, peak memory, the 15 costliest
# kernels. One call of at most 8 minutes of device time; the wheels and the tokenizer as gpu_smoke.sh's.
#
#   here, once:          bash scripts/gpu_wheels.sh
#   on the GPU machine:  bash scripts/gpu_profile.sh
#   rehearsal on a CPU:  DEVICE=cpu bash scripts/gpu_profile.sh     (small blocks and recipe; no MFU)
set -euo pipefail
source "$(dirname "$0")/gpu_env.sh"  # wheels, dihal from this checkout, $TOKENIZER
ARGS=(--root "${DIHAL_ROOT:-runs/gpu-profile-${DEVICE:-cuda}}" --device "${DEVICE:-cuda}" --dtype "${DTYPE:-bfloat16}")
[ -n "$TOKENIZER" ] && ARGS+=(--tokenizer "$TOKENIZER")
if [ "${DEVICE:-cuda}" = cpu ]; then  # the rehearsal: blocks of width 64, few sequences, steps and a small recipe
  ARGS+=(--sequences 48 --seq-len 16 --steps 20 --shrink "--hidden 64 --intermediate 128 --heads 4 --kv-heads 2"
         --recipe "width=32 depth=1 heads=2 batch_size=8" --gen-batches 1,8 --gen-tokens 4)
fi
exec python3 scripts/gpu_profile.py "${ARGS[@]}" "$@"
