"""For a window that reaches past the neighbouring chunk (a side of c or more): only the other
ranks' chunks that the rank's queries can see travel, whole, on the XLA transport (``ppermute``),
instead of the all-gather of all K/V.

Rank r of R holds chunks r and 2R-1-r (c rows each). Under a window ``(left, right)`` (right 0
when causal) chunk j sees chunks ``j - D_l .. j + D_r``, ``D = ceil(side / c)``. A **slot** is one
of the rank's two chunks and one offset ``o`` in ``[-D_l, -1]`` or ``[1, D_r]``: chunk
``s = j + o``. It is **real** when that chunk exists (``0 <= s < 2R``), is not one of the rank's
own (the local part has those) and no earlier slot holds it. Which slots are real depends on r
only, so it is known at trace time for every rank:

- each slot is moved by ``ppermute`` s whose pairs are its real moves (owner -> r): chunk s is
  rank s's first chunk for s < R, else rank 2R-1-s's second, so a slot takes at most two
  permutes, one of first chunks and one of second chunks; a rank receives one chunk per real
  slot, at most ``2 (D_l + D_r)`` against the gather's 2R-2;
- the rows a rank gets, ``[B, n_slots * c, ...]``, hold the real slots' chunks in increasing
  global position, then the other slots as zeros at positions ``PAD_HIGH + i`` (``halo.py``'s
  padding, beyond every window), so :func:`rank_positions` gives strictly increasing positions
  and ``masks.visibility`` takes them as they are.

The return (:func:`return_grads`) sends each slot's cotangent back along its permutes; each owner
adds, for each of its chunks, the cotangents of every slot that held it in float32 in slot order,
and rounds once. Where the busiest rank needs every other chunk anyway, :func:`layout` returns
None and the layer gathers (one collective moves the same to it).

Plain calls (cuDNN's, for a causal window of a chunk or more) read spans of the keys in natural
order: :func:`gather_natural` moves the same chunks and lays them out as the all-gather would,
``[B, S, ...]`` with the rank's own chunks and the reached ones in place and zeros elsewhere (no
query sees them); :func:`return_natural` is its transpose, the rank's own chunks' cotangents
added first.

The peer transport gathers from the ranks within the window's reach instead
(``WorkspaceSpec.within``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import per_rank
from .halo import PAD_HIGH
from .rounding import rounded

I32 = jnp.int32


def chunks_reached(side: int, c: int, n: int) -> int:
    """How many chunks a side reaches: ceil(side / c), at most the 2n - 1 others."""
    return min(-(-side // c), 2 * n - 1)


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """The slots of every rank, as numpy tables ``[R, n_slots]``: ``chunk`` (the global chunk a
    slot holds, -1 where it is not real) and ``order`` (the slots in the rank's row order: real
    ones by chunk, then the rest)."""

    num_ranks: int
    chunk_len: int
    offsets: tuple[tuple[int, int], ...]  # (which own chunk, 0 or 1; offset o) per slot
    chunk: np.ndarray
    order: np.ndarray

    @property
    def n_slots(self) -> int:
        return len(self.offsets)

    @property
    def rows(self) -> int:
        return self.n_slots * self.chunk_len

    def owner(self, chunk: int) -> tuple[int, bool]:
        """(the rank holding global chunk ``chunk``, whether it is that rank's first chunk)."""
        n = self.num_ranks
        return (chunk, True) if chunk < n else (2 * n - 1 - chunk, False)

    def pairs(self, slot: int, first: bool) -> list[tuple[int, int]]:
        """Slot ``slot``'s real moves (owner, receiver) of owners' first (or second) chunks."""
        moves = []
        for r in range(self.num_ranks):
            s = int(self.chunk[r, slot])
            if s >= 0 and self.owner(s)[1] == first:
                moves.append((self.owner(s)[0], r))
        return moves

    def real_slots(self) -> int:
        """The most real slots of any rank: the chunks it receives."""
        return int((self.chunk >= 0).sum(axis=1).max())


@functools.cache
def layout(num_ranks: int, chunk_len: int, left: int, right: int) -> Layout | None:
    """The slots for a window whose sides in effect are ``(left, right)``, or None where no side
    reaches past the neighbouring chunk (the halo's case), at R = 1, or where the busiest rank
    needs every other chunk anyway."""
    n, c = num_ranks, chunk_len
    if n == 1 or (left < c and right < c):
        return None
    steps = [*range(-chunks_reached(left, c, n), 0), *range(1, chunks_reached(right, c, n) + 1)]
    offsets = tuple((a, o) for a in (0, 1) for o in steps)
    chunk = np.full((n, len(offsets)), -1, np.int64)
    for r in range(n):
        own = (r, 2 * n - 1 - r)
        seen: set[int] = set()
        for k, (a, o) in enumerate(offsets):
            s = own[a] + o
            if 0 <= s < 2 * n and s not in own and s not in seen:
                chunk[r, k] = s
                seen.add(s)
    key = np.where(chunk >= 0, chunk, 2 * n + np.arange(len(offsets)))  # real by chunk, then the rest
    lay = Layout(n, c, offsets, chunk, np.argsort(key, axis=1, kind="stable"))
    return None if lay.real_slots() >= 2 * n - 2 else lay


def positions(lay: Layout, rank: int):
    """numpy ``(positions int32 [rows], valid bool [rows])`` of rank ``rank``'s rows."""
    c = lay.chunk_len
    pos, valid = [], []
    for i, k in enumerate(lay.order[rank]):
        s = int(lay.chunk[rank, k])
        pos.append(s * c + np.arange(c) if s >= 0 else PAD_HIGH + i * c + np.arange(c))
        valid.append(np.full(c, s >= 0))
    return np.concatenate(pos).astype(np.int32), np.concatenate(valid)


def rank_positions(lay: Layout, rank):
    """:func:`positions` for a rank that may be traced (tables indexed at run time)."""
    pos, valid = zip(*(positions(lay, r) for r in range(lay.num_ranks)), strict=True)
    return per_rank.row(np.stack(pos), rank), per_rank.row(np.stack(valid), rank)


def _chunks(x, c: int):
    """The rank's (first, second) chunk of ``x [B, 2c, ...]``."""
    return x[:, :c], x[:, c:]


def _permute(x, axis_name: str, pairs):
    if not pairs:
        return jnp.zeros_like(x)
    return jax.lax.ppermute(x, axis_name, pairs)


def _slot_rows(lay: Layout, x, axis_name: str, slot: int, rank):
    """The chunk that slot ``slot`` brings to this rank (zeros where it is not real)."""
    first, second = _chunks(x, lay.chunk_len)
    a = _permute(first, axis_name, lay.pairs(slot, True))
    b = _permute(second, axis_name, lay.pairs(slot, False))
    from_first = np.asarray([lay.owner(int(s))[1] if s >= 0 else True for s in lay.chunk[:, slot]])
    return jnp.where(per_rank.row(from_first, rank), a, b)


def _slots(lay: Layout, x, axis_name: str, rank):
    """``[B, n_slots, c, ...]``: the chunk each slot brings, in slot order (zeros where not real)."""
    return jnp.stack([_slot_rows(lay, x, axis_name, k, rank) for k in range(lay.n_slots)], axis=1)


def exchange(lay: Layout, xs: tuple, axis_name: str):
    """Each array of ``xs`` (the rank's ``[B, 2c, ...]``) -> its rows ``[B, n_slots * c, ...]``
    (the module's order)."""
    rank = jax.lax.axis_index(axis_name).astype(I32)
    order = per_rank.row(lay.order, rank)
    out = []
    for x in xs:
        rows = jnp.take(_slots(lay, x, axis_name, rank), order, axis=1)
        out.append(rows.reshape(x.shape[0], lay.rows, *x.shape[2:]))
    return tuple(out)


def _send_back(lay: Layout, slots, axis_name: str, rank, acc_first, acc_second):
    """``(acc_first, acc_second)`` (float32 ``[B, c, ...]``, the rank's two chunks) plus the
    cotangents of every slot that held them, from the ranks that hold those slots: ``slots``
    ``[B, n_slots, c, ...]`` in slot order, each sent back along its permutes, added in slot order."""
    real = per_rank.row(lay.chunk >= 0, rank)
    for k in range(lay.n_slots):
        g = jnp.where(real[k], slots[:, k], jnp.zeros_like(slots[:, k]))
        for first in (True, False):  # each move back the way it came
            back = _permute(g, axis_name, [(dst, src) for src, dst in lay.pairs(k, first)])
            if first:
                acc_first = acc_first + back.astype(jnp.float32)
            else:
                acc_second = acc_second + back.astype(jnp.float32)
    return acc_first, acc_second


def return_grads(lay: Layout, cts: tuple, axis_name: str):
    """The transpose of :func:`exchange`: each cotangent ``[B, n_slots * c, ...]`` of the rows
    -> the owners' ``[B, 2c, ...]``, summed in float32 in slot order, rounded once."""
    rank = jax.lax.axis_index(axis_name).astype(I32)
    c = lay.chunk_len
    inverse = per_rank.row(np.argsort(lay.order, axis=1), rank)
    out = []
    for ct in cts:
        slots = jnp.take(ct.reshape(ct.shape[0], lay.n_slots, c, *ct.shape[2:]), inverse, axis=1)
        zeros = jnp.zeros((ct.shape[0], c, *ct.shape[2:]), jnp.float32)
        acc_first, acc_second = _send_back(lay, slots, axis_name, rank, zeros, zeros)
        out.append(rounded(jnp.concatenate([acc_first, acc_second], axis=1), ct.dtype))
    return tuple(out)


def _natural_sources(lay: Layout) -> np.ndarray:
    """int ``[R, 2R]``: where each global chunk of rank r's natural-order rows comes from, as an
    index into ``[own first, own second, slot 0, .., slot n_slots - 1, zeros]``."""
    n = lay.num_ranks
    src = np.full((n, 2 * n), 2 + lay.n_slots)
    for r in range(n):
        src[r, r], src[r, 2 * n - 1 - r] = 0, 1
        for k, s in enumerate(lay.chunk[r]):
            if s >= 0:
                src[r, s] = 2 + k
    return src


def gather_natural(lay: Layout, xs: tuple, axis_name: str):
    """Each array of ``xs`` (the rank's ``[B, 2c, ...]``) -> ``[B, 2Rc, ...]`` in natural order:
    the rank's own chunks and the chunks its window reaches in place, zeros elsewhere; only the
    reached chunks travel."""
    rank = jax.lax.axis_index(axis_name).astype(I32)
    c, n = lay.chunk_len, lay.num_ranks
    src = per_rank.row(_natural_sources(lay), rank)
    out = []
    for x in xs:
        first, second = _chunks(x, c)
        zeros = jnp.zeros_like(first)[:, None]
        pieces = jnp.concatenate([first[:, None], second[:, None], _slots(lay, x, axis_name, rank), zeros], 1)
        out.append(jnp.take(pieces, src, axis=1).reshape(x.shape[0], 2 * n * c, *x.shape[2:]))
    return tuple(out)


def return_natural(lay: Layout, cts: tuple, axis_name: str):
    """The transpose of :func:`gather_natural`: each cotangent ``[B, 2Rc, ...]`` -> the owners'
    ``[B, 2c, ...]``: the rank's own chunks' cotangents, then those of the slots that held them
    (slot order), summed in float32 and rounded once; the rows of chunks not reached are dropped
    (no query read them)."""
    rank = jax.lax.axis_index(axis_name).astype(I32)
    c, n = lay.chunk_len, lay.num_ranks
    held = per_rank.row(np.maximum(lay.chunk, 0), rank)  # the chunk of each slot (any, where not real)
    out = []
    for ct in cts:
        chunks = ct.reshape(ct.shape[0], 2 * n, c, *ct.shape[2:])
        own = jnp.take(chunks, jnp.stack([rank, 2 * n - 1 - rank]), axis=1).astype(jnp.float32)
        slots = jnp.take(chunks, held, axis=1)
        acc_first, acc_second = _send_back(lay, slots, axis_name, rank, own[:, 0], own[:, 1])
        out.append(rounded(jnp.concatenate([acc_first, acc_second], axis=1), ct.dtype))
    return tuple(out)


def transfer_nbytes(lay: Layout, row_nbytes: int) -> int:
    """Bytes the busiest rank receives per array: its real slots' chunks."""
    return lay.real_slots() * lay.chunk_len * row_nbytes
