"""How the layer moves K/V and dK/dV: each move with given work run while it is in flight.

``gather(xs, fn, *args)`` returns ``(all_gather(xs), fn(*args))`` and ``give_back(grads, fn,
*args)`` returns ``(grad_return(grads), fn(*args))``. On a mesh axis they are jax_cpgrad's
overlapped calls (peer transport with a workspace, XLA collectives without); ``NoTransfer``
emulates a rank alone, with the real shapes and a local copy in place of the transfer, to
measure a rank's attention (benchmarks/attention.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..api import all_gather_overlapped, grad_return_overlapped
from ..spec import WorkspaceSpec


@dataclasses.dataclass(frozen=True)
class OnMeshAxis:
    axis_name: str
    spec: WorkspaceSpec | None  # None: XLA collectives

    def gather(self, xs, fn, *args):
        return all_gather_overlapped(xs, fn, *args, axis_name=self.axis_name, seq_axis=1, workspace=self.spec)

    def give_back(self, grads, fn, *args):
        return grad_return_overlapped(
            grads, fn, *args, axis_name=self.axis_name, seq_axis=1, workspace=self.spec
        )


@dataclasses.dataclass(frozen=True)
class NoTransfer:
    """A rank of ``n`` alone: the gathered arrays are n copies of the local ones (not the other
    ranks' data: for timing only), and the returned gradients are their first S/n rows (the shape
    a rank gets back, not its chunks). The whole gradients are materialized first, as a transport
    would read them (without the barrier XLA would compute only the rows kept, and the timing
    would miss work a real rank does)."""

    n: int

    def gather(self, xs, fn, *args):
        return tuple(jnp.concatenate([x] * self.n, axis=1) for x in xs), fn(*args)

    def give_back(self, grads, fn, *args):
        grads = jax.lax.optimization_barrier(tuple(grads))
        return tuple(g[:, : g.shape[1] // self.n] for g in grads), fn(*args)
