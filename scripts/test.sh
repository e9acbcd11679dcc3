#!/usr/bin/env bash
# Sets up .venv, checks lint, formatting and types, and runs the whole test suite (GPU tests
# skip, with a reason, without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/check_no_libcuda.sh
bash scripts/lint.sh
.venv/bin/python -m pytest -q -rs tests "$@"
