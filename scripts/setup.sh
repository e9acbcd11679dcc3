#!/usr/bin/env bash
# Creates .venv (Python >= 3.12) and installs jax_cpgrad into it with its test and benchmark
# extras. The native module is built with CUDA when nvcc is found, CPU-only otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."

# The first interpreter that really runs and is >= 3.12 (pyenv shims may exist but not run).
find_python() {
  local ok='import sys; sys.exit(sys.version_info < (3, 12))'
  for candidate in python3.12 python3.13 python3; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "$ok" >/dev/null 2>&1; then
      echo "$candidate"; return
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.1[2-9]' | sort -V); do
      if PYENV_VERSION=$v python3 -c "$ok" >/dev/null 2>&1; then
        echo "env PYENV_VERSION=$v python3"; return
      fi
    done
  fi
  echo "jax_cpgrad needs Python >= 3.12 (jax 0.11+); none found" >&2
  exit 1
}

if [ ! -x .venv/bin/python ]; then
  PY=$(find_python)
  echo "== creating .venv with $($PY --version)"
  $PY -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
echo "== building and installing jax_cpgrad (this compiles the native module)"
# Test hooks on: this is the development and test build (a plain `pip install .` has none).
JAX_CPGRAD_TEST_HOOKS=ON .venv/bin/python -m pip install -q -e ".[test,bench]"
.venv/bin/python - <<'PY'
import jax, jax_cpgrad
print(f"== jax {jax.__version__}, jax_cpgrad {jax_cpgrad.__version__}, CUDA transport built: {jax_cpgrad.HAS_CUDA}")
PY
