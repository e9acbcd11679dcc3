"""Attention masks as data, in global positions, and the per-row key intervals they reduce to.

A query at position p sees a key at position k when all of these that are asked for hold:

- causal: k <= p;
- window ``(left, right)`` (``jax.nn.dot_product_attention``'s ``local_window_size``):
  p - k <= left and k - p <= right (``None`` on a side: unbounded);
- documents: the query's segment id equals the key's.

The static part (``causal``, ``window``) is a hashable :class:`Mask`; positions and segment ids
are arrays. Kernels never see the mask itself: with positions increasing along the rows and each
segment id one contiguous run of the natural order (packed documents), the keys a query row sees
are one interval of key indices ``[lo, hi)``, and the queries that see a key are one interval of
query indices. :func:`row_intervals` and :func:`column_intervals` compute them;
``jax_cpgrad.attention.tile_plan`` turns them into the tiles a kernel visits. :func:`visible` is
the dense form, for references and tests.

Segment ids are first renumbered by :func:`run_ids` (each contiguous run of equal ids its own id,
non-decreasing along the natural order), so that "same id" means "same run": an id that appears
in two separate runs of the sequence is two documents here (``jax.nn.dot_product_attention``
would join them).

Shapes: ``q_pos [T]`` and ``k_pos [L]`` int32, shared by every batch row; ``q_run [B, T]`` and
``k_run [B, L]`` int32 or None. Results carry a leading batch dimension Bp: B with runs, 1
without.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import per_rank
from .checkpointing import named_masks

I32 = jnp.int32
# Positions and window bounds are clipped here, so that p - left and p + right stay in int32.
_FAR = 1 << 30


@dataclasses.dataclass(frozen=True)
class Mask:
    """The static part of a mask: causal, and a window ``(left, right)`` or None."""

    causal: bool = False
    window: tuple[int | None, int | None] | None = None

    @property
    def left(self) -> int | None:
        return None if self.window is None else self.window[0]

    @property
    def right(self) -> int | None:
        """The right bound in effect: 0 when causal (a causal query sees no later key)."""
        right = None if self.window is None else self.window[1]
        return 0 if self.causal else right


def normalize_window(local_window_size, where: str = "local_window_size") -> tuple[int, int] | None:
    """``jax.nn.dot_product_attention``'s ``local_window_size`` as ``(left, right)``: an int w is
    ``(w, w)``; None stays None. Anything else is a ``ValueError`` naming ``where``."""
    if local_window_size is None:
        return None
    is_int = lambda x: isinstance(x, (int, np.integer)) and not isinstance(x, bool)
    if is_int(local_window_size):
        sides = (local_window_size, local_window_size)
    elif isinstance(local_window_size, (tuple, list)) and len(local_window_size) == 2:
        sides = tuple(local_window_size)
    else:
        raise ValueError(
            f"{where} must be None, an int w (a window of w on each side) or a pair (left, right) "
            f"of ints, got {local_window_size!r}"
        )
    if not all(is_int(s) and s >= 0 for s in sides):
        raise ValueError(f"{where}: both sides must be ints >= 0, got {local_window_size!r}")
    return int(sides[0]), int(sides[1])


def within_documents(window, longest: int | None, causal: bool) -> tuple[int, int] | None:
    """The window ``(left, right)`` (or None) narrowed to what documents of at most ``longest``
    tokens let a query see anyway: no key more than ``longest - 1`` positions away on either side
    (a causal query none after it). With documents that short the mask is the same, and the
    narrower window lets the transfer move only what it reaches (a halo under a chunk). None:
    no bound, the window as it is."""
    if longest is None:
        return window
    reach = longest - 1
    bound = (reach, 0 if causal else reach)
    if window is None:
        return bound
    return min(window[0], bound[0]), min(window[1], bound[1])


def run_ids(segment_ids):
    """int32 ``[B, S]``: 0 for the first run of equal ids in each row, +1 at every change, so each
    contiguous run of the natural order is one id and ids never decrease along a row."""
    ids = jnp.asarray(segment_ids)
    changes = (ids[:, 1:] != ids[:, :-1]).astype(I32)
    # a parallel prefix sum in log2(S) straight-line steps: jnp.cumsum may lower to a loop of one
    # step per token (jax.export for CUDA gives a while loop)
    counts = jax.lax.associative_scan(jnp.add, changes, axis=1)
    return jnp.concatenate([jnp.zeros_like(changes[:, :1]), counts], axis=1)


def visible(mask: Mask, q_pos, k_pos, q_seg=None, k_seg=None):
    """bool ``[Bp, T, L]``: which keys each query sees (any segment ids: plain equality)."""
    p, k = jnp.asarray(q_pos)[:, None], jnp.asarray(k_pos)[None, :]
    seen = jnp.ones(p.shape[:1] + k.shape[1:], bool)
    if mask.causal:
        seen &= k <= p
    if mask.left is not None:
        seen &= p - k <= mask.left
    if mask.right is not None:
        seen &= k - p <= mask.right
    seen = seen[None]
    if q_seg is not None:
        seen = seen & (jnp.asarray(q_seg)[:, :, None] == jnp.asarray(k_seg)[:, None, :])
    return seen


def _clip(x):
    return jnp.clip(x, -_FAR, _FAR).astype(I32)


def _search(sorted_values, targets, side: str):
    """searchsorted along the last axis of both (``sorted_values [L]`` or ``[Bp, L]``).

    Unrolled: jnp's default search is a while loop, and XLA runs each of its 12-17 steps on a GPU
    as launches of their own, with the loop's test read back between steps. On an H200 the six
    searches of a rank's masks took more time than its attention (2.8 ms for 0.56 ms of kernels,
    window 512 at R = 8, ``benchmarks/results``); unrolled they are straight-line code."""
    search = lambda s, t: jnp.searchsorted(s, t, side=side, method="scan_unrolled")
    if sorted_values.ndim == 1:
        return search(sorted_values, targets).astype(I32)
    return jax.vmap(search)(sorted_values, targets).astype(I32)


def _intervals(lo_pos, hi_pos, own_run, other_pos, other_run):
    """Indices ``[lo, hi)`` of the ``other`` rows with lo_pos <= position <= hi_pos and the same
    run as the row (``own_run [Bp, T]`` or None); an empty interval is ``lo == hi``."""
    lo = _search(jnp.asarray(other_pos), _clip(lo_pos), "left")[None]
    hi = _search(jnp.asarray(other_pos), _clip(hi_pos), "right")[None]
    if own_run is not None:
        lo = jnp.maximum(lo, _search(other_run, own_run, "left"))
        hi = jnp.minimum(hi, _search(other_run, own_run, "right"))
    return lo, jnp.maximum(hi, lo)


def _checked_runs(q_run, k_run):
    if (q_run is None) != (k_run is None):
        raise ValueError("masks: give run ids for both the queries and the keys, or for neither")
    if q_run is None:
        return None, None
    return jnp.asarray(q_run, I32), jnp.asarray(k_run, I32)


def row_intervals(mask: Mask, q_pos, k_pos, q_run=None, k_run=None):
    """int32 ``(lo, hi)``, each ``[Bp, T]``: query row t sees key indices ``[lo, hi)``.

    ``k_pos`` must increase along the keys and ``k_run`` (from :func:`run_ids`) must not
    decrease; then this equals :func:`visible` row by row."""
    q_run, k_run = _checked_runs(q_run, k_run)
    p = jnp.asarray(q_pos, I32)
    lo_pos = p - min(mask.left, _FAR) if mask.left is not None else jnp.full_like(p, -_FAR)
    hi_pos = jnp.full_like(p, _FAR)
    if mask.causal:
        hi_pos = p
    if mask.right is not None:
        hi_pos = jnp.minimum(hi_pos, p + min(mask.right, _FAR))
    return _intervals(lo_pos, hi_pos, q_run, k_pos, k_run)


def column_intervals(mask: Mask, q_pos, k_pos, q_run=None, k_run=None):
    """int32 ``(lo, hi)``, each ``[Bp, L]``: key l is seen by query indices ``[lo, hi)``.

    ``q_pos`` must increase along the queries and ``q_run`` must not decrease; then this equals
    :func:`visible` column by column."""
    q_run, k_run = _checked_runs(q_run, k_run)
    k = jnp.asarray(k_pos, I32)
    lo_pos = jnp.full_like(k, -_FAR)
    if mask.causal:
        lo_pos = k
    if mask.right is not None:
        lo_pos = jnp.maximum(lo_pos, k - min(mask.right, _FAR))
    hi_pos = k + min(mask.left, _FAR) if mask.left is not None else jnp.full_like(k, _FAR)
    return _intervals(lo_pos, hi_pos, k_run, q_pos, q_run)


def interval_mask(lo, hi, length: int):
    """bool ``[Bp, T, length]``: index j lies in row t's ``[lo, hi)``."""
    j = jnp.arange(length, dtype=I32)
    return (lo[..., None] <= j) & (j < hi[..., None])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Visibility:
    """What a kernel call needs to know of its mask: for each query row the key indices it sees,
    and for each key the query indices that see it (int32, each ``[lo, hi)``, leading dim Bp)."""

    row_lo: jax.Array  # [Bp, T]
    row_hi: jax.Array  # [Bp, T]
    col_lo: jax.Array  # [Bp, L]
    col_hi: jax.Array  # [Bp, L]
    # One rank's Visibility of a mask that depends on the rank alone (no documents): every rank's
    # (``per_rank.Table``) and this one's index, from which :meth:`derive` looks values up.
    rank: Any = None
    by_rank: per_rank.Table | None = dataclasses.field(default=None, metadata=dict(static=True))
    # What kernels made of it ahead of their calls (:meth:`with_derived`), under ``derived_keys``:
    # the layer makes its kernels' tile plans with its masks, before its custom VJP, and they
    # travel with the calls as residuals, so that a ``lax.scan`` over layers does not make the
    # backward's in every step.
    derived: tuple = ()
    derived_keys: tuple = dataclasses.field(default=(), metadata=dict(static=True))

    @property
    def q_len(self) -> int:
        return self.row_lo.shape[-1]

    @property
    def k_len(self) -> int:
        return self.col_lo.shape[-1]

    def dense(self):
        """bool ``[Bp, T, L]``, the same relation as :func:`visible`."""
        return interval_mask(self.row_lo, self.row_hi, self.k_len)

    def derive(self, fn: Callable[[Visibility], Any], key: Hashable):
        """``fn(self)``: what a kernel makes of the mask (its tile plan), a pytree of arrays.
        Where this is one rank's Visibility of a mask of the rank alone (``by_rank``), ``fn``
        runs for every rank's at trace time and the program looks this rank's up
        (``per_rank.py``; ``key`` names what ``fn`` depends on besides the mask, for its cache);
        on concrete intervals it runs at trace time too. A value made ahead under ``key``
        (:meth:`with_derived`) is taken as it is."""
        if key in self.derived_keys:
            return self.derived[self.derived_keys.index(key)]
        table = self.by_rank
        if table is None:  # named: a checkpoint policy may keep it (checkpointing.py)
            with jax.ensure_compile_time_eval():
                return named_masks(fn(self))
        cache_key = None if table.key is None else (table.key, key)
        return named_masks(
            per_rank.tabulate(lambda r: fn(table.values[r]), self.rank, table.num_ranks, cache_key)[0]
        )

    def with_derived(self, fn: Callable[[Visibility], Any], key: Hashable) -> Visibility:
        """This Visibility with ``derive(fn, key)`` made now and kept (``derived``), for a later
        ``derive`` of that key; itself where that is kept already or would be looked up from the
        rank tables (cheap, and shared by the layers without it)."""
        if key in self.derived_keys or self.by_rank is not None:
            return self
        value = self.derive(fn, key)
        return dataclasses.replace(
            self, derived=(*self.derived, value), derived_keys=(*self.derived_keys, key)
        )


def with_ranks(tree, table: per_rank.Table, rank):
    """``tree`` (one rank's value of ``table``, ``per_rank.tabulate``'s) with each of its
    Visibility given every rank's and the rank's index, for :meth:`Visibility.derive`."""
    is_vis = lambda x: isinstance(x, Visibility)

    def attach(path, vis, *each):
        if not is_vis(vis):
            return vis
        key = None if table.key is None else (table.key, jax.tree_util.keystr(path))
        return dataclasses.replace(vis, rank=rank, by_rank=per_rank.Table(each, key))

    return jax.tree_util.tree_map_with_path(attach, tree, *table.values, is_leaf=is_vis)


def visibility(mask: Mask, q_pos, k_pos, q_run=None, k_run=None) -> Visibility:
    """The :class:`Visibility` of queries at ``q_pos`` against keys at ``k_pos`` (both increasing;
    runs from :func:`run_ids` or None)."""
    return Visibility(
        *row_intervals(mask, q_pos, k_pos, q_run, k_run), *column_intervals(mask, q_pos, k_pos, q_run, k_run)
    )
