#!/usr/bin/env bash
# Creates .venv (Python >= 3.12) and installs jax_cpgrad into it with its test and benchmark
# extras. The native module is built with CUDA when nvcc is found, CPU-only otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/find_python.sh

if [ ! -x .venv/bin/python ]; then
  PY=$(find_python)
  echo "== creating .venv with $($PY --version)"
  $PY -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
echo "== building and installing jax_cpgrad (this compiles the native module)"
# Test hooks on: this is the development and test build (a plain `pip install .` has none).
JAX_CPGRAD_TEST_HOOKS=ON .venv/bin/python -m pip install -q -e ".[test,bench]"
# The CUDA plugin of the installed jax, without its CUDA libraries (8 MB): it gives Pallas its Mosaic
# GPU lowering, so the tests lower the project's kernels for CUDA on a machine without a GPU.
jax_version=$(.venv/bin/python -c 'import jax; print(jax.__version__)')
.venv/bin/python -m pip install -q --no-deps "jax-cuda13-plugin==$jax_version"
.venv/bin/python - <<'PY'
import jax, jax_cpgrad
print(f"== jax {jax.__version__}, jax_cpgrad {jax_cpgrad.__version__}, CUDA transport built: {jax_cpgrad.HAS_CUDA}")
PY
