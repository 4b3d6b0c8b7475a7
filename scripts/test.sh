#!/usr/bin/env bash
# The test command of README.md: set-up, lint and format check, then the whole suite (both tiers, in parallel).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m ruff check .
python3 -m ruff format --check .
# where this machine can mount a tmpfs (root), the real full-disk tests must run: skipping them fails
probe=$(mktemp -d)
if mount -t tmpfs -o size=64k tmpfs "$probe" 2>/dev/null; then umount "$probe"; export DIHAL_TEST_TMPFS=required; fi
rmdir "$probe"
# one worker and a half per core: the slow tier waits on its subprocesses (kills, torchrun's rendezvous, locks),
# and a third worker on 2 cores fills those waits: 12 min 42 s against 13 min 59 s with two (2026-12-07)
workers=$(( ($(nproc) * 3 + 1) / 2 ))
python3 -m pytest -q -m "slow or not slow" -n "$workers" --durations=15 "$@"
