"""Attention of one block of queries against one block of keys, returning its log-sum-exp, and
the backward that takes an *external* output and log-sum-exp (the merged ones).

Two implementations of the same contract:

- ``xla``: plain jnp, any dtype and platform (the CPU tests); scores are materialized.
- ``cudnn``: jax's cuDNN flash-attention primitives, bound directly. They are private jax API
  (``jax._src.cudnn.fused_attention_stablehlo``): the public ``jax.nn.dot_product_attention``
  rounds the log-sum-exp to the input dtype and its backward cannot take an external output and
  log-sum-exp, which an exact merge needs. :func:`cudnn_binds` detects them once; without them
  the layer falls back to a public path (``public_path.py``).

Shapes (``jax.nn.dot_product_attention``'s letters): q ``[B, T, N, H]``, k/v ``[B, L, K, H]``
with K dividing N; out ``[B, T, N, H]``; lse ``[B, N, T]`` float32, the natural log of the
summed exponentials of the scaled scores. ``causal``: query i sees keys 0..i (T == L here).
``kv_len`` (int32 ``[B]``, a runtime value, or None): only the first kv_len[b] keys of entry b
count. A row that sees no key has lse = -inf and output 0; its gradients are 0.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp

F32 = jnp.float32
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


# -- xla ---------------------------------------------------------------------------------------


def _visible(t: int, l_len: int, causal: bool, kv_len):
    """Boolean [B or 1, 1, 1, T, L]: which keys each query sees."""
    mask = jnp.ones((1, 1, 1, t, l_len), bool)
    if causal:
        mask = mask & jnp.tril(jnp.ones((t, l_len), bool))
    if kv_len is not None:
        mask = mask & (jnp.arange(l_len) < kv_len[:, None])[:, None, None, None, :]
    return mask


def _scores(q, k, scale):
    """Scaled scores [B, K, G, T, L] in float32 (G = N // K queries share a key head)."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, n // kh, h)
    return jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=F32) * F32(scale)


def _probabilities(s, lse, mask):
    """exp(s - lse) where visible, 0 elsewhere (rows with no key have lse = -inf)."""
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]
    return jnp.where(mask, jnp.exp(s - safe), 0.0)


def _xla_forward(q, k, v, *, causal: bool, scale: float, kv_len=None):
    b, t, n, h = q.shape
    mask = _visible(t, k.shape[1], causal, kv_len)
    s = _scores(q, k, scale)
    lse = jax.nn.logsumexp(jnp.where(mask, s, -jnp.inf), axis=-1)  # [B, K, G, T]
    p = _probabilities(s, lse, mask)
    o = jnp.einsum("bkgts,bskh->btkgh", p, v.astype(F32))
    return o.reshape(b, t, n, h).astype(q.dtype), lse.reshape(b, n, t)


def _xla_backward(q, k, v, o, lse, do, *, causal: bool, scale: float, kv_len=None):
    """The softmax gradient with P = exp(S - lse) and D = rowsum(do * o), whatever o and lse are
    (what the cuDNN backward computes from them)."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    mask = _visible(t, k.shape[1], causal, kv_len)
    p = _probabilities(_scores(q, k, scale), lse.reshape(b, kh, g, t), mask)
    dog = do.reshape(b, t, kh, g, h).astype(F32)
    delta = jnp.einsum("btkgh,btkgh->bkgt", dog, o.reshape(b, t, kh, g, h).astype(F32))
    dv = jnp.einsum("bkgts,btkgh->bskh", p, dog)
    ds = p * (jnp.einsum("btkgh,bskh->bkgts", dog, v.astype(F32)) - delta[..., None]) * F32(scale)
    dq = jnp.einsum("bkgts,bskh->btkgh", ds, k.astype(F32)).reshape(b, t, n, h)
    dk = jnp.einsum("bkgts,btkgh->bskh", ds, q.reshape(b, t, kh, g, h).astype(F32))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


# -- cudnn -------------------------------------------------------------------------------------


@functools.cache
def cudnn_binds():
    """(module, extra keyword arguments) of jax's private cuDNN attention primitives, or None when
    this jax does not have them in the form used here (then the layer takes its public path)."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fas

        fwd = fas._dot_product_attention_fwd_p_wrapper
        bwd = fas._dot_product_attention_bwd_p_wrapper
        params = inspect.signature(fas._dot_product_attention_fwd_impl).parameters
        needed = (
            "scale", "seed", "dropout_rate", "variadic_args", "mask_type", "layout",
            "sliding_window_length", "is_training",
        )  # fmt: skip
        if not all(name in params for name in needed) or not (fwd and bwd):
            return None
        for name in ("NO_MASK", "CAUSAL", "PADDING", "PADDING_CAUSAL"):
            getattr(fas.MaskType, name)
        fas.AttentionLayout.BTNH.value  # noqa: B018 (the layout the binds are given)
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    # jax 0.12 added flex attention: the primitives take a `score_mod` parameter (and positional
    # score_mod_args after the fixed operands, none here); jax 0.11.2 has neither.
    return fas, ({"score_mod": None} if "score_mod" in params else {})


