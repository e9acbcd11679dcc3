"""Which tiles an attention kernel visits, from the per-row intervals of ``masks.Visibility``.

A pass has outer tiles (each a program of the kernel's grid, or one step of its loop) and inner
tiles (what each outer tile loops over): query tiles over key tiles for the forward and dQ passes
(from ``row_lo``/``row_hi``), key tiles over query tiles for the dK/dV pass (from ``col_lo``/
``col_hi``). For each batch entry and outer tile, :func:`tile_ranges` gives the inner tiles in
three sections, which is how a kernel should loop::

    [lo, full_lo)        masked: some elements are outside their row's interval
    [full_lo, full_hi)   full: every row sees every element, so no element mask is applied
    [full_hi, hi)        masked again

so a kernel skips every tile outside ``[lo, hi)`` and pays for the element mask only where it can
change the result. Plain jnp, so that it runs (and is tested) on the CPU and is the same plan for
the XLA blockwise path and the Mosaic GPU kernels.

Why one range of each kind suffices. Row r (a query for rows, a key for columns) meets the inner
tiles ``[lo_r // ib, ceil(hi_r / ib))`` and contains whole the tiles
``[ceil(lo_r / ib), min(hi_r, inner_len) // ib)``; both are ranges. The tiles full for EVERY row of
an outer tile are the intersection of the rows' full ranges: always exactly one range (empty when a
row is empty, since then ``ceil(lo/ib) >= hi // ib``), whatever the intervals are. The visited tiles
are the union of the rows' ranges; :func:`tile_ranges` returns its hull ``[min, max)``, which always
contains every visited tile, so no visible element is ever lost. The hull equals the union when
each non-empty row's interval meets or touches the next one's. It does when consecutive rows hold
consecutive positions whose own keys are consecutive key indices (self-attention, a CP rank's
chunk against the natural order or its own chunks; causal, windows, contiguous documents): row
r+1 sees its own key, index i + 1, so its interval starts at or before i + 1, and row r's ends
after its own key i. Where positions jump inside one outer tile (a CP rank's two chunks, with a
chunk length that is not a multiple of the outer tile) the hull may hold tiles that no row sees:
they are visited with the element mask, which is wasted work, never a wrong result.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

I32 = jnp.int32


def cdiv(a, b):
    """Ceiling division, for Python ints and integer arrays alike."""
    return -(-a // b)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TileRanges:
    """One pass's plan: for every (batch entry, outer tile), the inner tiles it visits.

    All int32 ``[Bp, n_outer]``, with ``lo <= full_lo <= full_hi <= hi`` (``lo == hi``: nothing to
    visit). ``order`` lists the outer tiles heaviest first (most inner tiles, ties by index), the
    order in which a persistent kernel should hand them out so that the long ones do not end last.
    """

    lo: jax.Array  # first inner tile visited
    full_lo: jax.Array  # first inner tile that needs no element mask
    full_hi: jax.Array  # end of the unmasked inner tiles
    hi: jax.Array  # end (exclusive) of the visited inner tiles
    order: jax.Array  # the outer tiles, heaviest first

    @property
    def n_outer(self) -> int:
        return self.lo.shape[-1]


def tile_ranges(lo_rows, hi_rows, *, outer_block: int, inner_block: int, inner_len: int) -> TileRanges:
    """The plan of one pass from one side's intervals ``lo_rows, hi_rows`` (int32 ``[Bp, T]``).

    Rows are grouped ``outer_block`` at a time (a missing row of a last partial tile sees
    nothing); the inner index range ``[0, inner_len)`` is cut into tiles of ``inner_block``.
    Inner tile j is visited iff some row of the outer tile has a non-empty interval meeting
    ``[j*ib, (j+1)*ib)``, and full iff every row's interval contains all of it (so a tile with an
    empty row, or the partial last inner tile, is never full). Intervals are clipped to
    ``[0, inner_len]`` first. See the module docstring for why one range of each is enough.
    """
    if outer_block < 1 or inner_block < 1:
        raise ValueError(f"tile_ranges: blocks must be >= 1, got {outer_block=}, {inner_block=}")
    lo_rows, hi_rows = jnp.asarray(lo_rows, I32), jnp.asarray(hi_rows, I32)
    if lo_rows.ndim != 2 or lo_rows.shape != hi_rows.shape:
        raise ValueError(
            f"tile_ranges: lo_rows and hi_rows must both be [Bp, T], got {lo_rows.shape}, {hi_rows.shape}"
        )
    bp, t = lo_rows.shape
    ob, ib = outer_block, inner_block
    n_outer, n_inner = cdiv(t, ob), cdiv(inner_len, ib)

    # Missing rows of the last outer tile: empty intervals, which never visit and are never full.
    pad = ((0, 0), (0, n_outer * ob - t))
    lo = jnp.pad(jnp.clip(lo_rows, 0, inner_len), pad).reshape(bp, n_outer, ob)
    hi = jnp.pad(jnp.clip(hi_rows, 0, inner_len), pad).reshape(bp, n_outer, ob)
    seen = lo < hi

    # Visited: the hull of the non-empty rows' tile ranges [lo // ib, ceil(hi / ib)).
    any_seen = seen.any(axis=-1)
    v_lo = jnp.where(seen, lo // ib, n_inner).min(axis=-1)
    v_hi = jnp.where(seen, cdiv(hi, ib), 0).max(axis=-1)
    v_lo, v_hi = jnp.where(any_seen, v_lo, 0), jnp.where(any_seen, v_hi, 0)

    # Full: the intersection of every row's whole-tile range [ceil(lo / ib), hi // ib); hi is
    # already <= inner_len, so the partial last tile never counts.
    f_lo = cdiv(lo, ib).max(axis=-1)
    f_hi = (hi // ib).min(axis=-1)
    has_full = f_lo < f_hi
    # A full tile is visited by construction; the clip only keeps the invariant for any input.
    full_lo = jnp.where(has_full, jnp.clip(f_lo, v_lo, v_hi), v_lo)
    full_hi = jnp.where(has_full, jnp.clip(f_hi, full_lo, v_hi), full_lo)

    work = v_hi - v_lo
    order = _heaviest_first(work)
    return TileRanges(
        lo=v_lo.astype(I32),
        full_lo=full_lo.astype(I32),
        full_hi=full_hi.astype(I32),
        hi=v_hi.astype(I32),
        order=order.astype(I32),
    )


def _heaviest_first(work):
    """The indices of ``work``'s last axis, largest first, ties in index order (a stable sort).
    Not ``jnp.argsort``: under ``jax.ensure_compile_time_eval`` (``Visibility.derive``) in a
    ``shard_map``, jax 0.12.1's argsort folds its index array to a constant and then fails to mark
    it as varying over the mesh axis ("pvary should be called under jax.shard_map"). An index
    computed from ``work`` itself is a traced value, varying as ``work`` is."""
    index = jax.lax.broadcasted_iota(work.dtype, work.shape, work.ndim - 1) + work * 0
    return jax.lax.sort((-work, index), dimension=work.ndim - 1, is_stable=True, num_keys=1)[1]


def over_inner_tiles(lo, full_lo, full_hi, hi, body, carry=None):
    """``carry = body(j, carry, masked=...)`` for the inner tiles ``j`` of ``[lo, hi)`` of one
    outer tile, in order: those before the unmasked range and after it with ``masked=True`` (they
    need the element mask), those of ``[full_lo, full_hi)`` with ``masked=False``. The loop of
    every kernel that follows the plan; returns the last carry."""
    carry = jax.lax.fori_loop(lo, full_lo, functools.partial(body, masked=True), carry)
    carry = jax.lax.fori_loop(full_lo, full_hi, functools.partial(body, masked=False), carry)
    return jax.lax.fori_loop(full_hi, hi, functools.partial(body, masked=True), carry)


def num_visited(ranges: TileRanges):
    """int32 scalar: the (outer, inner) tile pairs visited, over all batch entries."""
    return jnp.sum(ranges.hi - ranges.lo, dtype=I32)


def num_masked(ranges: TileRanges):
    """int32 scalar: the visited tile pairs that need the element mask."""
    return num_visited(ranges) - jnp.sum(ranges.full_hi - ranges.full_lo, dtype=I32)


def num_full(ranges: TileRanges):
    """int32 scalar: the visited tile pairs that need no element mask."""
    return jnp.sum(ranges.full_hi - ranges.full_lo, dtype=I32)
