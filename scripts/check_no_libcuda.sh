#!/usr/bin/env bash
# The built module must not depend on libcuda.so: driver entry points are resolved at run time.
set -euo pipefail
cd "$(dirname "$0")/.."
so=$(.venv/bin/python -c 'import jax_cpgrad._cpgrad_ext as m; print(m.__file__)')
if readelf -d "$so" | grep -q 'libcuda\.so'; then
  echo "FAIL: $so links libcuda.so" >&2
  readelf -d "$so" | grep NEEDED >&2
  exit 1
fi
echo "== $so does not link libcuda.so"
