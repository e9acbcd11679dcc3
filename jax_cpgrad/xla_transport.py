"""The XLA transport: the gradient return and the gather with XLA collectives.

Runs anywhere XLA does (CPU, any GPU, across hosts). On GPUs the collectives are NCCL's; this is
what jax_cpgrad's peer transport replaces, and what it is measured against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .layout import from_cp_layout, to_cp_layout


def grad_return_xla(x, axis_name: str, seq_axis: int, num_ranks: int):
    """Reorder the global gradient into owner order, then reduce-scatter (psum_scatter)."""
    owner_ordered = to_cp_layout(x, num_ranks, seq_axis)
    return jax.lax.psum_scatter(owner_ordered, axis_name, scatter_dimension=seq_axis, tiled=True)


def all_gather_xla(x, axis_name: str, seq_axis: int, num_ranks: int):
    """All-gather the local shards (they arrive in CP layout), then restore natural order."""
    gathered = jax.lax.all_gather(x, axis_name, axis=seq_axis, tiled=True)
    return from_cp_layout(gathered, num_ranks, seq_axis)


def grad_return_reference(x, axis_name: str, seq_axis: int, num_ranks: int):
    """The gradient return exactly as the peer transport computes it.

    Every writer's two chunks for this owner arrive by all-to-all; they are summed in writer
    order 0..R-1 in float32 (starting from writer 0's value, not from zero) and rounded once.
    Bitwise equal to the peer transport, so it is the oracle for the GPU tests.
    """
    owner_ordered = to_cp_layout(x, num_ranks, seq_axis)
    local_len = x.shape[seq_axis] // num_ranks
    split = owner_ordered.reshape(x.shape[:seq_axis] + (num_ranks, local_len) + x.shape[seq_axis + 1 :])
    # After the all-to-all, index w along seq_axis is the block writer w sent to this rank.
    per_writer = jax.lax.all_to_all(split, axis_name, split_axis=seq_axis, concat_axis=seq_axis, tiled=True)
    parts = [
        jax.lax.index_in_dim(per_writer, w, axis=seq_axis, keepdims=False).astype(jnp.float32)
        for w in range(num_ranks)
    ]
    acc = parts[0]  # from writer 0's value, not from zero (0 + x would turn -0.0 into 0.0)
    for part in parts[1:]:
        acc = acc + part
    return acc.astype(x.dtype)
