"""The compiled modules, and the FFI targets they provide (registered once, at import)."""

from __future__ import annotations

import glob
import os
import sys
import warnings
from importlib import metadata
from types import ModuleType

import jax

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# Where the CUDA build comes from, for the messages below.
_HOW_TO_GET_CUDA = (
    "To get the CUDA build: install the prebuilt CUDA wheel (`pip install --no-deps "
    "jax_cpgrad-*-manylinux_*.whl`, made by `bash scripts/build_wheel.sh` on any Linux machine with "
    "nvcc or network access), or build from source with a CUDA toolkit: "
    "`pip install nvidia-cuda-nvcc nvidia-cuda-runtime nvidia-cuda-crt nvidia-cuda-cccl` "
    "(or set CUDA_HOME), then `JAX_CPGRAD_CUDA=ON pip install .` (ON: the build fails rather than "
    "fall back to CPU-only)."
)


def _installed_copies() -> list[str]:
    """Other jax_cpgrad packages on sys.path that have a compiled module (an installed copy)."""
    found = []
    for entry in sys.path:
        package = os.path.join(os.path.abspath(entry or os.getcwd()), "jax_cpgrad")
        if os.path.abspath(package) != _PACKAGE_DIR and glob.glob(os.path.join(package, "_cpgrad_ext*.so")):
            found.append(package)
    return found


try:
    from . import _cpgrad_ext as ext
except ImportError as err:
    if glob.glob(os.path.join(_PACKAGE_DIR, "_cpgrad_ext*.so")) or (err.path or "").endswith(".so"):
        raise  # the module is there but does not load: its own error says why
    others = _installed_copies()
    installed = f" An installed copy is at {others[0]}." if others else ""
    raise ImportError(
        f"jax_cpgrad is being imported from the source tree at {_PACKAGE_DIR}, which has no compiled "
        f"module (_cpgrad_ext).{installed} Python looks in the current directory first: run from "
        "another directory (then the installed copy is imported), or install the source tree in "
        "editable mode (`pip install -e .`, or `bash scripts/setup.sh`)."
    ) from err

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

# Per op and protocol: (FFI target, whether the call has side effects). The memop protocol
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


def _jax_cuda_plugins() -> list[str]:
    """JAX's CUDA plugins installed here (found by name, without starting any backend)."""
    names = ("jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "jax-cuda12-pjrt")
    found = []
    for name in names:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    return found


def cpu_only_note() -> str | None:
    """What is wrong when this is a CPU-only build on a machine where JAX has a CUDA plugin
    (a GPU user), or None. Checks installed packages only: it starts no backend."""
    if HAS_CUDA:
        return None
    plugins = _jax_cuda_plugins()
    if not plugins:
        return None
    return (
        f"jax_cpgrad ({_PACKAGE_DIR}) was built CPU-only (no nvcc was found when it was built), but "
        f"JAX here has CUDA ({', '.join(plugins)}): a Workspace (the peer transport) cannot be "
        "created, and calls without one run over XLA collectives. " + _HOW_TO_GET_CUDA
    )


def require_cuda(what: str) -> None:
    """Raise a clear error when the CUDA peer transport was not built."""
    if HAS_CUDA:
        return
    try:
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError:
        gpus = []
    seen = (
        f" JAX sees {len(gpus)} GPU(s) here ({gpus[0].device_kind}), so this is the wrong build for "
        "this machine."
        if gpus
        else ""
    )
    raise RuntimeError(
        f"{what} needs the CUDA peer transport, but jax_cpgrad was built without CUDA "
        f"({_PACKAGE_DIR}: no nvcc was found at build time).{seen} {_HOW_TO_GET_CUDA} "
        "Or call without a workspace (workspace=None) to use the XLA transport."
    )


if (_note := cpu_only_note()) is not None:
    warnings.warn(_note, RuntimeWarning, stacklevel=2)
