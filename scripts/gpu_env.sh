# What the GPU scripts (gpu_smoke.sh, gpu_profile.sh) set up before they run, sourced by them: the wheels the
# GPU image lacks (.whl/, from gpu_wheels.sh), dihal from this checkout when it is not installed, and the
# builtin's tokenizer (.gpu/tokenizer) as $TOKENIZER. No network, no install needed.
set -euo pipefail
export DIHAL_STRICT_CACHE=${DIHAL_STRICT_CACHE:-1}  # a cached artifact made by other code is recomputed (issue 45)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
have() { python3 -c "import zarr, transformers as t, sys; sys.exit(tuple(map(int, t.__version__.split('.')[:2])) < (5, 24))" 2>/dev/null; }
if ! have && ls .whl/*.whl >/dev/null 2>&1; then  # what the GPU image lacks: zarr and its codecs, transformers >= 5.24
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/dihal-site .whl/*.whl
  export PYTHONPATH=/tmp/dihal-site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! python3 -c "import dihal.cli" 2>/dev/null; then  # dihal from this checkout, not installed: one namespace
  shim=$(mktemp -d) && mkdir "$shim/dihal"
  ln -s "$PWD/dihal_cli" "$shim/dihal/cli" && ln -s "$PWD/stages" "$shim/dihal/stages" && ln -s "$PWD/artifacts" "$shim/dihal/artifacts"
  export PYTHONPATH=$shim${PYTHONPATH:+:$PYTHONPATH}
fi
TOKENIZER=${TOKENIZER:-}
if [ -z "$TOKENIZER" ] && [ -f .gpu/tokenizer/tokenizer.json ]; then TOKENIZER=.gpu/tokenizer; fi
