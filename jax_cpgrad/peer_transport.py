"""The peer transport: the CUDA FFI handlers, called on XLA's stream inside ``shard_map``."""

from __future__ import annotations

import jax
import numpy as np

from .spec import WorkspaceSpec


def _result_type(x, shape):
    """x's type (dtype, mesh and varying axes, or gradients come out wrong) with a new shape."""
    return jax.typeof(x).update(shape=tuple(shape))


def _call(op: str, xs: tuple, out_len: int, seq_axis: int, n: int, spec: WorkspaceSpec):
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
