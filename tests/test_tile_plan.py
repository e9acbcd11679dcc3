"""The tile plan against brute force: every tile's visibility from ``masks.visible``, tile by tile.

The checker (:func:`plan_errors`) is one function, so that the negative controls below show that
the same code that passes the plans catches a planted off-by-one.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

from jax_cpgrad.attention import masks, tile_plan

BLOCKS = (8, 16, 24, 32, 40, 64, 128)
WINDOWS = (None, "sym", "asym", (0, 0), "small", "large")


def cdiv(a, b):
    return -(-a // b)


def tile_truth(seen, outer_block: int, inner_block: int):
    """(visited, full), bool ``[Bp, n_outer, n_inner]``, from the dense ``seen [Bp, rows, cols]``:
    a tile is visited iff any element is seen, full iff all are (missing elements are not)."""
    seen = np.asarray(seen, bool)
    bp, rows, cols = seen.shape
    n_o, n_i = cdiv(rows, outer_block), cdiv(cols, inner_block)
    padded = np.zeros((bp, n_o * outer_block, n_i * inner_block), bool)
    padded[:, :rows, :cols] = seen
    tiles = padded.reshape(bp, n_o, outer_block, n_i, inner_block)
    return tiles.any(axis=(2, 4)), tiles.all(axis=(2, 4))


def gaps(visited, ranges) -> int:
    """Tiles in [lo, hi) that nothing sees (allowed, but wasted work)."""
    j = np.arange(visited.shape[-1])
    in_range = (np.asarray(ranges.lo)[..., None] <= j) & (j < np.asarray(ranges.hi)[..., None])
    return int((in_range & ~visited).sum())


def plan_errors(ranges: tile_plan.TileRanges, visited, full) -> list[str]:
    """What is wrong with ``ranges`` given the brute-force tiles (empty list: nothing)."""
    arrays = [np.asarray(x) for x in (ranges.lo, ranges.full_lo, ranges.full_hi, ranges.hi, ranges.order)]
    if any(x.dtype != np.int32 or x.shape != visited.shape[:2] for x in arrays):
        return [f"want int32 {visited.shape[:2]}, got {[(x.dtype, x.shape) for x in arrays]}"]
    lo, f_lo, f_hi, hi, order = arrays
    errors = []
    n_inner = visited.shape[-1]
    if not ((0 <= lo) & (lo <= f_lo) & (f_lo <= f_hi) & (f_hi <= hi) & (hi <= n_inner)).all():
        errors.append("not 0 <= lo <= full_lo <= full_hi <= hi <= n_inner")
    j = np.arange(n_inner)
    in_range = (lo[..., None] <= j) & (j < hi[..., None])
    in_full = (f_lo[..., None] <= j) & (j < f_hi[..., None])
    if (visited & ~in_range).any():
        errors.append(
            f"{int((visited & ~in_range).sum())} visited tiles outside [lo, hi): visible elements lost"
        )
    # The range is the hull of the visited tiles: its first and last tiles are visited.
    nonempty = hi > lo
    take = lambda idx: np.take_along_axis(visited, np.clip(idx, 0, max(n_inner - 1, 0))[..., None], -1)[
        ..., 0
    ]
    if n_inner and (nonempty & ~(take(lo) & take(hi - 1))).any():
        errors.append("a range starts or ends on a tile nothing sees: a fully masked tile not skipped")
    if (~visited.any(-1) & nonempty).any():
        errors.append("an outer tile that sees nothing has a non-empty range")
    if (in_full & ~full).any():
        errors.append(
            f"{int((in_full & ~full).sum())} tiles in [full_lo, full_hi) are not full: elements unmasked"
        )
    if (full & ~in_full).any():
        errors.append(f"{int((full & ~in_full).sum())} full tiles outside [full_lo, full_hi): needless masks")
    work = hi - lo
    want = np.argsort(-work, axis=-1, kind="stable")
    if not (np.sort(order, axis=-1) == np.arange(order.shape[-1])).all():
        errors.append("order is not a permutation of the outer tiles")
    elif not (order == want).all():
        errors.append("order is not heaviest first, ties by index")
    return errors


@dataclasses.dataclass
class Case:
    mask: masks.Mask
    q_pos: np.ndarray
    k_pos: np.ndarray
    seg: np.ndarray | None  # segment ids [B, S] over the whole sequence (positions 0..S-1)


def documents(rng, b: int, s: int):
    """Sorted random segment ids ``[b, s]``: one document, a few, many short ones, or one token each."""
    n_docs = int(rng.choice([1, 3, max(1, s // 5), s]))
    return np.sort(rng.randint(0, n_docs, size=(b, s)), axis=1).astype(np.int32)


def random_mask(rng):
    kind = WINDOWS[rng.randint(len(WINDOWS))]
    if kind == "sym":
        w = int(rng.randint(1, 100))
        window = (w, w)
    elif kind == "asym":
        window = (int(rng.randint(0, 120)), int(rng.randint(0, 40)))
    elif kind == "small":  # smaller than a tile
        window = (int(rng.randint(0, 6)), int(rng.randint(0, 6)))
    elif kind == "large":
        window = (1000, 1000)
    else:
        window = kind
    return masks.Mask(causal=bool(rng.randint(2)), window=window)


def cp_positions(n_ranks: int, rank: int, c: int):
    """A CP rank's queries: chunks r and 2R-1-r of c rows of a sequence of 2Rc."""
    first, second = rank * c, (2 * n_ranks - 1 - rank) * c
    return np.concatenate([np.arange(first, first + c), np.arange(second, second + c)])


