#!/usr/bin/env bash
# The attention layer's CPU tests (its masks, halo and blockwise path too) on the oldest supported
# jax (0.11.2), importing the package from the wheel that scripts/build_wheel.sh left in .whl/
# (run that first; CI does). The layer binds jax's private cuDNN attention primitives, whose form
# changes between jax releases: scripts/test.sh runs these tests on the newest jax, this on the
# oldest.
set -euo pipefail
cd "$(dirname "$0")/.."
ENV_DIR=build/wheel-env  # scripts/build_wheel.sh's environment: jax and jaxlib 0.11.2
wheel=$(ls .whl/jax_cpgrad-*.whl)
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
PIP=("$ENV_DIR/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" "pytest>=8" pytest-timeout
"${PIP[@]}" --no-deps --target "$site" "$wheel"
repo=$PWD
# From outside the checkout, so that the wheel's copy of the package is the one imported.
cd "$site"
SITE=$site PYTHONPATH="$site" JAX_PLATFORMS=cpu "$repo/$ENV_DIR/bin/python" - <<'PY'
import os, jax, jax_cpgrad
assert jax.__version__ == "0.11.2", jax.__version__
assert jax_cpgrad.__file__.startswith(os.environ["SITE"]), jax_cpgrad.__file__
print(f"== the layer's tests on jax {jax.__version__}, jax_cpgrad from {jax_cpgrad.__file__}")
PY
PYTHONPATH="$site" JAX_PLATFORMS=cpu "$repo/$ENV_DIR/bin/python" -m pytest -q -rs -p no:cacheprovider \
  --rootdir "$repo" \
  "$repo"/tests/test_attention{,_masks,_schedule,_kernel_choice}.py "$repo"/tests/test_{halo,blockwise}.py
