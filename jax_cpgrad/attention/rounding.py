"""Roundings that XLA keeps, so that where the layer's transfers sit never changes its bits.

With ``xla_allow_excess_precision`` (XLA's default) the GPU compiler removes a chain of converts
``float32 -> bfloat16 -> float32`` (``SimplifyFPConversions``): a value the layer rounds to its
dtype and a later step widens again would then be used unrounded. Whether the two converts meet
depends on what lies between them, and the overlapped transports put optimization barriers
there (``peer_transport.tie``), the plain ones do not: the same inputs gave different bits on a
plain and an overlapped workspace (measured on an H200 with the Pallas kernels). A barrier right
after the rounding keeps it in every program, at no cost (a barrier moves nothing).
"""

from __future__ import annotations

import jax


def rounded(x, dtype):
    """``x.astype(dtype)``, a rounding no later widening can undo."""
    return firm(x.astype(dtype))


def firm(values):
    """``values`` (any pytree of arrays) as they are: XLA cannot fuse their producers' converts
    with their consumers'."""
    return jax.lax.optimization_barrier(values)


def rounded_into(x, dtype):
    """``x.astype(dtype)`` for rows that a dynamic update writes into an array which is then made
    firm (``plan.update_segments``): the write and the barrier after it sit between this rounding
    and any later widening, and a barrier here would keep XLA from fusing the rounding into the
    write."""
    return x.astype(dtype)
