"""What the benchmarks (``benchmarks/``, ``experiments/``) need of the package beyond its API.

Public names for what would otherwise be private ones; not a stable interface, and nothing a
training program needs:

- ``bench_ext``: the benchmarks' native helpers (``ffi/bench/``), or None where the build has
  none (CPU-only builds, ``JAX_CPGRAD_BENCHMARKS=OFF``);
- ``multiprocessor_count(ordinal)``: the SMs of a local GPU (CUDA ordinal);
- ``barrier(name, timeout_s)``: all processes of a ``jax.distributed`` job meet at ``name``;
- the push targets of an open workspace: :meth:`jax_cpgrad.Workspace.push_targets`.
"""

from __future__ import annotations

from ._distributed import barrier
from ._native import bench_ext, ext

__all__ = ["barrier", "bench_ext", "multiprocessor_count"]


def multiprocessor_count(ordinal: int) -> int:
    """The number of SMs of local GPU ``ordinal`` (a CUDA ordinal, ``device.local_hardware_id``)."""
    return int(ext.multiprocessor_count(ordinal))
