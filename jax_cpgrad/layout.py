"""The load-balanced CP layout: natural-order global arrays to and from rank order.

Rank ``r`` of R = ``num_ranks`` holds global chunks ``r`` and ``2R-1-r`` (in that order) of the
``2R`` equal chunks of the sequence. The chunk arithmetic comes from the native module, the same
definitions the CUDA kernels use.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ._native import ext


def normalize_seq_axis(seq_axis: int, ndim: int) -> int:
    """``seq_axis`` as a non-negative axis of an ``ndim``-dimensional array, or ValueError."""
    if not isinstance(seq_axis, (int, np.integer)) or isinstance(seq_axis, bool):
        raise ValueError(f"seq_axis must be an int, got {seq_axis!r}")
    if not -ndim <= seq_axis < ndim:
        raise ValueError(f"seq_axis {seq_axis} is out of range for an array of rank {ndim}")
    return int(seq_axis) % ndim


def local_chunks(rank: int, num_ranks: int) -> tuple[int, int]:
    """The two global chunks CP rank ``rank`` of ``num_ranks`` holds, in local order."""
    return ext.chunk_of(rank, 0, num_ranks), ext.chunk_of(rank, 1, num_ranks)


def layout_order(num_ranks: int) -> list[int]:
    """Global chunk indices in CP-layout order: rank 0's two chunks, then rank 1's, ..."""
    return list(ext.layout_order(num_ranks))


def chunk_geometry(shape, seq_axis: int, num_ranks: int, *, global_: bool = True):
    """(chunk_len, local_len, global_len) of ``shape``; ValueError when 2R does not divide it."""
    seq_axis = normalize_seq_axis(seq_axis, len(shape))
    _, _, chunk_len, global_len, local_len = ext.geometry(list(shape), seq_axis, num_ranks, global_)
    return chunk_len, local_len, global_len


def _permute_chunks(x, order: list[int], seq_axis: int, num_ranks: int):
    seq_axis = normalize_seq_axis(seq_axis, x.ndim)
    chunk_len, _, _ = chunk_geometry(x.shape, seq_axis, num_ranks)
    chunked = x.reshape(x.shape[:seq_axis] + (2 * num_ranks, chunk_len) + x.shape[seq_axis + 1 :])
    xp = np if isinstance(x, np.ndarray) else jnp
    picked = xp.take(chunked, np.asarray(order), axis=seq_axis)
    return picked.reshape(x.shape)


def to_cp_layout(x, num_ranks: int, seq_axis: int = 1):
    """Reorder a natural-order global array into CP layout along ``seq_axis``.

    Sharding the result evenly over ``num_ranks`` devices along ``seq_axis`` gives each rank its two
    chunks. Works on numpy and JAX arrays.
    """
    return _permute_chunks(x, layout_order(num_ranks), seq_axis, num_ranks)


def from_cp_layout(x, num_ranks: int, seq_axis: int = 1):
    """Inverse of :func:`to_cp_layout`: a CP-layout global array back to natural order."""
    return _permute_chunks(x, list(np.argsort(layout_order(num_ranks))), seq_axis, num_ranks)