def make_case(rng, kind: str, t: int, l_len: int) -> Case:
    """A random case of ``kind`` with t queries and l_len keys (fixed, so that jax compiles once)."""
    if kind == "natural":
        s = t
        q_pos = k_pos = np.arange(t)
    elif kind == "offset":  # queries at positions off.. against keys 0..L (causal with an offset)
        off = int(rng.randint(0, 150))
        q_pos, k_pos = np.arange(t) + off, np.arange(l_len)
        s = max(t + off, l_len)
    elif kind == "random":  # any increasing positions
        s = max(t, l_len) + int(rng.randint(0, 200))
        q_pos, k_pos = (np.sort(rng.choice(s, n, replace=False)) for n in (t, l_len))
    else:  # cp_natural: keys 0..2Rc; cp_own: the rank's own two chunks
        n_ranks = l_len // t if kind == "cp_natural" else int(rng.choice([1, 2, 4]))
        s = n_ranks * t
        q_pos = cp_positions(n_ranks, int(rng.randint(n_ranks)), t // 2)
        k_pos = np.arange(s) if kind == "cp_natural" else q_pos
    seg = documents(rng, 2, s) if rng.randint(2) else None
    return Case(random_mask(rng), q_pos.astype(np.int32), k_pos.astype(np.int32), seg)


def dense_truth(case: Case):
    """bool ``[Bp, T, L]`` from ``masks.visible`` with the raw segment ids."""
    if case.seg is None:
        return np.asarray(masks.visible(case.mask, case.q_pos, case.k_pos))
    q_seg, k_seg = case.seg[:, case.q_pos], case.seg[:, case.k_pos]
    return np.asarray(masks.visible(case.mask, case.q_pos, case.k_pos, q_seg, k_seg))


def intervals_of(seen):
    """(lo, hi) int32 ``[Bp, rows]`` of a dense relation whose rows are intervals (asserted)."""
    any_seen = seen.any(-1)
    lo = np.where(any_seen, seen.argmax(-1), 0).astype(np.int32)
    hi = np.where(any_seen, seen.shape[-1] - seen[..., ::-1].argmax(-1), 0).astype(np.int32)
    assert (np.asarray(masks.interval_mask(lo, hi, seen.shape[-1])) == seen).all(), (
        "a row is not one interval"
    )
    return lo, hi


def visibility(case: Case):
    """masks.visibility of a case: runs renumbered over the whole sequence, then taken at the
    positions (so that a document keeps its id in the queries and the keys)."""
    runs = (None, None)
    if case.seg is not None:
        whole = np.asarray(masks.run_ids(case.seg))
        runs = (whole[:, case.q_pos], whole[:, case.k_pos])
    return masks.visibility(case.mask, case.q_pos, case.k_pos, *runs)


def check_plans(truth, ob: int, ib: int, tight_rows: bool, tight_cols: bool, vis=None):
    """Both passes' plans against brute force. ``truth [Bp, T, L]``: many cases may be stacked on
    Bp (each entry is planned alone). The intervals are ``vis``'s, or read off ``truth``."""
    t, l_len = truth.shape[1:]
    row_lo, row_hi = intervals_of(truth) if vis is None else (vis.row_lo, vis.row_hi)
    col_lo, col_hi = intervals_of(truth.transpose(0, 2, 1)) if vis is None else (vis.col_lo, vis.col_hi)

    rows = tile_plan.tile_ranges(row_lo, row_hi, outer_block=ob, inner_block=ib, inner_len=l_len)
    visited, full = tile_truth(truth, ob, ib)
    assert plan_errors(rows, visited, full) == []
    assert not tight_rows or gaps(visited, rows) == 0

    # The dK/dV pass: key tiles of ob over query tiles of ib.
    cols = tile_plan.tile_ranges(col_lo, col_hi, outer_block=ob, inner_block=ib, inner_len=t)
    visited_t, full_t = tile_truth(truth.transpose(0, 2, 1), ob, ib)
    assert plan_errors(cols, visited_t, full_t) == []
    assert not tight_cols or gaps(visited_t, cols) == 0
    return rows, visited, full


# (kind, T, L, outer block, inner block, contiguous visited rows, contiguous visited columns):
# contiguity is proved (tile_plan's docstring) where consecutive rows hold consecutive positions
# with their own keys; a tile that holds both of a CP rank's chunks may have gaps.
CONFIGS = [
    ("natural", 300, 300, 64, 32, True, True),
    ("natural", 77, 77, 16, 24, True, True),
    ("offset", 100, 250, 32, 16, True, True),
    ("offset", 37, 300, 8, 40, True, True),
    ("random", 150, 200, 24, 32, False, False),
    ("random", 60, 250, 16, 128, False, False),
    ("cp_natural", 64, 128, 32, 16, True, False),  # R = 2, c = 32: tiles do not straddle chunks
    ("cp_natural", 74, 296, 16, 24, False, False),  # R = 4, c = 37
    ("cp_own", 128, 128, 64, 32, True, True),
    ("cp_own", 90, 90, 16, 40, False, False),  # c = 45
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c[:5])))
def test_plan_matches_brute_force(config):
    """Random masks (causal or not, windows, documents) for each shape, stacked on the batch."""
    kind, t, l_len, ob, ib, tight_rows, tight_cols = config
    rng = np.random.RandomState(CONFIGS.index(config))
    truth = np.concatenate([dense_truth(make_case(rng, kind, t, l_len)) for _ in range(10)])
    check_plans(truth, ob, ib, tight_rows, tight_cols)


