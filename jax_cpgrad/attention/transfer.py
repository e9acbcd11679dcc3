"""How the layer moves K/V, dK/dV and segment ids: each move of K/V or dK/dV with given work run
while it is in flight.

The protocol (:class:`Transfer`): ``gather(xs, fn, *args)`` returns ``(all_gather(xs),
fn(*args))``; ``return_grads(grads, fn, *args)`` returns ``(grad_return(grads), fn(*args))``;
``near(reach)`` is the transfer whose gather and return need only the ranks within ``reach``;
``gather_ids(words)`` gathers int32 words ``[B, T, W]`` (the segment ids) into natural order
``[B, S, W]``, exactly, outside any differentiation. For a window whose sides fit in a chunk the
layer moves only the halo (``halo.py``): ``halo(xs, window, fn, *args)`` returns ``(the halo
rows of each array [B, 2 * (left + right), ...], fn(*args))`` (``Halo.rows``; their positions
are ``halo.rank_positions``'), and ``return_halo(grads, window, chunk_len, fn, *args)`` its
transpose, ``(each owner's [B, 2c, ...] gradients, fn(*args))``, the owner adding the returned
rows in float32. A transfer with ``moves_window_chunks`` also moves a wider window's chunks alone
(``window_chunks.py``): ``chunks(xs, layout, fn, *args)`` and ``return_chunks(grads, layout, fn,
*args)``, the same way; with ``natural=True`` the chunks are laid out in natural order ``[B, S,
...]``, zeros where no chunk came (for plain calls, which read spans of it).
:class:`OnMeshAxis` is jax_cpgrad's transport on a mesh axis (peer transport with a workspace,
XLA collectives without);
``emulation.NoTransfer`` stands in for it on one device, to measure a rank's attention.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp

from ..api import all_gather, all_gather_overlapped, grad_return_overlapped
from ..spec import WorkspaceSpec
from . import window_chunks
from .halo import halo_exchange_overlapped, halo_return_overlapped


class Transfer(Protocol):
    def gather(self, xs, fn, *args): ...

    def return_grads(self, grads, fn, *args): ...

    def gather_ids(self, words): ...

    def halo(self, xs, window, fn, *args): ...

    def return_halo(self, grads, window, chunk_len, fn, *args): ...

    moves_window_chunks: bool

    def near(self, reach: int) -> Transfer: ...

    def chunks(self, xs, layout, fn, *args, natural: bool = False): ...

    def return_chunks(self, grads, layout, fn, *args, natural: bool = False): ...


@dataclasses.dataclass(frozen=True)
class OnMeshAxis:
    axis_name: str
    spec: WorkspaceSpec | None  # None: XLA collectives

    def gather(self, xs, fn, *args):
        return all_gather_overlapped(xs, fn, *args, axis_name=self.axis_name, seq_axis=1, workspace=self.spec)

    def return_grads(self, grads, fn, *args):
        return grad_return_overlapped(
            grads, fn, *args, axis_name=self.axis_name, seq_axis=1, workspace=self.spec
        )

    def halo(self, xs, window, fn, *args):
        left, right = window
        halo, y = halo_exchange_overlapped(
            tuple(xs), fn, *args, axis_name=self.axis_name, left=left, right=right, workspace=self.spec
        )
        return halo.rows, y

    def return_halo(self, grads, window, chunk_len, fn, *args):
        left, right = window
        return halo_return_overlapped(
            tuple(grads), fn, *args, axis_name=self.axis_name, left=left, right=right,
            chunk_len=chunk_len, workspace=self.spec,
        )  # fmt: skip

    @property
    def moves_window_chunks(self) -> bool:
        """A wide window's chunks travel alone on XLA's permutes; the peer transport gathers
        them from the ranks within the window's reach (:meth:`near`)."""
        return self.spec is None

    def near(self, reach: int) -> OnMeshAxis:
        """This transport, its gather and return moving only the data of ranks within
        ``reach`` of each rank (the others' rows arrive as zeros), 0 for every rank: the peer
        transport's ``WorkspaceSpec.within``. XLA's collectives move everything."""
        if self.spec is None or reach == 0:
            return self
        return dataclasses.replace(self, spec=self.spec.within(reach))

    def chunks(self, xs, layout, fn, *args, natural: bool = False):
        y = fn(*args)  # XLA schedules its collective-permutes asynchronously around this
        move = window_chunks.gather_natural if natural else window_chunks.exchange
        return move(layout, tuple(xs), self.axis_name), y

    def return_chunks(self, grads, layout, fn, *args, natural: bool = False):
        y = fn(*args)
        back = window_chunks.return_natural if natural else window_chunks.return_grads
        return back(layout, tuple(grads), self.axis_name), y

    def gather_ids(self, words):
        """Over the same transport as K/V (XLA's collectives fail for processes sharing a GPU),
        which moves floats: the int32 words travel bitcast to float32 and come back bit for bit."""
        bits = jax.lax.bitcast_convert_type(jax.lax.stop_gradient(words), jnp.float32)
        gathered = all_gather(bits, axis_name=self.axis_name, seq_axis=1, workspace=self.spec)
        return jax.lax.bitcast_convert_type(gathered, jnp.int32)