def _cudnn_operands(fas, q, causal: bool, scale: float, kv_len):
    """The seven optional operands (bias, q/kv lengths, q/kv offsets, paged K/V tables: absent
    unless kv_len is given) and the primitives' parameters."""
    unused = jnp.zeros((0,), q.dtype)
    if kv_len is None:
        lengths = (unused, unused)
        mask = fas.MaskType.CAUSAL if causal else fas.MaskType.NO_MASK
    else:
        # Never ask cuDNN for an entry of no key: it sees one key and one query row (the
        # callers clear what it produced: _clear_empty_rows, the backward's masks). With all its
        # rows, the backward's one live key tile would walk every row alone: measured 0.2-1 ms
        # on an H200 for a rank whose first chunk has no remote key.
        has_keys = kv_len > 0
        q_len = jnp.where(has_keys, q.shape[1], 1).astype(jnp.int32)
        lengths = (q_len, jnp.where(has_keys, kv_len, 1).astype(jnp.int32))
        mask = fas.MaskType.PADDING_CAUSAL if causal else fas.MaskType.PADDING
    return (unused, *lengths, unused, unused, unused, unused), cudnn_params(fas, mask, scale)


def cudnn_params(fas, mask, scale: float) -> dict:
    """The primitives' parameters for ``mask`` (a ``fas.MaskType``): no dropout, no bias, BTNH."""
    return dict(
        scale=float(scale),
        seed=0,
        dropout_rate=0.0,
        variadic_args=(False, False),
        mask_type=mask,
        layout=fas.AttentionLayout.BTNH.value,
        sliding_window_length=None,
    )


def _cudnn_forward(q, k, v, *, causal: bool, scale: float, kv_len=None):
    fas, extra = cudnn_binds()
    operands, params = _cudnn_operands(fas, q, causal, scale, kv_len)
    out, lse = fas._dot_product_attention_fwd_p_wrapper.bind(
        q, k, v, *operands, is_training=True, **params, **extra
    )
    return _clear_empty_rows(out, lse, kv_len)


def _cudnn_backward(q, k, v, o, lse, do, *, causal: bool, scale: float, kv_len=None):
    fas, extra = cudnn_binds()
    operands, params = _cudnn_operands(fas, q, causal, scale, kv_len)
    dq, dk, dv = fas._dot_product_attention_bwd_p_wrapper.bind(
        q, k, v, *operands, lse.astype(F32), o.astype(q.dtype), do.astype(q.dtype), **params, **extra
    )
    if kv_len is None:
        return dq, dk, dv
    # cuDNN leaves the padded key rows and the rows of entries with no key unspecified.
    has_keys = (kv_len > 0)[:, None, None, None]
    real_key = (jnp.arange(k.shape[1]) < kv_len[:, None])[:, :, None, None]
    zero = lambda x, keep: jnp.where(keep, x, jnp.zeros((), x.dtype))
    return zero(dq, has_keys), zero(dk, real_key), zero(dv, real_key)


def _clear_empty_rows(out, lse, kv_len):
    """Entries that see no key: output 0 and lse -inf, whatever the kernel wrote there."""
    if kv_len is None:
        return out, lse
    has_keys = kv_len > 0
    out = jnp.where(has_keys[:, None, None, None], out, jnp.zeros((), out.dtype))
    return out, jnp.where(has_keys[:, None, None], lse.astype(F32), -jnp.inf)


KERNELS = {
    "xla": (_xla_forward, _xla_backward),
    "cudnn": (_cudnn_forward, _cudnn_backward),
}


def forward(impl: str, q, k, v, *, causal: bool, scale: float, kv_len=None):
    """(out, lse) of q against k/v; see the module docstring."""
    if _folds_groups(q, k, causal):
        out, lse = KERNELS[impl][0](_fold_groups(q, k), k, v, causal=False, scale=scale, kv_len=kv_len)
        return _unfold_groups(out, q), lse.reshape(q.shape[0], q.shape[2], q.shape[1])
    return KERNELS[impl][0](q, k, v, causal=causal, scale=scale, kv_len=kv_len)


def backward(impl: str, q, k, v, o, lse, do, *, causal: bool, scale: float, kv_len=None):
    """(dq, dk, dv) of the attention whose merged output and log-sum-exp are o and lse."""
    if _folds_groups(q, k, causal):
        fold = lambda x: _fold_groups(x, k)
        lse = lse.reshape(q.shape[0], k.shape[2], -1)
        dq, dk, dv = KERNELS[impl][1](
            fold(q), k, v, fold(o), lse, fold(do), causal=False, scale=scale, kv_len=kv_len
        )
        return _unfold_groups(dq, q), dk, dv
    return KERNELS[impl][1](q, k, v, o, lse, do, causal=causal, scale=scale, kv_len=kv_len)


# Without a causal mask, the G = N // K query heads that share a key head can be taken as G x T
# rows of one head: the same scores and sums, and cuDNN's backward then has no per-query-head key
# gradients to reduce (measured on an H200: 5-7% less time for a call of 1k-2k queries over
# 15k-30k keys, with N = 32, K = 8). Rows are g-major, so the log-sum-exp [B, N, T] is a reshape.


def _folds_groups(q, k, causal: bool) -> bool:
    return not causal and q.shape[2] != k.shape[2]


def _fold_groups(x, k):
    """[B, T, N, H] -> [B, G*T, K, H] (row g*T + t is head k*G + g's query t)."""
    b, t, n, h = x.shape
    kh = k.shape[2]
    return x.reshape(b, t, kh, n // kh, h).transpose(0, 3, 1, 2, 4).reshape(b, -1, kh, h)


def _unfold_groups(x, like):
    """The inverse of _fold_groups, to ``like``'s [B, T, N, H]."""
    b, t, n, h = like.shape
    kh = x.shape[2]
    return x.reshape(b, n // kh, t, kh, h).transpose(0, 2, 3, 1, 4).reshape(b, t, n, h)