def test_plan_from_visibility():
    """The same through masks.visibility (runs, row and column intervals) for a few cases."""
    rng = np.random.RandomState(11)
    for kind, t, l_len, ob, ib, tight_rows, tight_cols in (CONFIGS[4], CONFIGS[7]):
        case = make_case(rng, kind, t, l_len)
        case.seg = documents(rng, 2, int(max(case.q_pos.max(), case.k_pos.max())) + 1)
        vis, truth = visibility(case), dense_truth(case)
        assert (np.asarray(vis.dense()) == truth).all()
        check_plans(truth, ob, ib, tight_rows, tight_cols, vis=vis)


def natural_truth(mask: masks.Mask, t: int, l_len: int | None = None):
    k = np.arange(t if l_len is None else l_len, dtype=np.int32)
    return dense_truth(Case(mask, np.arange(t, dtype=np.int32), k, None))


def test_counts_and_jit():
    truth = natural_truth(masks.Mask(causal=True, window=(100, None)), 200)
    plan = functools.partial(tile_plan.tile_ranges, outer_block=16, inner_block=32, inner_len=200)
    lo, hi = intervals_of(truth)
    eager, jitted = plan(lo, hi), jax.jit(plan)(lo, hi)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
        np.testing.assert_array_equal(a, b)
    visited, full = tile_truth(truth, 16, 32)
    assert int(tile_plan.num_visited(eager)) == visited.sum() < visited.size
    assert int(tile_plan.num_full(eager)) == full.sum() > 0
    assert int(tile_plan.num_masked(eager)) == visited.sum() - full.sum()


