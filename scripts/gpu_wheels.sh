#!/usr/bin/env bash
# What scripts/gpu_smoke.sh needs on the GPU machine beside its image (torch 2.11, transformers 5.17, pandas,
# pyarrow, matplotlib, typer, rich, scipy, safetensors, tokenizers; no package index): the wheels of zarr and
# its codecs and of transformers 5.24 (the `cache=` keyword dihal's generation uses) into .whl/, for Python
# 3.12 on x86-64, and the builtin smollm2-135m's tokenizer into .gpu/tokenizer/. About 19 MB in all.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl .gpu/tokenizer
for pkg in transformers==5.24.0 zarr==3.1.6 numcodecs==0.17.1 donfig==0.8.1.post1 google-crc32c==1.8.0; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$pkg"
done
python3 - <<'PY'
import shutil
from pathlib import Path
from dihal.stages.lm.models import locate
source = Path(locate("smollm2-135m")[0])
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(source / name, Path(".gpu/tokenizer") / name)
PY
du -sh .whl .gpu
