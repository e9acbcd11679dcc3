"""Which of a CP rank's queries meet which keys: the rank's kernel calls, returned as data.

Rank r of R holds global chunks r and 2R-1-r (c tokens each) of the queries, keys and values, in
that order (the load-balanced layout). Its attention is split in two parts, each a few
:class:`Call` s of one static shape on every rank:

- **local**: what needs only the rank's own keys, so it can run while the others travel;
- **remote**: what needs the gathered keys (natural order, length S = 2Rc).

Plain calls (causal or full; cuDNN or XLA):

- local. Causal: each query chunk against its own key chunk (the diagonal blocks, causal; the two
  chunks folded into the batch). Not causal: all the rank's queries against its own 2c keys.
- remote. Not causal: all queries against the 2R-2 key chunks of the other ranks. Causal: chunk
  r sees keys [0, rc) and chunk 2R-1-r sees [0, (2R-1-r)c), in two calls:
    * **paired**: the two query chunks against the two halves of the keys (the gathered keys
      as they arrived, seen as two batch entries: no copy): chunk r against the first half's
      first rc keys, chunk 2R-1-r against the second half's first (R-1-r)c. The counts are
      run-time values that always add up to R-1 chunks, so the call is the same size on every
      rank and neither entry waits on the other.
    * **far**: chunk 2R-1-r against the whole first half (Rc keys), which it always sees: a
      static key count, so those keys are copied out and the call needs no mask.
  The far chunk's two results are merged with the local part's by log-sum-exp, and its key
  gradients from the two calls are summed in float32.

Masked calls (documents, a window, or plain attention for a kernel that takes only masks; a
:class:`~jax_cpgrad.attention.masks.Visibility` each, from global positions and the documents' run
ids, ``masks.py``):

- local: all the rank's queries against its own 2c keys (positions r c.., (2R-1-r) c..);
- remote: all the rank's queries against the other ranks' 2R-2 chunks, in order (positions stay
  increasing). Left out where no query can see another rank's key: at R = 1, and for a window
  that keeps each query to its own position.
- **causal** documents or windows where the rank gathers K/V: the gathered keys read where
  they lie, not copied out. Each query chunk sees only the keys before its chunk start remotely
  (one interval per row: the far chunk's queries take the rank's first chunk from the gathered
  keys too), and its own chunk's keys locally (the diagonal blocks alone: ``gathered`` keys,
  ``split_at_chunks``).
  The copies of the others' K/V (forward and backward) and of their dK/dV back took as long as
  the remote kernels themselves where documents are short against the chunks (results, finding
  12); the rank's own first chunk's dK/dV from the remote call come back to it in the return,
  which sums every rank's, its own included.
- remote with a **halo** (a window whose sides in effect, left and right, 0 for causal, are both
  smaller than c): the **edge rows** alone (each chunk's first left and last right queries, the
  only ones the window lets see outside their chunk: ``edge_rows``) against the halo rows
  (``halo.py``: the neighbouring chunks' 2 (left + right) edge rows, all that the window lets the
  rank's queries see of the other ranks' keys), which are all that travels. Their Visibility
  comes from the rows' global positions (``halo.rank_positions``, increasing) and the runs of the
  gathered ids at those positions; padding rows (``valid`` False) sit beyond the window's reach,
  and their columns are emptied too, so no query sees them. (Where the two edges of a chunk
  meet, left + right >= c, the call takes all the rows.) A causal window's edges are each
  chunk's first ``left`` rows and see only the ``left`` halo keys before their chunk: the call
  folds both into the batch (``chunk_heads`` rows, ``moved_fold`` keys, ``fold_visibility``)
  and the kernel reads the edge rows of q, out and dO where they lie, with no copy of them.
- remote with a wider window's **chunks** (a side of c or more, on a transfer that moves them
  alone: XLA's permutes, ``moves_window_chunks``): all the rank's queries against the chunks
  the window reaches (``window_chunks.py``), the same way (positions from
  ``window_chunks.rank_positions``). Elsewhere (the peer transport, or a window that reaches
  every chunk) wider windows keep the other ranks' chunks (the K/V gather: on the peer transport
  of the ranks within the window's reach alone, ``window_reach``, the others' rows zeros that no
  query can see).

Plain calls with a causal window (``plain_windows``: a kernel whose plain calls take a left
window, cuDNN's sliding window; a causal window, no documents). Of left < c:

- local: the diagonal blocks (``fold``, as plain causal) with the window (``Call.window``);
- remote (the halo): each chunk's first ``left`` queries (the edge rows, folded into the batch)
  against the ``left`` keys before the chunk (the halo's slots A and C; on rank R-1, whose chunks
  R-1 and R touch, the second entry's keys are its own first chunk's tail, whose gradients go to
  its own dK/dV: ``own_key_grads``). Query i of an edge sees key j of its halo when j >= i: causal
  once both the rows and the keys are reversed (``edges_fold`` rows, ``halo_fold`` keys). Rank
  0's first chunk has no halo (a key count of 0).

Of left >= c (the keys in natural order: on the peer transport the gather of the ranks within
the window's reach, ``window_reach``; on XLA's permutes the chunks the window reaches alone, laid
out in natural order, ``chunk_layout``; the others' rows zeros that no call reads):

- local: the diagonal blocks, plain causal (the window reaches past each one's start);
- remote: for each chunk j (folded into the batch) the ``left - c`` keys just before it, which
  every query of the chunk sees (a plain call, ``before`` keys), and the ``c`` keys before those
  (a band: query i sees key k of them when k >= i, causal once the rows and the keys are
  reversed). Each span is read in reverse order, so the keys that exist (position >= 0) come
  first and ``kv_len`` cuts off the rest; their gradients go back to the gathered rows' places,
  the two chunks' spans added in float32 where they overlap. For left == c the band alone.

At R = 1 the local part is the whole attention (the local layout is the natural order) and there
is no remote part, unless ``transfer_when_alone`` (plain causal calls only: the tests' and
benchmarks' way to run the transfer's path on one device; then only the far call has keys).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp

from . import halo, per_rank, window_chunks
from .masks import Mask, Visibility, run_ids, visibility, with_ranks
from .rounding import firm

F32 = jnp.float32
I32 = jnp.int32

# How a call's query rows are taken from the rank's 2c rows (and its results put back):
# all of them; the two chunks folded into the batch ([2B, c]); the far chunk 2R-1-r alone; the
# segments ``Call.edges`` joined (a window's edge rows: the results stay compact, and the schedule
# merges them into the local part's rows in place, so the call costs what its rows do, not 2c);
# the two edges folded into the batch and reversed ([2B, left], a plain window's halo call).
# Or the two chunks folded into the batch ([2B, c]) of which the call takes each entry's first
# rows (its mask has fewer rows than the entries: the kernel reads them in place, no copy; the
# results are compact, as ``edges``'s, for a causal window's halo call on masked kernels).
Rows = Literal["all", "fold", "far", "edges", "edges_fold", "chunk_heads"]
# Which keys: the rank's own (as they are, or its two chunks folded); the gathered ones as they
# are (causal documents or windows) or folded into two halves; the gathered first half; the other ranks'
# chunks in order (a copy).
# The rows a window's own transfer brought, as they arrived: the halo of a window within a chunk
# (``halo.py``) or the chunks a wider window reaches (``window_chunks.py``); or the halo's two
# slots before the chunks, folded and reversed (a plain window's halo call, ``_halo_keys``).
# Or, for each of the rank's chunks (folded into the batch), a span of the gathered keys just
# before it, reversed (``Call.key_span``: a plain window of a chunk or more).
# Or the halo's rows folded ([2B, left]: slots A and C, one per chunk; a causal window's halo
# call on masked kernels, with ``chunk_heads`` rows).
Keys = Literal[
    "own",
    "own_fold",
    "gathered",
    "gathered_fold",
    "first_half",
    "others",
    "moved",
    "moved_fold",
    "halo_fold",
    "before",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Call:
    """One kernel call: its rows, its keys and its mask (plain: ``causal``, ``kv_len``, int32
    [entries] or None, and ``window``; masked: ``vis``)."""

    rows: Rows = dataclasses.field(metadata=dict(static=True))
    keys: Keys = dataclasses.field(metadata=dict(static=True))
    causal: bool = dataclasses.field(default=False, metadata=dict(static=True))
    kv_len: Any = None
    vis: Visibility | None = None
    edges: tuple[tuple[int, int], ...] = dataclasses.field(default=(), metadata=dict(static=True))
    window: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    # ``before`` keys: (a, n, c), the n keys at global positions jc - a .. jc - a + n - 1 of
    # each query chunk j (of c tokens), in reverse order (those before position 0 last, cut
    # off by ``kv_len``).
    key_span: tuple[int, ...] = dataclasses.field(default=(), metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Calls:
    local: tuple[Call, ...]
    remote: tuple[Call, ...]


def plain_window(window, causal: bool, documents: bool) -> bool:
    """Whether the mask is a window that a kernel's plain calls with a left window can run
    (``contract.PLAIN_WINDOWS``): a causal window, any left side, no documents."""
    return window is not None and causal and not documents


@dataclasses.dataclass(frozen=True)
class RankPlan:
    num_ranks: int
    causal: bool
    window: tuple[int, int] | None = None  # (left, right), masks.normalize_window's
    documents: bool = False  # segment ids given
    transfer_when_alone: bool = False
    # Plain causal/full attention as masked calls too: for kernels that take only a Visibility
    # (the Pallas kernels), which express any causal offset in one call.
    plain_as_masked: bool = False
    # The transfer can move a wide window's chunks alone (``window_chunks.py``; XLA's permutes):
    # else such a window gathers all K/V.
    moves_window_chunks: bool = False
    # The kernel's plain calls take a causal left window (cuDNN): a causal window without
    # documents runs as plain calls (``plain_window``).
    plain_windows: bool = False

    @property
    def window_as_plain(self) -> bool:
        return self.plain_windows and plain_window(self.window, self.causal, self.documents)

    @property
    def masked(self) -> bool:
        windowed = self.window is not None and not self.window_as_plain
        return windowed or self.documents or self.plain_as_masked

    @property
    def mask(self) -> Mask:
        return Mask(causal=self.causal, window=self.window)

    @property
    def has_remote(self) -> bool:
        if self.masked or self.window is not None:
            mask = self.mask
            return self.num_ranks > 1 and not (mask.left == 0 and mask.right == 0)
        return self.num_ranks > 1 or (self.transfer_when_alone and self.causal)

    def halo_window(self, chunk_len: int) -> tuple[int, int] | None:
        """The window's sides in effect ``(left, right)`` (right 0 when causal) where the remote
        part needs only the halo, both smaller than the chunk length; None otherwise (no window,
        no remote part, or a side of a chunk or more)."""
        sides = self._window_sides()
        if sides is None:
            return None
        left, right = sides
        return sides if left < chunk_len and right < chunk_len else None

    def chunk_layout(self, chunk_len: int) -> window_chunks.Layout | None:
        """The slots of a window with a side of a chunk or more whose chunks travel alone (a
        transfer that moves them, and fewer than all other chunks needed); None otherwise. Masked
        calls read the chunks as they arrived; plain calls (``window_as_plain``) laid out in
        natural order (``window_chunks.gather_natural``)."""
        sides = self._window_sides()
        if sides is None or not self.moves_window_chunks:
            return None
        return window_chunks.layout(self.num_ranks, chunk_len, *sides)

    def window_reach(self, chunk_len: int) -> int:
        """For a window that gathers K/V (a side of a chunk or more, no chunk layout): the ranks
        whose K/V its queries can see are those within ``D = ceil(largest side / c)`` of the rank
        (chunk j sees chunks j - D .. j + D, and the load-balanced layout puts their owners within
        D ranks of j's), so the gather needs no other's rows. 0 (every rank) where D reaches them
        all, or there is no window."""
        sides = self._window_sides()
        if sides is None:
            return 0
        reach = max(window_chunks.chunks_reached(side, chunk_len, self.num_ranks) for side in sides)
        return reach if reach < self.num_ranks - 1 else 0

    def _window_sides(self) -> tuple[int, int] | None:
        """The window's sides in effect where it has a remote part, else None."""
        if self.window is None or not self.has_remote:
            return None
        left, right = self.mask.left, self.mask.right
        assert left is not None and right is not None
        return left, right

    @property
    def gathers_ids(self) -> bool:
        """The other ranks' segment ids are needed: a document may span several ranks."""
        return self.documents and self.num_ranks > 1

    # -- the calls -----------------------------------------------------------------------------

    def calls(self, q, rank, words=None) -> Calls:
        """The rank's calls for its queries ``q [B, 2c, N, H]``; ``words``: the segment ids of the
        whole sequence in natural order, as int32 words ``[B, S, W]`` (``id_words``), or None.
        Without documents they depend on the rank's index alone: computed for every rank at
        trace time and looked up (``per_rank.py``), their masks carrying every rank's for the
        kernels' plans (``Visibility.derive``)."""
        if words is not None:
            return self._calls(q, rank, words)
        key = ("calls", self, q.shape)
        calls, table = per_rank.tabulate(lambda r: self._calls(q, r), rank, self.num_ranks, key)
        return calls if table is None else with_ranks(calls, table, rank)

    def _calls(self, q, rank, words=None) -> Calls:
        if self.masked:
            return self._masked_calls(q.shape[1] // 2, rank, words, q.shape[0])
        if self.window_as_plain:
            return self._plain_window_calls(q, rank)
        if self.causal and self.has_remote:
            local: tuple[Call, ...] = (Call("fold", "own_fold", causal=True),)
        else:
            local = (Call("all", "own", causal=self.causal),)
        if not self.has_remote:
            return Calls(local, ())
        if not self.causal:
            return Calls(local, (Call("all", "others"),))
        far = Call("far", "first_half")
        if self.num_ranks == 1:
            return Calls(local, (far,))
        return Calls(local, (Call("fold", "gathered_fold", kv_len=self._paired_lengths(q, rank)), far))

    def _plain_window_calls(self, q, rank) -> Calls:
        """A causal window of left < c as plain calls (the module's third list)."""
        left = self.mask.left
        assert left is not None
        if not self.has_remote:  # R = 1 (the natural order), or a window of 0 (each query itself)
            return Calls((Call("all", "own", causal=True, window=left),), ())
        c = q.shape[1] // 2
        if left >= c:
            return self._band_window_calls(q, rank)
        local = Call("fold", "own_fold", causal=True, window=left)
        has_halo = jnp.stack([jnp.where(jnp.asarray(rank) > 0, left, 0), jnp.asarray(left)]).astype(I32)
        halo_call = Call(
            "edges_fold", "halo_fold", causal=True, kv_len=jnp.tile(has_halo, q.shape[0]),
            edges=edge_rows(c, left, 0),
        )  # fmt: skip
        return Calls((local,), (halo_call,))

    def _band_window_calls(self, q, rank) -> Calls:
        """A causal window of left >= c as plain calls (the module's third list, wide windows)."""
        left, c, b = self.mask.left, q.shape[1] // 2, q.shape[0]
        assert left is not None and left >= c
        starts = self._span_starts(c, rank)

        def before(a: int, n: int, **kw) -> Call:
            """The call of each chunk's n keys from jc - a on; those that exist (position >= 0)
            come first in the reversed span, so ``kv_len`` keeps them alone."""
            kv_len = jnp.tile(n - jnp.clip(a - starts, 0, n), b)
            return Call(keys="before", kv_len=kv_len, key_span=(a, n, c), **kw)

        local = (Call("fold", "own_fold", causal=True),)  # the whole diagonal block: left >= c
        band = before(left, c, rows="edges_fold", causal=True)
        if left == c:
            return Calls(local, (band,))
        return Calls(local, (before(left - c, left - c, rows="fold"), band))

    def _masked_calls(self, c: int, rank, words, batch: int) -> Calls:
        mask, q_pos = self.mask, self._own_positions(c, rank)
        runs = None if words is None else runs_of(words)
        own_runs = None if runs is None else self._own(runs, rank)
        local = (Call("all", "own", vis=visibility(mask, q_pos, q_pos, own_runs, own_runs)),)
        if not self.has_remote:
            return Calls(local, ())
        moved = self._moved_positions(c, rank)
        if moved is not None:
            k_pos, valid = moved
            call = self._moved_call(runs, q_pos, own_runs, k_pos, valid, self._edges(c))
            return Calls(local, (self._in_place(call, c, batch),))
        if self.split_at_chunks:
            return self._split_at_chunks(c, rank, q_pos, runs, own_runs)
        k_pos = (self._other_chunks(rank)[:, None] * c + jnp.arange(c, dtype=I32)).reshape(-1)
        k_runs = None if runs is None else self._others(runs, rank)
        return Calls(local, (Call("all", "others", vis=visibility(mask, q_pos, k_pos, own_runs, k_runs)),))

    @property
    def split_at_chunks(self) -> bool:
        """Causal documents or windows whose rank gathers K/V read them in place: the local part
        each chunk's own keys, the remote part the keys before each query's chunk (the module's
        masked calls)."""
        return self.causal and (self.documents or self.window is not None)

    def _split_at_chunks(self, c: int, rank, q_pos, runs, own_runs) -> Calls:
        """Causal calls split at the chunks: the rank's queries against their own chunk's keys
        (local: runs made distinct per chunk, so the far chunk's queries do not see the first
        chunk's keys), and against the gathered keys before their chunk's start (remote: the
        mask's intervals over the whole sequence, cut there)."""
        mask, s = self.mask, 2 * self.num_ranks * c
        chunk = jnp.arange(2 * c, dtype=I32) // c  # 0: the first chunk's rows, 1: the far one's
        base = jnp.zeros((1, 2 * c), I32) if own_runs is None else own_runs
        local_runs = base + chunk * (s + 1)  # runs are < s: non-decreasing, never equal across chunks
        local = Call("all", "own", vis=visibility(mask, q_pos, q_pos, local_runs, local_runs))
        k_pos = jnp.arange(s, dtype=I32)
        vis = visibility(mask, q_pos, k_pos, own_runs, runs)
        starts = self._span_starts(c, rank)
        # a row sees the keys before its chunk; the first chunk's keys only the far chunk's rows
        # see, and the far chunk's keys no row (causal: none of those after it either)
        row_hi = jnp.maximum(jnp.minimum(vis.row_hi, starts[chunk]), vis.row_lo)
        col_lo = jnp.where(k_pos >= starts[0], jnp.maximum(vis.col_lo, c), vis.col_lo)
        col_hi = jnp.where(k_pos >= starts[1], col_lo, jnp.maximum(vis.col_hi, col_lo))
        vis = dataclasses.replace(vis, row_hi=row_hi, col_lo=col_lo, col_hi=col_hi)
        return Calls((local,), (Call("all", "gathered", vis=vis),))

    def _moved_positions(self, c: int, rank):
        """(positions, valid) of the rows a window's own transfer brings (the halo's or the
        chunks'), or None where the rank gathers all K/V."""
        window = self.halo_window(c)
        if window is not None:
            return halo.rank_positions(rank, self.num_ranks, c, *window)
        lay = self.chunk_layout(c)
        return None if lay is None else window_chunks.rank_positions(lay, rank)

    def _edges(self, c: int) -> tuple[tuple[int, int], ...]:
        """The query rows a halo call takes (``edge_rows``); () for all of them (no halo, or a
        chunk's two edges meet)."""
        window = self.halo_window(c)
        edges = () if window is None else edge_rows(c, *window)
        return () if edges == ((0, 2 * c),) else edges

    def _moved_call(self, runs, q_pos, own_runs, k_pos, valid, edges=()) -> Call:
        """The remote call of the query rows ``edges`` (() for all) against the rows a window's
        transfer brought (the halo's, or the chunks'), at positions ``k_pos`` (increasing): runs
        those of the sequence at them (clipped: the padding rows take the first or the last run,
        which keeps the runs non-decreasing), padding (not ``valid``) columns emptied."""
        if edges:
            q_pos = take_segments(q_pos, edges, axis=-1)
            own_runs = None if own_runs is None else take_segments(own_runs, edges, axis=-1)
        if runs is None:
            k_runs = None
        else:
            k_runs = jnp.take(runs, jnp.clip(k_pos, 0, runs.shape[1] - 1), axis=1)
        vis = visibility(self.mask, q_pos, k_pos, own_runs, k_runs)
        unseen = jnp.where(valid, vis.col_hi, vis.col_lo)
        vis = dataclasses.replace(vis, col_hi=unseen)
        return Call("edges" if edges else "all", "moved", vis=vis, edges=edges)

    def _in_place(self, call: Call, c: int, batch: int) -> Call:
        """A causal window's halo call with its rows read in place where it can be: each chunk's
        first ``left`` rows (the edges) against the ``left`` halo keys before the chunk (slots A
        and C), both folded into the batch (``chunk_heads`` rows, ``moved_fold`` keys): the
        kernel reads the edge rows where they lie instead of a copy of them. The call itself
        otherwise (two-sided windows, whose edges include each chunk's tail)."""
        window = self.halo_window(c)
        if call.rows != "edges" or window is None or window[1] != 0:
            return call
        left = window[0]
        assert call.edges == ((0, left), (c, c + left)) and call.vis is not None
        vis = fold_visibility(call.vis, left, left, batch)
        return dataclasses.replace(call, rows="chunk_heads", keys="moved_fold", vis=vis)

    def _own_positions(self, c: int, rank):
        """Global positions of the rank's 2c rows: chunk r, then chunk 2R-1-r (increasing)."""
        return (self._span_starts(c, rank)[:, None] + jnp.arange(c, dtype=I32)).reshape(-1)

    def _paired_lengths(self, q, rank):
        """The paired call's key counts, int32 [2B] (b-major, as ``fold``): chunk r sees rc keys
        of the first half, chunk 2R-1-r sees (R-1-r)c of the second."""
        c = q.shape[1] // 2
        pair = jnp.stack([rank * c, (self.num_ranks - 1 - rank) * c]).astype(I32)
        return jnp.tile(pair, q.shape[0])

    # -- rows ----------------------------------------------------------------------------------

    @staticmethod
    def take_rows(call: Call, x):
        """The call's query rows of ``x [B, 2c, ...]`` (queries, outputs, their cotangents)."""
        if call.rows in ("fold", "chunk_heads"):  # chunk_heads: the call reads the first rows
            return fold(x)
        if call.rows == "edges_fold":
            return _flip(fold(RankPlan.at_edges(call, x)))
        return _far(x) if call.rows == "far" else RankPlan.at_edges(call, x)

    @staticmethod
    def take_lse(call: Call, lse):
        """The call's rows of a log-sum-exp ``[B, N, 2c]``."""
        if call.rows == "fold":
            return fold_lse(lse)
        if call.rows == "chunk_heads":
            return fold_lse(RankPlan.at_edges(call, lse, axis=-1))
        if call.rows == "edges_fold":
            return _flip(fold_lse(RankPlan.at_edges(call, lse, axis=-1)), -1)
        return _far(lse, -1) if call.rows == "far" else RankPlan.at_edges(call, lse, axis=-1)

    @staticmethod
    def put_rows(call: Call, x, fill):
        """A result of the call's rows as ``[B, 2c, ...]``, ``fill`` in the rows it does not have
        (``edges``, ``edges_fold``: left compact, for ``update_rows``)."""
        if call.rows in ("fold", "chunk_heads"):
            return unfold(x)
        if call.rows == "edges_fold":
            return unfold(_flip(x))
        return _on_far_rows(x, fill) if call.rows == "far" else x

    @staticmethod
    def put_lse(call: Call, lse):
        """The call's log-sum-exp as ``[B, N, 2c]`` (-inf in the rows it does not have; ``edges``:
        left compact)."""
        if call.rows in ("fold", "chunk_heads"):
            return unfold_lse(lse)
        if call.rows == "edges_fold":
            return unfold_lse(_flip(lse, -1))
        return _on_far_rows(lse, -jnp.inf, -1) if call.rows == "far" else lse

    @staticmethod
    def at_edges(call: Call, x, axis: int = 1):
        """An edge rows call's (``edges``, ``edges_fold``) rows of ``x [.., 2c, ..]``, joined;
        ``x`` itself for any other call (whose results ``put_rows`` brings back over all 2c rows)."""
        return take_segments(x, call.edges, axis) if call.edges else x

    @staticmethod
    def update_rows(call: Call, fulls, fn, axes, others=()):
        """``fulls`` with an edge rows call's rows replaced by ``fn`` of them and of ``others``
        (``update_segments``: in place), or for any other call with ``fn`` of the arrays
        themselves and ``others`` (arrays, axis pairs of all rows); firm either way, as
        ``update_segments`` returns them (``fn`` may round with ``rounding.rounded_into``)."""
        if not call.edges:
            return firm(tuple(fn(*fulls, *(x for x, _ in others))))
        return update_segments(fulls, fn, call.edges, axes, others)

    # -- keys ----------------------------------------------------------------------------------

    def take_keys(self, call: Call, own, gathered, rank):
        """The call's keys (or values) from the rank's own ``[B, 2c, ...]`` or the gathered
        ``[B, S, ...]`` ones (for ``moved``: the rows the window's transfer brought)."""
        if call.keys in ("own", "moved", "gathered"):
            return own if call.keys == "own" else gathered
        if call.keys == "moved_fold":
            return fold(gathered)
        if call.keys == "halo_fold":
            return _flip(self._halo_keys(own, gathered, rank))
        if call.keys == "before":
            return fold(jnp.take(gathered, self._span_positions(call, rank), axis=1))
        if call.keys == "own_fold":
            return fold(own)
        if call.keys == "gathered_fold":
            return fold(gathered)
        return _first_half(gathered) if call.keys == "first_half" else self._others(gathered, rank)

    def put_key_grads(self, call: Call, g, rank):
        """The call's key (or value) gradients as the rank's own ``[B, 2c, ...]`` (local calls) or
        over the gathered ``[B, S, ...]`` (remote calls, zero where the call read no key), or over
        the moved rows ``[B, L, ...]``."""
        if call.keys in ("own_fold", "gathered_fold", "moved_fold"):
            return unfold(g)
        if call.keys == "halo_fold":  # over the moved rows; rank R-1's own tail goes to own_key_grads
            g = _entries(_flip(g))
            second = jnp.where(self._touching(rank), jnp.zeros_like(g[:, 1]), g[:, 1])
            return unfold(_pair_up(g[:, 0], second))
        if call.keys == "before":
            return self._spread_spans(call, g, rank)
        if call.keys == "first_half":
            return _on_first_half(g)
        return self._spread(g, rank) if call.keys == "others" else g

    def own_key_grads(self, call: Call, g, rank, own_len: int):
        """The gradients of the rank's own keys ``[B, own_len, ...]`` that a remote call read (a
        plain window's halo call on rank R-1: its first chunk's tail), or None (none read)."""
        if call.keys != "halo_fold":
            return None
        tail = _entries(_flip(g))[:, 1]  # [B, left, ...]
        tail = jnp.where(self._touching(rank), tail, jnp.zeros_like(tail))
        c, left = own_len // 2, tail.shape[1]
        pad = [(0, 0), (c - left, own_len - c)] + [(0, 0)] * (tail.ndim - 2)
        return jnp.pad(tail, pad)

    def _halo_keys(self, own, moved, rank):
        """[2B, left, ...]: the ``left`` keys before each of the rank's chunks (slots A and C of the
        moved rows ``[B, 2 left, ...]``), b-major; on rank R-1 the second entry's are its own first
        chunk's tail (slot C is padding there: chunk R's halo is its own)."""
        halo = _entries(fold(moved))
        c, left = own.shape[1] // 2, halo.shape[2]
        second = jnp.where(self._touching(rank), own[:, c - left : c], halo[:, 1])
        return _pair_up(halo[:, 0], second)

    def _own_chunks(self, rank):
        """int32 [2]: the rank's two global chunks, r and 2R-1-r."""
        rank = jnp.asarray(rank, I32)
        return jnp.stack([rank, 2 * self.num_ranks - 1 - rank])

    def _span_starts(self, c: int, rank):
        """int32 [2]: the first positions jc of the rank's two chunks."""
        return self._own_chunks(rank) * c

    def _span_positions(self, call: Call, rank):
        """int32 [2n]: the ``before`` keys' gathered rows for the rank's two chunks, each span in
        reverse order (positions before 0 clipped to 0: rows past ``kv_len``, never seen)."""
        a, n, c = call.key_span
        positions = self._span_starts(c, rank)[:, None] - a + jnp.arange(n - 1, -1, -1, dtype=I32)
        return jnp.maximum(positions, 0).reshape(-1)

    def _spread_spans(self, call: Call, g, rank):
        """A ``before`` call's key gradients ``[2B, n, ...]`` as float32 over the gathered
        ``[B, S, ...]``: each span's rows placed at its positions (those before 0 dropped), the
        two chunks' spans added where they overlap (a window longer than the gap between the
        rank's chunks), zero elsewhere. Placed with slices, not a scatter: deterministic."""
        a, n, c = call.key_span
        entries = _entries(_flip(g)).astype(F32)  # [B, 2, n, ...], positions increasing
        b, s = entries.shape[0], 2 * self.num_ranks * c
        zeros = jnp.zeros((b, a + s, *entries.shape[3:]), F32)  # a rows before position 0
        starts = self._span_starts(c, rank)  # span i starts at jc - a: row jc of the padded rows
        first, second = (
            jax.lax.dynamic_update_slice_in_dim(zeros, entries[:, i], starts[i], 1) for i in (0, 1)
        )
        return (first + second)[:, a:]

    def _touching(self, rank):
        """Whether the rank's two chunks touch (rank R-1: chunks R-1 and R)."""
        return jnp.asarray(rank) == self.num_ranks - 1

    def _own(self, x, rank):
        """The rank's two chunks of ``x [B, S, ...]`` (natural order): [B, 2c, ...]."""
        return self._take_chunks(x, self._own_chunks(rank))

    def _others(self, x, rank):
        """The 2R-2 chunks of the other ranks, in order: [B, (2R-2)c, ...]."""
        return self._take_chunks(x, self._other_chunks(rank))

    def _take_chunks(self, x, chunks):
        b = x.shape[0]
        return jnp.take(_chunked(x, 2 * self.num_ranks), chunks, axis=1).reshape(b, -1, *x.shape[2:])

    def _spread(self, g, rank):
        """[B, (2R-2)c, ...] of the other chunks -> [B, S, ...] natural order, zero in the rank's
        own chunks: a gather from the chunks and one zero chunk (a scatter would be a sort under
        --xla_gpu_deterministic_ops)."""
        b, r2 = g.shape[0], 2 * self.num_ranks
        chunks = g.reshape(b, r2 - 2, -1, *g.shape[2:])
        chunks = jnp.concatenate([chunks, jnp.zeros_like(chunks[:, :1])], axis=1)
        j = jnp.arange(r2)
        own = (j == rank) | (j == r2 - 1 - rank)
        where = jnp.where(own, r2 - 2, j - (j > rank) - (j > r2 - 1 - rank))
        return jnp.take(chunks, where, axis=1).reshape(b, -1, *g.shape[2:])

    def _other_chunks(self, rank):
        """The 2R-2 global chunks other than r and 2R-1-r, in order (r < 2R-1-r always)."""
        t = jnp.arange(2 * self.num_ranks - 2, dtype=I32)
        return t + (t >= rank) + (t >= 2 * self.num_ranks - 2 - rank)


# -- segment ids -------------------------------------------------------------------------------


def id_words(segment_ids):
    """Integer segment ids ``[B, T]`` as int32 words ``[B, T, W]``, W = 1 (ids of up to 32 bits,
    cast: an injective map) or 2 (64-bit ids, split): what the transfer moves, bit for bit."""
    ids = jnp.asarray(segment_ids)
    if ids.dtype.itemsize > 4:
        return jax.lax.bitcast_convert_type(ids, I32)
    return ids.astype(I32)[..., None]


def runs_of(words):
    """int32 ``[B, S]`` run ids (``masks.run_ids``: each contiguous run its own id, never
    decreasing) of ids given as words ``[B, S, W]``: a run ends where any word changes."""
    return sum(run_ids(words[..., w]) for w in range(words.shape[-1]))


# -- layout helpers ----------------------------------------------------------------------------


def edge_rows(c: int, left: int, right: int) -> tuple[tuple[int, int], ...]:
    """Segments ``[start, stop)`` of a rank's 2c rows whose queries a window of sides (left,
    right), both below c, can let see keys outside their own chunk: each chunk's first ``left``
    and last ``right`` rows (a row further in reaches only its own chunk), the whole chunk where
    the two meet; touching segments joined."""
    segments: list[tuple[int, int]] = []
    for base in (0, c):
        if left + right >= c:
            pieces = [(base, base + c)]
        else:
            pieces = [(base, base + left), (base + c - right, base + c)]
        for start, stop in pieces:
            if start == stop:
                continue
            if segments and segments[-1][1] == start:
                start = segments.pop()[0]
            segments.append((start, stop))
    return tuple(segments)


def _flip(x, axis: int = 1):
    """``x`` reversed along ``axis`` (its own inverse)."""
    return jnp.flip(x, axis=axis)


def _entries(x):
    """[2B, ...] (b-major pairs, as ``fold``) -> [B, 2, ...]."""
    return x.reshape(x.shape[0] // 2, 2, *x.shape[1:])


def _pair_up(first, second):
    """The inverse of ``_entries``: entries [B, ...] and [B, ...] -> [2B, ...], b-major."""
    return jnp.stack([first, second], axis=1).reshape(-1, *first.shape[1:])


def _same_in_each_chunk(segments, length: int) -> tuple[int, int] | None:
    """``(start, stop)`` where ``segments`` are one span at the same offset in each of the two
    chunks of ``length`` rows (a causal window's edge rows, and the rows its neighbours see),
    else None."""
    c = length // 2
    if len(segments) == 2 and length % 2 == 0:
        (a, b), (a2, b2) = segments
        if (a2, b2) == (a + c, b + c) and b <= c:
            return a, b
    return None


def _by_chunk(x, axis: int):
    """``x [.., 2c, ..]`` viewed as ``[.., 2, c, ..]`` (a bitcast)."""
    return x.reshape(*x.shape[:axis], 2, x.shape[axis] // 2, *x.shape[axis + 1 :])


def take_segments(x, segments, axis: int = 1):
    """The ``segments`` ``[start, stop)`` of ``x`` along ``axis``, joined. A span at the same
    offset in each chunk is one slice of the chunks' view, which XLA fuses into its reader."""
    axis %= x.ndim
    span = _same_in_each_chunk(segments, x.shape[axis])
    if span is not None:
        rows = jax.lax.slice_in_dim(_by_chunk(x, axis), *span, axis=axis + 1)
        return rows.reshape(*x.shape[:axis], 2 * (span[1] - span[0]), *x.shape[axis + 1 :])
    pieces = [jax.lax.slice_in_dim(x, a, b, axis=axis) for a, b in segments]
    return jnp.concatenate(pieces, axis=axis)


def put_segments(full, rows, segments, axis: int = 1):
    """``full`` with the joined ``rows`` (``take_segments``' form) written back at ``segments``,
    in place (static slices)."""
    at = 0
    for start, stop in segments:
        piece = jax.lax.slice_in_dim(rows, at, at + stop - start, axis=axis % rows.ndim)
        full = jax.lax.dynamic_update_slice_in_dim(full, piece, start, axis=axis % full.ndim)
        at += stop - start
    return full


def update_segments(fulls, fn, segments, axes, others=()):
    """``fulls`` (arrays ``[.., 2c, ..]``, the rows along ``axes``) with their ``segments``
    replaced by ``fn(*rows, *others)``, ``rows`` each array's segments, ``others`` arrays of the
    same rows already taken (``(array, axis)`` pairs, ``take_segments``' form). ``fn`` gets all of
    them in one form and returns each array's new rows in it: joined (``take_segments``' form),
    or, where the segments are a span at the same offset in each chunk, the chunks' view
    ``[.., 2, span, ..]``, so that ``fn`` works elementwise in the shape the rows have in place.

    Such a span is read with a dynamic slice and written back with a dynamic update at one start
    that XLA cannot fold into a constant (behind an optimization barrier): XLA then makes the
    read, ``fn`` and the write one kernel per array, in place (with a static start it makes a
    kernel of ``fn`` and a copy per segment, or copies the whole array first; with a reshape
    between the read and the write, a copy of the rows first). The arrays come back firm
    (``rounding.firm``), so ``fn`` may round its rows with ``rounding.rounded_into``: a barrier
    between its rounding and the write would keep them apart."""
    axes = [a % x.ndim for x, a in zip(fulls, axes, strict=True)]
    span = _same_in_each_chunk(segments, fulls[0].shape[axes[0]])
    if span is None:
        rows = [take_segments(x, segments, a) for x, a in zip(fulls, axes, strict=True)]
        new = fn(*rows, *(x for x, _ in others))
        return firm(tuple(put_segments(x, r, segments, a) for x, r, a in zip(fulls, new, axes, strict=True)))
    start = jax.lax.optimization_barrier(jnp.int32(span[0]))
    views = [_by_chunk(x, a) for x, a in zip(fulls, axes, strict=True)]
    starts = [[start if d == a + 1 else 0 for d in range(v.ndim)] for v, a in zip(views, axes, strict=True)]
    rows = [
        jax.lax.dynamic_slice(v, at, v.shape[: a + 1] + (span[1] - span[0],) + v.shape[a + 2 :])
        for v, at, a in zip(views, starts, axes, strict=True)
    ]
    new = fn(*rows, *(_by_chunk(x, a % x.ndim) for x, a in others))
    return firm(
        tuple(
            jax.lax.dynamic_update_slice(v, r, at).reshape(x.shape)
            for x, v, r, at in zip(fulls, views, new, starts, strict=True)
        )
    )


def _far(x, axis: int = 1):
    """The rank's second chunk (2R-1-r) along ``axis`` (the queries' rows)."""
    return jnp.split(x, 2, axis=axis)[1]


def _first_half(x):
    """The first half of the gathered keys, [B, S, ...] -> [B, S/2, ...]: a copy, which costs less
    than the far call would lose with a run-time key count (cuDNN's padding mask, measured 5-20%
    slower on an H200 for the same keys)."""
    return x[:, : x.shape[1] // 2]


def _on_first_half(g):
    """Gradients of the first half's keys, [B, S/2, ...] -> [B, S, ...] with zeros after."""
    return jnp.concatenate([g, jnp.zeros_like(g)], axis=1)


def _on_far_rows(x, fill, axis: int = 1):
    """A result of the far chunk's rows, [.., c, ..] -> [.., 2c, ..] with ``fill`` in chunk r's."""
    return jnp.concatenate([jnp.full_like(x, fill), x], axis=axis)


def _chunked(x, parts: int):
    """[B, parts*c, ...] -> [B, parts, c, ...]."""
    return x.reshape(x.shape[0], parts, x.shape[1] // parts, *x.shape[2:])


def fold(x):
    """[B, 2c, ...] -> [2B, c, ...] (entries b-major: chunk r then chunk 2R-1-r of each row)."""
    return _chunked(x, 2).reshape(-1, x.shape[1] // 2, *x.shape[2:])


def fold_visibility(vis: Visibility, rows: int, keys: int, batch: int) -> Visibility:
    """A Visibility of two blocks that do not see each other (rows ``[Bp, 2 rows]``, keys
    ``[2 keys]``: the first rows see only the first keys, the others only the others) as one of
    the blocks folded into the batch, ``[2Bp, rows]`` x ``[keys]``, b-major as ``fold``; tiled
    to ``2 * batch`` entries where one is shared by the batch (a kernel takes 1 or B)."""

    def side(lo, hi, n: int):
        bp = lo.shape[0]
        offset = jnp.asarray([0, n], I32)[None, :, None]
        lo, hi = (jnp.clip(x.reshape(bp, 2, -1) - offset, 0, n).reshape(2 * bp, -1) for x in (lo, hi))
        return (jnp.tile(lo, (batch, 1)), jnp.tile(hi, (batch, 1))) if bp == 1 < batch else (lo, hi)

    return Visibility(*side(vis.row_lo, vis.row_hi, keys), *side(vis.col_lo, vis.col_hi, rows))


def unfold(x):
    """[2B, c, ...] -> [B, 2c, ...]."""
    return x.reshape(x.shape[0] // 2, 2 * x.shape[1], *x.shape[2:])


def fold_lse(lse):
    """[B, N, 2c] -> [2B, N, c]."""
    b, n, t = lse.shape
    return lse.reshape(b, n, 2, t // 2).transpose(0, 2, 1, 3).reshape(2 * b, n, t // 2)


def unfold_lse(lse):
    """[2B, N, c] -> [B, N, 2c]."""
    b2, n, c = lse.shape
    return lse.reshape(b2 // 2, 2, n, c).transpose(0, 2, 1, 3).reshape(b2 // 2, n, 2 * c)
