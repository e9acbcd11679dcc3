"""Document-balanced token order for the head-tail CP layout (host-side numpy, input pipeline).

The CP layout (:func:`jax_cpgrad.to_cp_layout`) cuts the global sequence of S tokens into 2R
chunks of c = S / (2R) and gives rank r chunks r and 2R-1-r: exact balance for plain causal
attention. With packed documents (segment ids; a query sees the keys of its own document,
causally) a query row's work is its offset inside its document, not its global position, and the
ranks' work can differ by 1.5-2.6x (``benchmarks/document_balance.py``).

Whole documents can be reordered without changing any token's attention: the document mask, the
causal mask and a window only compare positions inside one document, whose tokens stay contiguous
and in order. :func:`balanced_document_order` picks such an order per batch row so that the
unchanged head-tail layout is balanced; the layer and the transports need no change::

    order = balanced_document_order(segment_ids, R)     # numpy int32 [B, S], host-side
    x_bal = permute_tokens(x, order)                    # tokens, labels, loss weights, ids, positions
    x_cp = to_cp_layout(x_bal, R)                       # ... the CP step ...
    y = unpermute_tokens(from_cp_layout(y_cp, R), order)

A document is a contiguous run of equal ids (as the layer defines it); a padding run is one more
document (the layer computes its attention like any other). The order never puts two runs of equal
id next to each other, so the permuted ids have the same runs. Work model: causal + documents,
a rank's work is its number of visible (query, key) pairs, counted exactly (:func:`rank_work`).
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np

from .layout import normalize_seq_axis

EXHAUSTIVE_DOCUMENTS = 7  # up to this many documents every order is tried (7! = 5040)
_BATCH = 64  # candidate orders scored at once
_PATIENCE = 25  # batches without improvement before the search restarts


def _check_ranks(num_ranks) -> int:
    if not isinstance(num_ranks, (int, np.integer)) or isinstance(num_ranks, bool) or num_ranks < 1:
        raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")
    return int(num_ranks)


def _host_ids(segment_ids, where: str) -> np.ndarray:
    try:
        ids = np.asarray(segment_ids)
    except Exception as e:  # a tracer: the order is computed on the host, from concrete ids
        raise ValueError(
            f"{where}: segment_ids must be concrete host data (numpy, or a JAX array outside jit), "
            f"got {type(segment_ids).__name__}"
        ) from e
    if ids.ndim != 2:
        raise ValueError(f"{where}: segment_ids must be [B, S] (2 dimensions), got shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{where}: segment_ids must have an integer dtype, got {ids.dtype}")
    if ids.shape[1] == 0:
        raise ValueError(f"{where}: the sequence is empty (shape {ids.shape})")
    return ids


def document_runs(segment_ids_row) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths), int64: the contiguous runs of equal ids of one row ``[S]``."""
    ids = np.asarray(segment_ids_row)
    starts = np.flatnonzero(np.concatenate([[True], ids[1:] != ids[:-1]]))
    return starts.astype(np.int64), np.diff(np.append(starts, ids.shape[0])).astype(np.int64)


def _rank_work_batch(lengths: np.ndarray, num_ranks: int) -> np.ndarray:
    """int64 [K, R]: per-rank visible pairs (causal + documents, head-tail layout) of K document
    orders, ``lengths [K, D]`` the document lengths in sequence order (each row summing to S).

    A query at offset t of its document sees t + 1 keys, so the work before position x is
    F(x) = sum of n(n+1)/2 over the documents ending before x, plus t(t+1)/2 for the document
    cut at x (t of its tokens before x); chunk k's work is F((k+1)c) - F(kc)."""
    n = np.asarray(lengths, np.int64)
    s = int(n[0].sum())
    c = s // (2 * num_ranks)
    ends = np.cumsum(n, axis=1)
    tri = n * (n + 1) // 2
    cum = np.cumsum(tri, axis=1)
    x = np.arange(1, 2 * num_ranks, dtype=np.int64) * c  # the inner chunk boundaries
    j = (ends[:, :, None] <= x).sum(axis=1)  # [K, 2R-1]: the document holding position x
    nj = np.take_along_axis(n, j, axis=1)
    t = x - (np.take_along_axis(ends, j, axis=1) - nj)
    inner = np.take_along_axis(cum, j, axis=1) - np.take_along_axis(tri, j, axis=1) + t * (t + 1) // 2
    zero = np.zeros((n.shape[0], 1), np.int64)
    chunk = np.diff(np.concatenate([zero, inner, cum[:, -1:]], axis=1), axis=1)
    return chunk[:, :num_ranks] + chunk[:, ::-1][:, :num_ranks]


