"""Which of a CP rank's queries meet which keys, in two parts of one static shape on every rank.

Rank r of N holds global chunks r and 2N-1-r (c tokens each) of the queries, keys and values, in
that order (the load-balanced layout). Its attention is split in two parts:

- **local**: what needs only the rank's own keys, so it can run while the others travel.
  Causal: each query chunk against its own key chunk (the diagonal blocks, causal; the two chunks
  folded into the batch). Not causal: all the rank's queries against its own 2c keys.
- **remote**: what needs the gathered keys (natural order, length S = 2Nc). Not causal: all
  queries against the 2N-2 key chunks of the other ranks. Causal: chunk r sees keys [0, rc) and
  chunk 2N-1-r sees [0, (2N-1-r)c), in two calls:
    * **paired**: the two query chunks against the two halves of the keys (the gathered keys
      as they arrived, seen as two batch entries: no copy): chunk r against the first half's
      first rc keys, chunk 2N-1-r against the second half's first (N-1-r)c. The counts are
      run-time values that always add up to N-1 chunks, so the call is the same size on every
      rank and neither entry waits on the other.
    * **far**: chunk 2N-1-r against the whole first half (Nc keys), which it always sees: a
      static key count, so those keys are copied out and the call needs no mask.
  The far chunk's two results are merged with the local part's by log-sum-exp, and its key
  gradients from the two calls are summed in float32.

At N = 1 the local part is the whole attention (the local layout is the natural order) and there
is no remote part, unless ``split_when_alone`` (causal only: the tests' way to run the transfer's
path on one device; then only the far call has keys).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class RankPlan:
    n: int
    causal: bool
    split_when_alone: bool = False

    @property
    def has_remote(self) -> bool:
        return self.n > 1 or (self.split_when_alone and self.causal)

    @property
    def folds_chunks(self) -> bool:
        """The causal local part takes the two chunks as two batch entries of c rows each."""
        return self.causal and self.has_remote

    # -- local ---------------------------------------------------------------------------------

    def local_operands(self, q, k, v):
        """(q, k, v) of the local part: the rank's queries against its own keys."""
        if self.folds_chunks:
            return fold(q), fold(k), fold(v)
        return q, k, v

    def local_result(self, out, lse):
        """The local part's (out [B, T, N, H], lse [B, N, T])."""
        return (unfold(out), unfold_lse(lse)) if self.folds_chunks else (out, lse)

    def local_grads(self, dq, dk, dv):
        return tuple(unfold(g) for g in (dq, dk, dv)) if self.folds_chunks else (dq, dk, dv)

    def local_cotangents(self, out, lse, d_out):
        """The merged output, log-sum-exp and output cotangent, shaped like the local part."""
        if self.folds_chunks:
            return fold(out), fold_lse(lse), fold(d_out)
        return out, lse, d_out

    # -- remote --------------------------------------------------------------------------------

    def remote_forward(self, forward, q, k_glob, v_glob, rank):
        """The remote part as (out [B, T, N, H], lse [B, N, T]) pairs to merge with the local
        part's; ``forward(q, k, v, kv_len)`` is one kernel call without a causal mask."""
        if not self.causal:
            return [forward(q, self._others(k_glob, rank), self._others(v_glob, rank), None)]
        parts = []
        if self.n > 1:
            out, lse = forward(fold(q), fold(k_glob), fold(v_glob), self._paired_lengths(q, rank))
            parts.append((unfold(out), unfold_lse(lse)))
        out, lse = forward(_far(q), _first_half(k_glob), _first_half(v_glob), None)
        parts.append((_on_far_rows(out, 0), _on_far_rows(lse, -jnp.inf, -1)))
        return parts

    def remote_backward(self, backward, q, k_glob, v_glob, out, lse, d_out, rank):
        """The remote part's (dq [B, T, N, H] float32, dk, dv [B, S, K, H] natural order, zero
        where the part read no key), each the float32 sum of its calls' gradients, the key
        gradients rounded once to their dtype; ``backward(q, k, v, out, lse, d_out, kv_len)`` is
        one kernel call."""
        if not self.causal:
            dq, dk, dv = backward(
                q, self._others(k_glob, rank), self._others(v_glob, rank), out, lse, d_out, None
            )
            return dq.astype(F32), self._spread(dk, rank), self._spread(dv, rank)
        grads = []
        if self.n > 1:
            dq, dk, dv = backward(
                fold(q), fold(k_glob), fold(v_glob), fold(out), fold_lse(lse), fold(d_out),
                self._paired_lengths(q, rank),
            )  # fmt: skip
            grads.append((unfold(dq), unfold(dk), unfold(dv)))
        dq, dk, dv = backward(
            _far(q), _first_half(k_glob), _first_half(v_glob), _far(out), _far(lse, -1), _far(d_out), None
        )
        grads.append((_on_far_rows(dq, 0), _on_first_half(dk), _on_first_half(dv)))
        total = lambda xs: sum(x.astype(F32) for x in xs)
        dq, dk, dv = (total(list(g)) for g in zip(*grads, strict=True))
        return dq, dk.astype(k_glob.dtype), dv.astype(v_glob.dtype)

    def _paired_lengths(self, q, rank):
        """The paired call's key counts, int32 [2B] (b-major, as ``fold``): chunk r sees rc keys
        of the first half, chunk 2N-1-r sees (N-1-r)c of the second."""
        c = q.shape[1] // 2
        pair = jnp.stack([rank * c, (self.n - 1 - rank) * c]).astype(jnp.int32)
        return jnp.tile(pair, q.shape[0])

    def _others(self, x, rank):
        """The 2N-2 key chunks of the other ranks, in order: [B, (2N-2)c, ...]."""
        b = x.shape[0]
        return jnp.take(_chunked(x, 2 * self.n), self._other_chunks(rank), axis=1).reshape(
            b, -1, *x.shape[2:]
        )

    def _spread(self, g, rank):
        """[B, (2N-2)c, ...] of the other chunks -> [B, S, ...] natural order, zero in the rank's
        own chunks: a gather from the chunks and one zero chunk (a scatter would be a sort under
        --xla_gpu_deterministic_ops)."""
        b = g.shape[0]
        chunks = g.reshape(b, 2 * self.n - 2, -1, *g.shape[2:])
        chunks = jnp.concatenate([chunks, jnp.zeros_like(chunks[:, :1])], axis=1)
        j = jnp.arange(2 * self.n)
        own = (j == rank) | (j == 2 * self.n - 1 - rank)
        where = jnp.where(own, 2 * self.n - 2, j - (j > rank) - (j > 2 * self.n - 1 - rank))
        return jnp.take(chunks, where, axis=1).reshape(b, -1, *g.shape[2:])

    def _other_chunks(self, rank):
        """The 2N-2 global chunks other than r and 2N-1-r, in order (r < 2N-1-r always)."""
        t = jnp.arange(2 * self.n - 2)
        return t + (t >= rank) + (t >= 2 * self.n - 2 - rank)


def _far(x, axis: int = 1):
    """The rank's second chunk (2N-1-r) along ``axis`` (the queries' rows)."""
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
    """[B, 2c, ...] -> [2B, c, ...] (entries b-major: chunk r then chunk 2N-1-r of each row)."""
    return _chunked(x, 2).reshape(-1, x.shape[1] // 2, *x.shape[2:])


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
