#!/usr/bin/env bash
# Creates .venv (Python >= 3.12) and installs jax_cpgrad into it with its test and benchmark
# extras. The native module is built with CUDA when nvcc is found, CPU-only otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  for candidate in python3.13 python3.12; do
    command -v "$candidate" >/dev/null 2>&1 && { echo "$candidate"; return; }
  done
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.1[2-9]' | sort -V -r); do
      echo "env PYENV_VERSION=$v python3"; return
    done
  fi
  if python3 -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
    echo python3; return
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
.venv/bin/python -m pip install -q -e ".[test,bench]"
.venv/bin/python - <<'PY'
import jax, jax_cpgrad
print(f"== jax {jax.__version__}, jax_cpgrad {jax_cpgrad.__version__}, CUDA transport built: {jax_cpgrad.HAS_CUDA}")
PY
