"""Which of a CP rank's queries meet which keys, in two parts of one static shape on every rank.

Rank r of N holds global chunks r and 2N-1-r (c tokens each) of the queries, keys and values, in
that order (the load-balanced layout). Its attention is split in two parts:

- **local**: what needs only the rank's own keys, so it can run while the others travel.
  Causal: each query chunk against its own key chunk (the diagonal blocks, causal; the two chunks
  folded into the batch). Not causal: all the rank's queries against its own 2c keys.
- **remote**: what needs the gathered keys (natural order, length S = 2Nc). Causal: chunk r
  against keys [0, rc) and chunk 2N-1-r against keys [0, (2N-1-r)c) -- one call per query chunk,
  each over the gathered keys as they arrived (no copy) with its number of keys a runtime value,
  so the shapes are the same on every rank; the two calls' key gradients are summed in float32.
  Not causal: all queries against the 2N-2 key chunks of the other ranks.

At N = 1 the local part is the whole attention (the local layout is the natural order) and there
is no remote part, unless ``split_when_alone`` (causal only: the tests' way to run the transfer's
path on one device).
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
        """The remote part's (out [B, T, N, H], lse [B, N, T]); ``forward(q, k, v, kv_len)`` is
        one kernel call without a causal mask."""
        if not self.causal:
            return forward(q, self._others(k_glob, rank), self._others(v_glob, rank), None)
        parts = [
            forward(q_chunk, k_glob, v_glob, kv_len)
            for q_chunk, kv_len in zip(_halves(q), self._prefix_lengths(q, rank), strict=True)
        ]
        return _join([o for o, _ in parts], 1), _join([lse for _, lse in parts], -1)

    def remote_backward(self, backward, q, k_glob, v_glob, out, lse, d_out, rank):
        """The remote part's (dq [B, T, N, H], dk, dv [B, S, K, H] natural order: zero where the
        part read no key): the two calls' key gradients summed in float32, the sum rounded once;
        ``backward(q, k, v, out, lse, d_out, kv_len)`` is one kernel call."""
        if not self.causal:
            dq, dk, dv = backward(
                q, self._others(k_glob, rank), self._others(v_glob, rank), out, lse, d_out, None
            )
            return dq, self._spread(dk, rank), self._spread(dv, rank)
        grads = [
            backward(q_c, k_glob, v_glob, o_c, lse_c, do_c, kv_len)
            for q_c, o_c, lse_c, do_c, kv_len in zip(
                _halves(q), _halves(out), _halves(lse, -1), _halves(d_out),
                self._prefix_lengths(q, rank), strict=True,
            )
        ]  # fmt: skip
        total = lambda xs: sum(x.astype(F32) for x in xs).astype(xs[0].dtype)
        return _join([g[0] for g in grads], 1), total([g[1] for g in grads]), total([g[2] for g in grads])

    def _prefix_lengths(self, q, rank):
        """How many of the gathered keys each query chunk sees: chunk r the r chunks before it,
        chunk 2N-1-r the 2N-1-r chunks before it (its own key chunk r among them), as int32 [B]."""
        b, c = q.shape[0], q.shape[1] // 2
        return [jnp.full((b,), count * c, jnp.int32) for count in (rank, 2 * self.n - 1 - rank)]

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


def _halves(x, axis: int = 1):
    """The rank's two chunks along ``axis`` (the queries' rows)."""
    return jnp.split(x, 2, axis=axis)


def _join(xs, axis: int):
    return jnp.concatenate(xs, axis=axis)


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
