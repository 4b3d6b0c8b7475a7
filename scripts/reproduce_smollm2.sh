#!/usr/bin/env bash
# smollm2-135m (30 blocks) on pydoc, CPU-sized. SKIP_SWEEP=1 leaves out the 29-layer sweep.
exec bash "$(dirname "$0")/reproduce_cpu.sh" smollm2-135m 1-29
