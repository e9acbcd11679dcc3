"""Attention by tiles, visiting only the tiles of ``tile_plan.tile_ranges``: plain jnp, any dtype,
CPU or GPU.

This is the XLA path for masks that the dense kernels cannot skip (windows, documents, a CP
rank's chunks), and the reference algorithm of the Mosaic GPU kernels: the same plan, the same
three sections per outer tile (masked tiles before the full ones, full tiles without an element
mask, masked tiles after), the same float32 online softmax. Each outer tile is one lane of a
``vmap`` (a program of a kernel's grid) that loops over its own range with ``lax.fori_loop``.

Passes (shapes as ``jax.nn.dot_product_attention``: q ``[B, T, N, H]``, k/v ``[B, L, K, H]``,
K dividing N, query head n uses key head n // G with G = N // K; K/V stay at K heads):

- forward: per query tile over its key tiles (``vis.row_lo/row_hi``); out ``[B, T, N, H]`` in q's
  dtype, lse ``[B, N, T]`` float32 (natural log);
- dQ: per query tile over its key tiles, the same plan;
- dK/dV: per key tile over its query tiles (``vis.col_lo/col_hi``), the G query heads of a key
  head summed in float32 inside the loop. Every output element is written by one lane in one
  fixed order: no scatter-add, no atomics, the same bits on every run.

Each pass masks elements by the intervals its plan came from (rows for forward and dQ, columns
for dK/dV), so a tile the plan calls full is full for the mask the pass would have applied. The
backward takes (out, lse) as given: P = exp(S - lse) and delta = rowsum(d_out * out) with them,
so it is exact for a part of a merged attention (``split_attention``'s docstring). A row that sees
no key has out 0, lse -inf and gradients 0; -inf never meets -inf in an exponent, so no NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import masks, tile_plan
from .mesh_axes import varying_like

F32 = jnp.float32
I32 = jnp.int32


def _check(q, k, v, vis: masks.Visibility):
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(
            f"blockwise: q [B, T, N, H] and k, v [B, L, K, H], got {q.shape}, {k.shape}, {v.shape}"
        )
    b, t, n, h = q.shape
    if k.shape[0] != b or k.shape[3] != h or n % k.shape[2]:
        raise ValueError(f"blockwise: k/v {k.shape} must be [B, L, K, H] with K dividing N for q {q.shape}")
    bp = vis.row_lo.shape[0]
    if bp not in (1, b) or vis.row_lo.shape[1:] != (t,) or vis.col_lo.shape[1:] != (k.shape[1],):
        raise ValueError(
            f"blockwise: visibility rows {vis.row_lo.shape}, columns {vis.col_lo.shape} do not fit "
            f"q {q.shape}, k {k.shape} (want [1 or B, T] and [1 or B, L])"
        )


def _tiles(x, block: int):
    """``[B, S, ...]`` -> ``[B, S/block, block, ...]``, zero-padded to a multiple of ``block``."""
    n = tile_plan.cdiv(x.shape[1], block)
    x = jnp.pad(x, [(0, 0), (0, n * block - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
    return x.reshape(x.shape[0], n, block, *x.shape[2:])


def _row_tiles(x, block: int):
    """``[Bp, S]`` interval bounds -> ``[Bp, S/block, block]``; padded rows get [0, 0): nothing."""
    n = tile_plan.cdiv(x.shape[1], block)
    return jnp.pad(x, [(0, 0), (0, n * block - x.shape[1])]).reshape(x.shape[0], n, block)


def _sections(r, body, carry, reads):
    """Run ``body(j, carry, masked)`` over the inner tiles of one outer tile, section by section.

    ``r`` holds this lane's scalars (lo, full_lo, full_hi, hi); ``reads``, the arrays the body
    reads, whose mesh axes the carry takes on (``mesh_axes.py``)."""
    lo, full_lo, full_hi, hi = r
    carry = varying_like(carry, (r, reads))
    return tile_plan.over_inner_tiles(lo, full_lo, full_hi, hi, body, carry)


def _in_interval(lo, hi, index):
    """bool ``[len(lo), len(index)]``: ``lo[r] <= index[c] < hi[r]``."""
    return (lo[:, None] <= index[None, :]) & (index[None, :] < hi[:, None])


def _scores(q_t, k_t, scale: float):
    """Scaled scores ``[K, G, bq, bk]`` in float32 of a query tile ``[bq, K, G, H]`` and a key tile."""
    return jnp.einsum("tkgh,skh->kgts", q_t, k_t, preferred_element_type=F32) * F32(scale)


def _grid(fn, b: int, tiled, shared):
    """``vmap`` of ``fn(*tiled, *shared)`` over batch entries and outer tiles (the kernel's grid).

    ``tiled`` arrays are ``[B or 1, n_outer, ...]`` (one slice per lane; a leading 1, the plan
    without documents, serves every entry), ``shared`` ones ``[B, ...]`` (read by every outer tile
    of an entry)."""
    tiled = [jnp.broadcast_to(x, (b, *x.shape[1:])) for x in tiled]
    per_tile = jax.vmap(fn, in_axes=(0,) * len(tiled) + (None,) * len(shared))
    return jax.vmap(per_tile)(*tiled, *shared)


def _plan(vis: masks.Visibility, side: str, outer: int, inner: int, inner_len: int):
    """The tile plan of ``vis``'s rows (``side="row"``) or columns ("col")."""

    def plan_of(vis):
        lo, hi = getattr(vis, f"{side}_lo"), getattr(vis, f"{side}_hi")
        r = tile_plan.tile_ranges(lo, hi, outer_block=outer, inner_block=inner, inner_len=inner_len)
        return r.lo, r.full_lo, r.full_hi, r.hi

    return vis.derive(plan_of, ("blockwise", side, outer, inner, inner_len))


def _blocks(q, k, block_q: int, block_k: int):
    """Tile sizes: as asked, but no larger than the sequence (a larger tile only adds padding)."""
    return max(1, min(block_q, q.shape[1])), max(1, min(block_k, k.shape[1]))


def forward(q, k, v, vis: masks.Visibility, *, scale: float, block_q: int = 128, block_k: int = 128):
    """(out ``[B, T, N, H]`` in q's dtype, lse ``[B, N, T]`` float32) of q against k/v where ``vis``
    lets rows see keys; only the key tiles of each query tile's plan are visited."""
    _check(q, k, v, vis)
    b, t, n, h = q.shape
    l_len, kh = k.shape[1], k.shape[2]
    g = n // kh
    bq, bk = _blocks(q, k, block_q, block_k)
    plan = _plan(vis, "row", bq, bk, l_len)
    q_tiles = _tiles(q.reshape(b, t, kh, g, h), bq)  # [B, nq, bq, K, G, H]
    rows = _row_tiles(vis.row_lo, bq), _row_tiles(vis.row_hi, bq)  # [Bp, nq, bq]
    k_tiles, v_tiles = _tiles(k, bk), _tiles(v, bk)  # [B, nk, bk, K, H]

    def one_query_tile(lo, full_lo, full_hi, hi, q_t, row_lo, row_hi, k_all, v_all):
        def body(j, carry, masked: bool):
            m, s_sum, acc = carry  # running max [K, G, bq], sum of exponentials, output [K, G, bq, H]
            s = _scores(q_t, k_all[j], scale)
            if masked:
                seen = _in_interval(row_lo, row_hi, j * bk + jnp.arange(bk, dtype=I32))
                s = jnp.where(seen, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=-1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row with nothing seen yet: no -inf - -inf
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            acc = alpha[..., None] * acc + jnp.einsum("kgts,skh->kgth", p, v_all[j].astype(F32))
            return m_new, alpha * s_sum + p.sum(axis=-1), acc

        init = (
            jnp.full((kh, g, bq), -jnp.inf, F32),
            jnp.zeros((kh, g, bq), F32),
            jnp.zeros((kh, g, bq, h), F32),
        )
        m, s_sum, acc = _sections((lo, full_lo, full_hi, hi), body, init, (q_t, row_lo, row_hi, k_all, v_all))
        seen_any = s_sum > 0
        out = jnp.where(seen_any[..., None], acc / jnp.where(seen_any, s_sum, 1.0)[..., None], 0.0)
        lse = jnp.where(seen_any, m + jnp.log(jnp.where(seen_any, s_sum, 1.0)), -jnp.inf)
        return out, lse  # [K, G, bq, H], [K, G, bq]

    out, lse = _grid(one_query_tile, b, (*plan, q_tiles, *rows), (k_tiles, v_tiles))
    # out [B, nq, K, G, bq, H] -> [B, T, N, H]; lse [B, nq, K, G, bq] -> [B, N, T]
    out = out.transpose(0, 1, 4, 2, 3, 5).reshape(b, -1, n, h)[:, :t]
    lse = lse.transpose(0, 2, 3, 1, 4).reshape(b, n, -1)[..., :t]
    return out.astype(q.dtype), lse


def _probabilities(s, lse_t):
    """exp(s - lse): a row with lse = -inf (it sees nothing) takes +inf, so it gets 0, not NaN."""
    return jnp.exp(s - jnp.where(lse_t == -jnp.inf, jnp.inf, lse_t)[..., None])


def backward(
    q, k, v, out, lse, d_out, vis: masks.Visibility, *, scale: float, block_q: int = 128, block_k: int = 128
):
    """(dq, dk, dv) in the inputs' dtypes, from the GIVEN ``out`` and ``lse`` (possibly the merged
    ones of several parts): dS = P * (dO V^T - rowsum(dO * out)) with P = exp(S - lse)."""
    _check(q, k, v, vis)
    b, t, n, h = q.shape
    l_len, kh = k.shape[1], k.shape[2]
    g = n // kh
    bq, bk = _blocks(q, k, block_q, block_k)
    heads = lambda x: x.reshape(b, t, kh, g, h)
    # delta = rowsum(dO * O) once for all rows (a flash backward's preprocessing step).
    delta = jnp.einsum("btkgh,btkgh->bkgt", heads(d_out).astype(F32), heads(out).astype(F32))

    def per_row(x, fill):
        """``[B, K, G, T]`` -> ``[B, nq, K, G, bq]``, padded rows set to ``fill``."""
        nq = tile_plan.cdiv(t, bq)
        x = jnp.pad(x, [(0, 0)] * 3 + [(0, nq * bq - t)], constant_values=fill)
        return x.reshape(b, kh, g, nq, bq).transpose(0, 3, 1, 2, 4)

    # Padded rows: lse -inf gives P = 0 there even without a mask.
    lse_tiles = per_row(lse.astype(F32).reshape(b, kh, g, t), -jnp.inf)
    delta_tiles = per_row(delta, 0.0)
    q_tiles, do_tiles = _tiles(heads(q), bq), _tiles(heads(d_out), bq)  # [B, nq, bq, K, G, H]
    k_tiles, v_tiles = _tiles(k, bk), _tiles(v, bk)  # [B, nk, bk, K, H]

    def tile_grads(q_t, do_t, lse_t, delta_t, k_t, v_t, seen):
        """P and dS ``[K, G, bq, bk]`` of one (query tile, key tile) pair; ``seen`` None: full."""
        p = _probabilities(_scores(q_t, k_t, scale), lse_t)
        if seen is not None:
            p = jnp.where(seen, p, 0.0)
        dp = jnp.einsum("tkgh,skh->kgts", do_t, v_t, preferred_element_type=F32)
        return p, p * (dp - delta_t[..., None]) * F32(scale)

    # dQ: per query tile over its key tiles, the forward's plan.
    def one_query_tile(lo, full_lo, full_hi, hi, q_t, do_t, lse_t, delta_t, row_lo, row_hi, k_all, v_all):
        def body(j, dq, masked: bool):
            seen = _in_interval(row_lo, row_hi, j * bk + jnp.arange(bk, dtype=I32)) if masked else None
            _, ds = tile_grads(q_t, do_t, lse_t, delta_t, k_all[j], v_all[j], seen)
            return dq + jnp.einsum("kgts,skh->tkgh", ds, k_all[j].astype(F32))

        return _sections(
            (lo, full_lo, full_hi, hi),
            body,
            jnp.zeros((bq, kh, g, h), F32),
            (q_t, do_t, lse_t, delta_t, row_lo, row_hi, k_all, v_all),
        )

    q_plan = _plan(vis, "row", bq, bk, l_len)
    rows = _row_tiles(vis.row_lo, bq), _row_tiles(vis.row_hi, bq)
    dq = _grid(
        one_query_tile, b, (*q_plan, q_tiles, do_tiles, lse_tiles, delta_tiles, *rows), (k_tiles, v_tiles)
    )  # [B, nq, bq, K, G, H]

    # dK/dV: per key tile over its query tiles, the columns' plan; the G heads summed in the einsum.
    def one_key_tile(lo, full_lo, full_hi, hi, k_t, v_t, col_lo, col_hi, q_all, do_all, lse_all, delta_all):
        def body(i, carry, masked: bool):
            dk, dv = carry
            seen = _in_interval(col_lo, col_hi, i * bq + jnp.arange(bq, dtype=I32)).T if masked else None
            p, ds = tile_grads(q_all[i], do_all[i], lse_all[i], delta_all[i], k_t, v_t, seen)
            dv = dv + jnp.einsum("kgts,tkgh->skh", p, do_all[i].astype(F32))
            dk = dk + jnp.einsum("kgts,tkgh->skh", ds, q_all[i].astype(F32))
            return dk, dv

        return _sections(
            (lo, full_lo, full_hi, hi),
            body,
            (jnp.zeros((bk, kh, h), F32),) * 2,
            (k_t, v_t, col_lo, col_hi, q_all, do_all, lse_all, delta_all),
        )

    k_plan = _plan(vis, "col", bk, bq, t)
    cols = _row_tiles(vis.col_lo, bk), _row_tiles(vis.col_hi, bk)
    dk, dv = _grid(
        one_key_tile, b, (*k_plan, k_tiles, v_tiles, *cols), (q_tiles, do_tiles, lse_tiles, delta_tiles)
    )  # [B, nk, bk, K, H]
    dq = dq.reshape(b, -1, n, h)[:, :t]
    dk, dv = (x.reshape(b, -1, kh, h)[:, :l_len] for x in (dk, dv))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
