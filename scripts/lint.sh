#!/usr/bin/env bash
# Lint, format and type checks (part of the test command): ruff on the Python, mypy on the
# package, clang-format (Google style, 100 columns: .clang-format) on the C++/CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
find ffi experiments \( -name '*.h' -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh' \) -print0 |
  xargs -0 .venv/bin/clang-format --dry-run -Werror
echo "== lint, format and type checks passed"