def test_any_intervals_are_safe():
    """Intervals that no mask makes (random, not monotone, some empty, some reversed): the range is
    still the hull of the visited tiles and the full range still exact."""
    rng = np.random.RandomState(3)
    for t, l_len, ob, ib in ((150, 120, 16, 24), (37, 200, 8, 64)):
        a, b = rng.randint(-5, l_len + 5, size=(2, 40, t))
        ranges = tile_plan.tile_ranges(a, b, outer_block=ob, inner_block=ib, inner_len=l_len)
        seen = masks.interval_mask(np.clip(a, 0, l_len), np.clip(b, 0, l_len), l_len)
        assert plan_errors(ranges, *tile_truth(seen, ob, ib)) == []


def test_edges():
    """One row, tiles larger than both lengths, lengths of exactly one tile, nothing visible."""
    for t, l_len, ob, ib in ((1, 1, 128, 128), (5, 300, 128, 128), (128, 128, 128, 128), (200, 3, 8, 128)):
        for mask in (masks.Mask(), masks.Mask(causal=True), masks.Mask(window=(0, 0))):
            check_plans(natural_truth(mask, t, l_len), ob, ib, True, True)
    # Keys all after the queries, causal: nothing is visible, nothing is visited.
    vis = masks.visibility(masks.Mask(causal=True), np.arange(50), np.arange(60) + 50)
    ranges = tile_plan.tile_ranges(vis.row_lo, vis.row_hi, outer_block=16, inner_block=16, inner_len=60)
    assert int(tile_plan.num_visited(ranges)) == 0


def test_order_heaviest_first():
    # Causal self-attention: query tile i visits i + 1 key tiles, so the order is reversed.
    vis = masks.visibility(masks.Mask(causal=True), np.arange(64), np.arange(64))
    ranges = tile_plan.tile_ranges(vis.row_lo, vis.row_hi, outer_block=16, inner_block=16, inner_len=64)
    np.testing.assert_array_equal(ranges.order, [[3, 2, 1, 0]])
    np.testing.assert_array_equal(ranges.hi - ranges.lo, [[1, 2, 3, 4]])
    np.testing.assert_array_equal(ranges.full_hi - ranges.full_lo, [[0, 1, 2, 3]])  # the diagonal is masked
    # Equal work keeps the index order.
    full = masks.visibility(masks.Mask(), np.arange(64), np.arange(64))
    ranges = tile_plan.tile_ranges(full.row_lo, full.row_hi, outer_block=16, inner_block=16, inner_len=64)
    np.testing.assert_array_equal(ranges.order, [[0, 1, 2, 3]])


def test_checker_catches_planted_errors():
    """Negative controls: the checker that passes the plans above fails each planted mistake."""
    rows, visited, full = check_plans(
        natural_truth(masks.Mask(causal=True, window=(50, None)), 200), 32, 16, True, True
    )
    assert plan_errors(rows, visited, full) == []
    replace = lambda **kw: dataclasses.replace(rows, **kw)
    one = np.zeros(rows.lo.shape, np.int32)
    one[0, 3] = 1  # one outer tile, with masked and full tiles on both sides
    assert rows.lo[0, 3] < rows.full_lo[0, 3] < rows.full_hi[0, 3] < rows.hi[0, 3]

    short = plan_errors(
        replace(hi=rows.hi - one, full_hi=np.minimum(rows.full_hi, rows.hi - one)), visited, full
    )
    assert any("visible elements lost" in e for e in short), short
    late = plan_errors(replace(lo=rows.lo + one), visited, full)
    assert any("visible elements lost" in e for e in late), late
    wide = plan_errors(replace(full_hi=rows.full_hi + one), visited, full)
    assert any("not full" in e for e in wide), wide
    narrow = plan_errors(replace(full_lo=rows.full_lo + one), visited, full)
    assert any("needless masks" in e for e in narrow), narrow
    loose = plan_errors(replace(hi=rows.hi + one), visited, full)
    assert any("not skipped" in e for e in loose), loose
    everything = replace(
        lo=0 * rows.lo, full_lo=0 * rows.lo, full_hi=0 * rows.lo, hi=0 * rows.hi + visited.shape[-1]
    )
    assert any("not skipped" in e for e in plan_errors(everything, visited, full))
    swapped = np.asarray(rows.order).copy()
    swapped[0, :2] = swapped[0, 1::-1]
    assert any("heaviest first" in e for e in plan_errors(replace(order=swapped), visited, full))
