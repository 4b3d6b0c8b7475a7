#!/usr/bin/env bash
# gemma3-270m (18 blocks) on pydoc, CPU-sized. SKIP_SWEEP=1 leaves out the 17-layer sweep.
exec bash "$(dirname "$0")/reproduce_cpu.sh" gemma3-270m 1-17
