"""A rank of the layer without transfers: its real shapes and kernel calls on one device, a local
copy in place of every transfer. To measure a rank's attention work (benchmarks/attention.py,
benchmarks/cp_step.py's ``none`` transport); not for training: the gathered keys are copies of the
rank's own, not the other ranks'."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from . import layer, schedule
from .halo import halo_length


@dataclasses.dataclass(frozen=True)
class NoTransfer:
    """A rank of ``num_ranks`` alone: the gathered arrays are ``num_ranks`` copies of the local
    ones, and the returned gradients are their first S/R rows (the shape a rank gets back, not its
    chunks). The whole gradients are materialized first, as a transport would read them (without
    the barrier XLA would compute only the rows kept, and the timing would miss work a real rank
    does)."""

    num_ranks: int

    def gather(self, xs, fn, *args):
        return tuple(jnp.concatenate([x] * self.num_ranks, axis=1) for x in xs), fn(*args)

    def return_grads(self, grads, fn, *args):
        grads = jax.lax.optimization_barrier(tuple(grads))
        return tuple(g[:, : g.shape[1] // self.num_ranks] for g in grads), fn(*args)

    def gather_ids(self, words):
        return jnp.concatenate([words] * self.num_ranks, axis=1)

    def halo(self, xs, window, fn, *args):
        """The halo's shapes, ``[B, 2 * (left + right), ...]``: the local rows, repeated."""
        return tuple(_rows(x, halo_length(*window)) for x in xs), fn(*args)

    def return_halo(self, grads, window, chunk_len, fn, *args):
        grads = jax.lax.optimization_barrier(tuple(grads))
        return tuple(_rows(g, 2 * chunk_len) for g in grads), fn(*args)


def _rows(x, length: int):
    """``length`` rows along axis 1 of ``x`` repeated as often as needed."""
    copies = -(-length // x.shape[1])
    return jnp.concatenate([x] * copies, axis=1)[:, :length]


def rank_without_transfer(
    query,
    key,
    value,
    rank,
    num_ranks: int,
    *,
    is_causal: bool = True,
    scale: float | None = None,
    segment_ids=None,
    local_window_size=None,
    implementation=None,
    head_groups: int = 1,
):
    """The layer's computation for rank ``rank`` of ``num_ranks``, alone: real shapes, a local copy
    in place of every transfer (see the module). Options as :func:`dot_product_attention`'s."""
    if not (isinstance(num_ranks, int) and num_ranks >= 1):
        raise ValueError(f"rank_without_transfer: num_ranks must be an int >= 1, got {num_ranks!r}")
    if isinstance(rank, int) and not 0 <= rank < num_ranks:
        raise ValueError(f"rank_without_transfer: rank must be in [0, {num_ranks}), got {rank}")
    options, words = layer.prepare(
        query, key, value, scale=scale, is_causal=is_causal, segment_ids=segment_ids,
        local_window_size=local_window_size, implementation=implementation, head_groups=head_groups,
    )  # fmt: skip
    cfg = layer.schedule_config(options, num_ranks, NoTransfer(num_ranks), transfer_when_alone=False)
    return schedule.attention(cfg, query, key, value, jnp.asarray(rank, jnp.int32), words)
