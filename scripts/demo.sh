#!/usr/bin/env bash
# Sets up .venv and runs the demo: a few CP training steps of the example model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m jax_cpgrad.demo "$@"
