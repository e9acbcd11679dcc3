"""The reference kernels in plain jnp: any dtype, any platform (the CPU tests), every mask.

Scores are materialized (``[B, K, G, T, L]`` float32, G = N // K query heads per key head) and
masked densely: by ``causal`` and ``kv_len`` for plain calls, by ``vis.dense()`` for masked ones.
The contract is ``contract.py``'s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..masks import Visibility
from .contract import check_visibility

F32 = jnp.float32


def _plain_mask(t: int, l_len: int, causal: bool, kv_len, window=None):
    """Boolean [B or 1, 1, 1, T, L]: which keys each query sees."""
    mask = jnp.ones((1, 1, 1, t, l_len), bool)
    if causal:
        mask = mask & jnp.tril(jnp.ones((t, l_len), bool))
    if window is not None:  # causal's sliding window: key j within `window` before query i
        mask = mask & ~jnp.tril(jnp.ones((t, l_len), bool), -window - 1)
    if kv_len is not None:
        mask = mask & (jnp.arange(l_len) < kv_len[:, None])[:, None, None, None, :]
    return mask


def _dense_mask(q, k, vis: Visibility):
    """Boolean [Bp, 1, 1, T, L] of a Visibility."""
    check_visibility(q, k, vis)
    return vis.dense()[:, None, None]


def _scores(q, k, scale):
    """Scaled scores [B, K, G, T, L] in float32."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, n // kh, h)
    return jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=F32) * F32(scale)


def _probabilities(s, lse, mask):
    """exp(s - lse) where visible, 0 elsewhere (rows with no key have lse = -inf)."""
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]
    return jnp.where(mask, jnp.exp(s - safe), 0.0)


def _forward(q, k, v, mask, scale: float):
    b, t, n, h = q.shape
    s = _scores(q, k, scale)
    lse = jax.nn.logsumexp(jnp.where(mask, s, -jnp.inf), axis=-1)  # [B, K, G, T]
    p = _probabilities(s, lse, mask)
    o = jnp.einsum("bkgts,bskh->btkgh", p, v.astype(F32))
    return o.reshape(b, t, n, h).astype(q.dtype), lse.reshape(b, n, t)


def _backward(q, k, v, o, lse, do, mask, scale: float):
    """The softmax gradient with P = exp(S - lse) and D = rowsum(do * o), whatever o and lse are
    (what the cuDNN backward computes from them)."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    p = _probabilities(_scores(q, k, scale), lse.reshape(b, kh, g, t), mask)
    dog = do.reshape(b, t, kh, g, h).astype(F32)
    delta = jnp.einsum("btkgh,btkgh->bkgt", dog, o.reshape(b, t, kh, g, h).astype(F32))
    dv = jnp.einsum("bkgts,btkgh->bskh", p, dog)
    ds = p * (jnp.einsum("btkgh,bskh->bkgts", dog, v.astype(F32)) - delta[..., None]) * F32(scale)
    dq = jnp.einsum("bkgts,bskh->btkgh", ds, k.astype(F32)).reshape(b, t, n, h)
    dk = jnp.einsum("bkgts,btkgh->bskh", ds, q.reshape(b, t, kh, g, h).astype(F32))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def forward(q, k, v, *, causal: bool, scale: float, kv_len=None, window=None):
    return _forward(q, k, v, _plain_mask(q.shape[1], k.shape[1], causal, kv_len, window), scale)


def backward(q, k, v, o, lse, do, *, causal: bool, scale: float, kv_len=None, window=None):
    mask = _plain_mask(q.shape[1], k.shape[1], causal, kv_len, window)
    return _backward(q, k, v, o, lse, do, mask, scale)


def masked_forward(q, k, v, vis: Visibility, *, scale: float):
    return _forward(q, k, v, _dense_mask(q, k, vis), scale)


def masked_backward(q, k, v, o, lse, do, vis: Visibility, *, scale: float):
    return _backward(q, k, v, o, lse, do, _dense_mask(q, k, vis), scale)
