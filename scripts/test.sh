#!/usr/bin/env bash
# Sets up .venv and runs the whole test suite (GPU tests skip, with a reason, without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/check_no_libcuda.sh
.venv/bin/python -m pytest -q -rs tests "$@"