def rank_work(lengths, num_ranks: int) -> np.ndarray:
    """int64 ``[R]``: each rank's visible (query, key) pairs under causal + document masks in the
    head-tail layout, for documents of ``lengths`` (in sequence order, summing to S, a multiple
    of 2R). Exact, O(D + R)."""
    num_ranks = _check_ranks(num_ranks)
    n = np.asarray(lengths, np.int64).reshape(-1)
    if n.size == 0 or (n <= 0).any():
        raise ValueError(f"rank_work: lengths must be positive, got {n.tolist()}")
    if int(n.sum()) % (2 * num_ranks):
        raise ValueError(f"rank_work: S = {int(n.sum())} must be a multiple of 2R = {2 * num_ranks}")
    return _rank_work_batch(n[None], num_ranks)[0]


def _score(work: np.ndarray) -> np.ndarray:
    """What the search minimises: max/mean, then (a little) the spread of the other ranks."""
    w = work.astype(np.float64)
    mean = w.mean(axis=-1)
    return w.max(axis=-1) / mean + 1e-2 * ((w / mean[..., None] - 1.0) ** 2).mean(axis=-1)


def _candidates(order: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """[k, D]: ``order`` with two documents swapped, or one moved elsewhere (half each)."""
    d = order.shape[0]
    i = rng.integers(0, d, k)
    j = rng.integers(0, d - 1, k)
    j = j + (j >= i)
    rows = np.arange(k)
    pos = np.broadcast_to(np.arange(d), (k, d))
    swapped = pos.copy()
    swapped[rows, i], swapped[rows, j] = j, i
    key = pos.astype(np.float64)
    key[rows, i] = j + np.where(j > i, 0.5, -0.5)  # document i just after (before) position j
    moved = np.argsort(key, axis=1, kind="stable")
    return order[np.where((rng.random(k) < 0.5)[:, None], swapped, moved)]


def _balanced_run_order(
    lengths: np.ndarray, run_ids: np.ndarray, num_ranks: int, tolerance: float, steps: int, seed
) -> np.ndarray:
    """The order of the runs of one row. Up to EXHAUSTIVE_DOCUMENTS runs: the order of least max/mean
    of them all. More: a local search (batches of random swaps and moves from the given order, the
    best of each batch kept when it improves) that stops at max/mean <= 1 + tolerance. Runs of equal
    id never become neighbours (they would merge into one document)."""
    d = lengths.shape[0]
    identity = np.arange(d)
    if d == 1 or num_ranks == 1:
        return identity

    def scores(orders, exact=False):
        work = _rank_work_batch(lengths[orders], num_ranks)
        s = work.max(axis=1) / work.mean(axis=1) if exact else _score(work)
        ids = run_ids[orders]
        return np.where((ids[:, 1:] == ids[:, :-1]).any(axis=1), np.inf, s)

    if d <= EXHAUSTIVE_DOCUMENTS:
        orders = np.asarray(list(itertools.permutations(range(d))))
        return orders[np.argmin(scores(orders, exact=True))]  # the identity is among them (finite)
    rng = np.random.default_rng(seed)
    order, cur = identity, scores(identity[None])[0]
    best_order, best = order, cur
    stalled = 0
    for _ in range(steps):
        work = _rank_work_batch(lengths[order][None], num_ranks)[0]
        if work.max() <= (1.0 + tolerance) * work.mean():
            break
        cands = _candidates(order, _BATCH, rng)
        s = scores(cands)
        k = int(np.argmin(s))
        if s[k] < cur:
            order, cur, stalled = cands[k], s[k], 0
            if cur < best:
                best_order, best = order, cur
            continue
        stalled += 1
        if stalled >= _PATIENCE:  # a local minimum: start again from a random order (a valid one)
            starts = np.argsort(rng.random((_BATCH, d)), axis=1)
            s = scores(starts)
            k = int(np.argmin(s))
            if np.isfinite(s[k]):
                order, cur, stalled = starts[k], s[k], 0
    return best_order


def balanced_document_order(
    segment_ids, num_ranks: int, *, tolerance: float = 0.01, max_steps: int = 300, seed: int = 0
) -> np.ndarray:
    """int32 ``[B, S]``: per batch row, a permutation of the token indices that keeps every document
    (contiguous run of equal ids) contiguous and in its own order, and orders the documents so that
    the head-tail CP layout over ``num_ranks`` ranks gives the ranks even causal + document work.

    Apply it with :func:`permute_tokens` (``x_bal[b, i] = x[b, order[b, i]]``) to every per-token
    array (tokens, labels, loss weights, segment ids, position ids), then
    :func:`jax_cpgrad.to_cp_layout`; undo it with :func:`unpermute_tokens`. Position ids permuted
    with the tokens keep every token's position; positions recomputed as ``arange(S)`` after the
    permutation shift each document by a constant, which relative encodings (RoPE) ignore and
    absolute ones do not.

    Up to 7 documents every order is tried (the best order there is); more: a seeded local search
    (``max_steps`` batches of 64 random swaps and moves) that stops once max/mean over the ranks is
    at most ``1 + tolerance``. No order can balance a document that is long against S / R (its last
    chunk alone outweighs a rank's share); the result is then the best found, not balanced.
    Deterministic for a given ``seed`` (row b uses ``[seed, b]``). Host-side: ``segment_ids`` must
    be concrete (numpy, or a JAX array outside jit).
    """
    where = "balanced_document_order"
    num_ranks = _check_ranks(num_ranks)
    ids = _host_ids(segment_ids, where)
    b, s = ids.shape
    if s % (2 * num_ranks):
        raise ValueError(f"{where}: S = {s} must be a multiple of 2R = {2 * num_ranks} (R = num_ranks)")
    if not isinstance(tolerance, (int, float, np.number)) or not np.isfinite(tolerance) or tolerance < 0:
        raise ValueError(f"{where}: tolerance must be a number >= 0, got {tolerance!r}")
    if not isinstance(max_steps, (int, np.integer)) or max_steps < 0:
        raise ValueError(f"{where}: max_steps must be an int >= 0, got {max_steps!r}")
    out = np.empty((b, s), np.int32)
    for row in range(b):
        starts, lengths = document_runs(ids[row])
        runs = _balanced_run_order(
            lengths, ids[row][starts], num_ranks, float(tolerance), int(max_steps), [seed, row]
        )
        # token order: the runs' index ranges, concatenated in the new run order
        n = lengths[runs]
        offset = np.arange(s) - np.repeat(np.cumsum(n) - n, n)
        out[row] = np.repeat(starts[runs], n) + offset
    return out


def longest_document(segment_ids) -> int:
    """The length in tokens of the longest document (contiguous run of equal ids, a padding run
    included) of any row of the natural-order ``segment_ids [B, S]``: what
    :func:`jax_cpgrad.dot_product_attention`'s ``max_document_length`` must not be below, checked
    in the input pipeline (host-side: concrete ids, as :func:`balanced_document_order`)."""
    ids = _host_ids(segment_ids, "longest_document")
    return max(int(document_runs(row)[1].max()) for row in ids)


def _check_order(x, order, seq_axis: int, where: str):
    if not hasattr(x, "shape") or not hasattr(x, "ndim"):
        raise ValueError(f"{where}: x is not an array: {type(x).__name__}")
    if x.ndim < 2:
        raise ValueError(f"{where}: x must be at least [B, S] (2 dimensions), got shape {tuple(x.shape)}")
    seq_axis = normalize_seq_axis(seq_axis, x.ndim)
    if seq_axis == 0:
        raise ValueError(f"{where}: seq_axis must not be the batch axis 0")
    if not hasattr(order, "shape") or not hasattr(order, "dtype"):
        order = np.asarray(order)
    if len(order.shape) != 2:
        raise ValueError(f"{where}: order must be [B, S] (2 dimensions), got shape {tuple(order.shape)}")
    if not jnp.issubdtype(order.dtype, jnp.integer):
        raise ValueError(f"{where}: order must have an integer dtype, got {order.dtype}")
    b, s = x.shape[0], x.shape[seq_axis]
    if order.shape[1] != s or order.shape[0] not in (1, b):
        raise ValueError(
            f"{where}: order {tuple(order.shape)} does not fit x {tuple(x.shape)} with seq_axis {seq_axis}: "
            f"it must be [B, S] = [{b}, {s}] (or [1, {s}])"
        )
    return order, seq_axis


def _gather(x, index, seq_axis: int):
    """``x`` gathered along ``seq_axis`` by ``index [B or 1, S]``, the same index for every other axis."""
    xp = np if isinstance(x, np.ndarray) and isinstance(index, np.ndarray) else jnp
    shape = [1] * x.ndim
    shape[0], shape[seq_axis] = index.shape
    return xp.take_along_axis(x, xp.broadcast_to(xp.reshape(index, shape), x.shape), axis=seq_axis)


def permute_tokens(x, order, seq_axis: int = 1):
    """``x`` with its tokens in ``order`` (from :func:`balanced_document_order`): along ``seq_axis``,
    ``out[b, i] = x[b, order[b, i]]``. ``x``: ``[B, ..., S, ...]`` (batch axis 0), numpy or JAX;
    ``order``: ``[B, S]`` or ``[1, S]``, numpy or JAX (it may be traced: works under jit)."""
    order, seq_axis = _check_order(x, order, seq_axis, "permute_tokens")
    return _gather(x, order, seq_axis)


def unpermute_tokens(x, order, seq_axis: int = 1):
    """Inverse of :func:`permute_tokens` with the same ``order``: tokens back to the original order
    (exactly: a gather by the inverse permutation)."""
    order, seq_axis = _check_order(x, order, seq_axis, "unpermute_tokens")
    xp = np if isinstance(order, np.ndarray) else jnp
    return _gather(x, xp.argsort(order, axis=1), seq_axis)
