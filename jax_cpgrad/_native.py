"""The compiled module, and the FFI targets it provides (registered once, at import)."""

from __future__ import annotations

import jax

from . import _cpgrad_ext as ext

GRAD_RETURN_TARGET = "jax_cpgrad_grad_return"
ALL_GATHER_TARGET = "jax_cpgrad_all_gather"

HAS_CUDA: bool = bool(ext.HAS_CUDA)
MAX_RANKS: int = int(ext.MAX_RANKS)
MAX_TENSORS: int = int(ext.MAX_TENSORS)

if HAS_CUDA:
    _capsules = ext.handlers()
    jax.ffi.register_ffi_target(GRAD_RETURN_TARGET, _capsules["grad_return"], platform="CUDA")
    jax.ffi.register_ffi_target(ALL_GATHER_TARGET, _capsules["all_gather"], platform="CUDA")


def require_cuda(what: str) -> None:
    """Raise a clear error when the CUDA peer transport was not built."""
    if not HAS_CUDA:
        raise RuntimeError(
            f"{what} needs the CUDA peer transport, but jax_cpgrad was built without CUDA "
            "(no nvcc was found at build time). Reinstall with a CUDA toolkit available "
            "(CUDA_HOME, /usr/local/cuda or `pip install nvidia-cuda-nvcc`), or call without a "
            "workspace to use the XLA transport."
        )
