#!/usr/bin/env bash
# The Pallas Mosaic GPU kernels' CPU tests on the oldest supported jax (0.11.2); scripts/test.sh
# runs them on the newest (its .venv has the same plugin). No GPU needed:
# - lowering: jax.export for "cuda" runs the whole Mosaic GPU lowering on the CPU; it needs
#   jax-cuda13-plugin of the same version, installed --no-deps (8 MB, no CUDA libraries);
#   JAX_CPGRAD_REQUIRE_LOWERING=1 makes a missing plugin a failure, not a skip;
# - GPU interpret mode: the kernels run on the CPU in Pallas' GPU interpreter where that jax has
#   one (the tests skip, saying why, where it has not).
# MOSAIC_JAX_VERSIONS picks other versions (pip requirements, e.g. "==0.11.2 >=0.12,<0.13").
# The environments are cached under build/mosaic-lowering-jax-*; MOSAIC_LOWERING_REFRESH=1
# recreates them. Extra arguments go to pytest (e.g. -k lowers).
#
# jax_cpgrad's package imports its compiled module, so the tests import a copy of the source
# tree's jax_cpgrad with the compiled module of .venv (scripts/setup.sh builds it, against
# jaxlib 0.11.2, which loads on both versions).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
source scripts/find_python.sh

ext=$(.venv/bin/python -c 'import jax_cpgrad._cpgrad_ext as e; print(e.__file__)' 2>/dev/null) || {
  echo "no compiled jax_cpgrad module in .venv: run bash scripts/setup.sh first" >&2
  exit 1
}
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
cp -r jax_cpgrad "$site/"
find "$site/jax_cpgrad" -name '__pycache__' -prune -exec rm -rf {} +
cp "$ext" "$site/jax_cpgrad/"

make_env() {  # make_env DIR JAX_REQUIREMENT
  local dir=$1 want=$2
  if [ "${MOSAIC_LOWERING_REFRESH:-0}" = 1 ]; then rm -rf "$dir"; fi
  if [ ! -x "$dir/bin/python" ] || [ ! -f "$dir/.ready" ]; then
    rm -rf "$dir"
    local py
    py=$(find_python)
    echo "== creating $dir ($want)"
    $py -m venv "$dir"
    local pip=("$dir/bin/python" -m pip install -q --disable-pip-version-check)
    "${pip[@]}" "jax$want" "jaxlib$want" numpy absl-py "pytest>=8" pytest-timeout
    local version
    version=$("$dir/bin/python" -c 'import jax; print(jax.__version__)')
    "${pip[@]}" --no-deps "jax-cuda13-plugin==$version"
    touch "$dir/.ready"
  fi
}

status=0
for want in ${MOSAIC_JAX_VERSIONS:-"==0.11.2"}; do
  case $want in
    ==*) dir=build/mosaic-lowering-jax-${want#==} ;;
    *) dir=build/mosaic-lowering-jax-0.12-newest ;;
  esac
  make_env "$dir" "$want"
  (
    cd "$site"
    SITE=$site "$repo/$dir/bin/python" - <<'PY'
import importlib.util, os, jax, jax_cpgrad
assert jax_cpgrad.__file__.startswith(os.environ["SITE"]), jax_cpgrad.__file__
plugin = importlib.util.find_spec("jax_cuda13_plugin")
assert plugin is not None, "jax-cuda13-plugin is missing"
print(f"== Mosaic GPU tests on jax {jax.__version__} (jax-cuda13-plugin at {os.path.dirname(plugin.origin)})")
PY
    JAX_CPGRAD_REQUIRE_LOWERING=1 JAX_PLATFORMS=cpu "$repo/$dir/bin/python" -m pytest -q -rs \
      -p no:cacheprovider --rootdir "$repo" "$repo"/tests/test_mosaic_{forward,backward,layer}.py "$@"
  ) || status=1
done
exit $status
