"""Which of a CP rank's queries meet which keys, in two parts of one static shape on every rank.

Rank r of N holds global chunks r and 2N-1-r (c tokens each) of the queries, keys and values, in
that order (the load-balanced layout). Its attention is split in two parts:

- **local**: what needs only the rank's own keys, so it can run while the others travel.
  Causal: each query chunk against its own key chunk (the diagonal blocks, causal; the two chunks
  folded into the batch). Not causal: all the rank's queries against its own 2c keys.
- **remote**: what needs the gathered keys (natural order, length S = 2Nc). Causal: chunk r
  against keys [0, rc) and chunk 2N-1-r against keys [0, (2N-1-r)c) -- one call over the first
  (2N-1)c keys, the two chunks folded into the batch, each seeing its own number of keys (a
  runtime value: the shapes are the same on every rank). Not causal: all queries against the
  2N-2 key chunks of the other ranks.

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
        """Causal parts take the two chunks as two batch entries of c rows each."""
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

    def remote_operands(self, q, k_glob, v_glob, rank):
        """(q, k, v, kv_len) of the remote part; kv_len is None when every key counts."""
        b, t = q.shape[:2]
        c = t // 2
        if self.causal:
            keys = (2 * self.n - 1) * c
            kv_len = jnp.tile(jnp.stack([rank * c, (2 * self.n - 1 - rank) * c]).astype(jnp.int32), b)
            pair = lambda x: fold(
                jnp.broadcast_to(x[:, None, :keys], (b, 2, keys, *x.shape[2:])), merged=True
            )
            return fold(q), pair(k_glob), pair(v_glob), kv_len
        others = self._other_chunks(rank)
        take = lambda x: jnp.take(_chunked(x, 2 * self.n), others, axis=1).reshape(b, -1, *x.shape[2:])
        return q, take(k_glob), take(v_glob), None

    def remote_result(self, out, lse):
        return self.local_result(out, lse) if self.causal else (out, lse)

    def remote_query_grad(self, dq):
        return unfold(dq) if self.causal else dq

    def remote_cotangents(self, out, lse, d_out):
        return self.local_cotangents(out, lse, d_out) if self.causal else (out, lse, d_out)

    def remote_key_grads(self, dk, seq: int, rank):
        """The remote part's key gradient as the rank's gradient of the whole sequence [B, S]
        (natural order; zero where the part read no key), summed in float32, rounded once."""
        if self.causal:
            b2, keys = dk.shape[:2]
            both = dk.reshape(b2 // 2, 2, keys, *dk.shape[2:]).astype(F32).sum(axis=1)
            pad = [(0, 0), (0, seq - keys)] + [(0, 0)] * (dk.ndim - 2)
            return jnp.pad(both, pad).astype(dk.dtype)
        b = dk.shape[0]
        chunks = dk.reshape(b, 2 * self.n - 2, -1, *dk.shape[2:])
        full = (
            jnp.zeros((b, 2 * self.n, *chunks.shape[2:]), dk.dtype)
            .at[:, self._other_chunks(rank)]
            .set(chunks)
        )
        return full.reshape(b, seq, *dk.shape[2:])

    def _other_chunks(self, rank):
        """The 2N-2 global chunks other than r and 2N-1-r, in order (r < 2N-1-r always)."""
        t = jnp.arange(2 * self.n - 2)
        return t + (t >= rank) + (t >= 2 * self.n - 2 - rank)


def _chunked(x, parts: int):
    """[B, parts*c, ...] -> [B, parts, c, ...]."""
    return x.reshape(x.shape[0], parts, x.shape[1] // parts, *x.shape[2:])


def fold(x, merged: bool = False):
    """[B, 2c, ...] -> [2B, c, ...] (entries b-major: chunk r then chunk 2N-1-r of each row);
    merged=True takes x already as [B, 2, c, ...]."""
    pairs = x if merged else _chunked(x, 2)
    return pairs.reshape(-1, *pairs.shape[2:])


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
