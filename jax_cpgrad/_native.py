"""The compiled modules, and the FFI targets they provide (registered once, at import)."""

from __future__ import annotations

from types import ModuleType

import jax

from . import _cpgrad_ext as ext

bench_ext: ModuleType | None
try:  # the optional benchmark module (CUDA builds with JAX_CPGRAD_BENCHMARKS=ON)
    from . import _cpgrad_bench

    bench_ext = _cpgrad_bench
except ImportError:
    bench_ext = None

HAS_CUDA: bool = bool(ext.HAS_CUDA)
MAX_RANKS: int = int(ext.MAX_RANKS)
MAX_TENSORS: int = int(ext.MAX_TENSORS)
HAS_TEST_HOOKS: bool = HAS_CUDA and bool(ext.HAS_TEST_HOOKS)

# Per op and protocol: (FFI target, whether the call has side effects). The stream-memop protocol
# advances a host-side epoch at every call, so no call may be dropped or merged; the device
# protocol keeps its epoch on the GPU, and every rank runs the same program, so XLA drops or
# merges the same calls everywhere (and only calls without side effects enter CUDA graphs).
TARGETS = {
    ("grad_return", "memop"): ("jax_cpgrad_grad_return", True),
    ("all_gather", "memop"): ("jax_cpgrad_all_gather", True),
    ("grad_return", "device"): ("jax_cpgrad_grad_return_device", False),
    ("all_gather", "device"): ("jax_cpgrad_all_gather_device", False),
}
# A workspace with overlap=True takes each call as a start and a done, both with side effects. A
# start without them would be recomputed by jax.checkpoint (remat keeps only effectful results),
# and the copy would have no done; a dropped done would let XLA reuse the start's buffers while the
# workspace's stream may still use them. (Neither enters CUDA graphs either way.)
START_TARGETS = {key: (f"{target}_start", True) for key, (target, _) in TARGETS.items()}
DONE_TARGET = "jax_cpgrad_done"


def _handler_name(target: str) -> str:
    """The compiled module's name for an FFI target (its handlers() key)."""
    return target.removeprefix("jax_cpgrad_")


if HAS_CUDA:
    jax.ffi.register_ffi_type("jax_cpgrad_call_state", ext.state_type(), platform="CUDA")
    _stages = ext.handlers()
    for _target, _ in [*TARGETS.values(), *START_TARGETS.values(), (DONE_TARGET, True)]:
        jax.ffi.register_ffi_target(_target, _stages[_handler_name(_target)], platform="CUDA")


def require_cuda(what: str) -> None:
    """Raise a clear error when the CUDA peer transport was not built."""
    if not HAS_CUDA:
        raise RuntimeError(
            f"{what} needs the CUDA peer transport, but jax_cpgrad was built without CUDA "
            "(no nvcc was found at build time). Reinstall with a CUDA toolkit available "
            "(CUDA_HOME, /usr/local/cuda or `pip install nvidia-cuda-nvcc`), or call without a "
            "workspace to use the XLA transport."
        )
