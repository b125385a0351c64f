# Sourced by the GPU machine's scripts (gpu_check.sh): run
# from the repository root with segkv from the working tree, results under $OUT (made here), and
# pytest and xgrammar installed from .whl/ (carried) when the machine lacks them.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/segkv-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ! python3 -c 'import pytest' 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
# xgrammar (constrained decoding) and what it imports, where the image lacks them
if ! python3 -c 'import xgrammar' 2>/dev/null && ls .whl/xgrammar-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-xg \
    .whl/xgrammar-*.whl .whl/apache_tvm_ffi-*.whl .whl/pydantic*.whl .whl/typing_inspection*.whl \
    .whl/annotated_types*.whl .whl/typing_extensions*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site-xg"
fi
