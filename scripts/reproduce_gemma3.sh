#!/usr/bin/env bash
# gemma3-270m (18 blocks) on pydoc, CPU-sized. SKIP_SWEEP=1 leaves out the 17-layer sweep.
# Gemma 3's residual stream exceeds float16's range (6.8e4 at layer 8): the default
# --store-dtype auto stores such layers as float32.
exec bash "$(dirname "$0")/reproduce_cpu.sh" gemma3-270m 1-17
