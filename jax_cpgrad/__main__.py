"""`python -m jax_cpgrad`: what this install is, and whether it fits this machine.

Prints the package's location and version, JAX's, whether the CUDA peer transport was built, and
the devices JAX sees. Exits 1 when JAX sees GPUs but the module was built CPU-only (then
`Workspace(...)` would fail: the line says how to get the CUDA build).
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    import jax

    import jax_cpgrad
    from jax_cpgrad import _native

    print(f"jax_cpgrad {jax_cpgrad.__version__} at {os.path.dirname(jax_cpgrad.__file__)}")
    print(f"jax {jax.__version__}, Python {sys.version.split()[0]}")
    print(f"CUDA peer transport built: {_native.HAS_CUDA}")
    devices = jax.devices()
    print(f"JAX's devices: {len(devices)} x {devices[0].device_kind} ({jax.default_backend()})")
    if jax.default_backend() == "gpu" and not _native.HAS_CUDA:
        print(f"PROBLEM: {_native.cpu_only_note() or 'JAX sees GPUs but this build is CPU-only.'}")
        return 1
    if _native.HAS_CUDA and jax.default_backend() == "gpu":
        print("OK: Workspace (the peer transport) can run here")
    else:
        print("OK: no GPU here: calls without a workspace run over XLA collectives")
    return 0


if __name__ == "__main__":
    sys.exit(main())
