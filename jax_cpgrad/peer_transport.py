"""The peer transport: the CUDA FFI handlers, called on one of XLA's streams inside ``shard_map``."""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental.compute_on import compute_on

from .spec import WorkspaceSpec


def _result_type(x, shape):
    """x's type (dtype, mesh and varying axes, or gradients come out wrong) with a new shape."""
    return jax.typeof(x).update(shape=tuple(shape))


# Where an overlapped call runs: XLA's collective stream, which it schedules like its own NCCL
# collectives (an async start/done pair with independent work placed between them). The handler
# is given that stream; XLA joins it back to the compute stream before the results are used and
# keeps the inputs alive until then.
OVERLAP_STREAM = "gpu_stream:collective"


def _call(op: str, xs: tuple, out_len: int, seq_axis: int, n: int, spec: WorkspaceSpec):
    if spec.overlap:
        on_own_stream = compute_on(compute_type=OVERLAP_STREAM, out_memory_spaces=jax.memory.Space.Device)(
            lambda *ys: _ffi_call(op, ys, out_len, seq_axis, n, spec)
        )
        return tuple(on_own_stream(*xs))
    return _ffi_call(op, xs, out_len, seq_axis, n, spec)


def _ffi_call(op: str, xs: tuple, out_len: int, seq_axis: int, n: int, spec: WorkspaceSpec):
    target, side_effect = spec.target(op)
    out_shape = xs[0].shape[:seq_axis] + (out_len,) + xs[0].shape[seq_axis + 1 :]
    call = jax.ffi.ffi_call(
        target,
        tuple(_result_type(x, out_shape) for x in xs),
        has_side_effect=side_effect,
        # vmap adds leading axes; the handler counts seq_axis from the back, so it still holds.
        vmap_method="broadcast_all",
    )
    return tuple(
        call(
            *xs,
            workspace_id=np.int64(spec.id),
            axis_size=np.int64(n),
            seq_axis_from_end=np.int64(xs[0].ndim - seq_axis),
        )
    )


def grad_return_peer(xs: tuple, seq_axis: int, n: int, spec: WorkspaceSpec):
    return _call("grad_return", xs, xs[0].shape[seq_axis] // n, seq_axis, n, spec)


def all_gather_peer(xs: tuple, seq_axis: int, n: int, spec: WorkspaceSpec):
    return _call("all_gather", xs, xs[0].shape[seq_axis] * n, seq_axis, n, spec)
