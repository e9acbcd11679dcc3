"""The attention kernels the layer can call, behind one contract (``contract.py``).

- ``xla.py``: plain jnp, every mask, any dtype and platform (the reference, the CPU tests);
- ``cudnn.py``: jax's private cuDNN flash-attention primitives, plain calls (causal or full);
- later: ``mosaic_gpu`` (Pallas kernels for sm_90 taking a Visibility), as one more entry of
  :data:`KERNELS`.

:data:`KERNELS` is the one list of implementations: ``implementation=`` takes their names, and
``implementation=None`` takes the first of them that can run the call (its order).
"""

from __future__ import annotations

from collections.abc import Callable

from ..masks import Visibility
from . import cudnn, xla
from .contract import Kernel

# The masked XLA kernel, chosen in ONE line. The blockwise path, which visits only the tiles a
# Visibility needs, plugs in here: (partial(blockwise.forward, block_q=.., block_k=..), the same
# for blockwise.backward).
XLA_MASKED = (xla.masked_forward, xla.masked_backward)

KERNELS: tuple[Kernel, ...] = (
    cudnn.KERNEL,
    Kernel("xla", xla.forward, xla.backward, *XLA_MASKED),
)
IMPLEMENTATIONS = tuple(kernel.name for kernel in KERNELS)


def by_name(name: str) -> Kernel:
    return next(kernel for kernel in KERNELS if kernel.name == name)


def _entry(impl: str, call: str) -> Callable:
    """Kernel ``impl``'s ``call`` (the layer's choice checked that it has one)."""
    entry = getattr(by_name(impl), call)
    if entry is None:
        raise NotImplementedError(f"implementation={impl!r} has no {call}")
    return entry


def forward(impl: str, q, k, v, *, causal: bool, scale: float, kv_len=None):
    """(out, lse) of a plain call (causal or full, ``kv_len``) of ``impl``; see ``contract.py``."""
    kernel = _entry(impl, "forward")
    if _folds_groups(q, k, causal):
        out, lse = kernel(fold_groups(q, k), k, v, causal=False, scale=scale, kv_len=kv_len)
        return _unfold_groups(out, q), lse.reshape(q.shape[0], q.shape[2], q.shape[1])
    return kernel(q, k, v, causal=causal, scale=scale, kv_len=kv_len)


def backward(impl: str, q, k, v, o, lse, do, *, causal: bool, scale: float, kv_len=None):
    """(dq, dk, dv) of a plain call whose merged output and log-sum-exp are o and lse."""
    kernel = _entry(impl, "backward")
    if _folds_groups(q, k, causal):
        fold = lambda x: fold_groups(x, k)
        lse = lse.reshape(q.shape[0], k.shape[2], -1)
        dq, dk, dv = kernel(fold(q), k, v, fold(o), lse, fold(do), causal=False, scale=scale, kv_len=kv_len)
        return _unfold_groups(dq, q), dk, dv
    return kernel(q, k, v, o, lse, do, causal=causal, scale=scale, kv_len=kv_len)


def masked_forward(impl: str, q, k, v, vis: Visibility, *, scale: float):
    """(out, lse) of a masked call of ``impl``."""
    return _entry(impl, "masked_forward")(q, k, v, vis, scale=scale)


def masked_backward(impl: str, q, k, v, o, lse, do, vis: Visibility, *, scale: float):
    """(dq, dk, dv) of a masked call whose merged output and log-sum-exp are o and lse."""
    return _entry(impl, "masked_backward")(q, k, v, o, lse, do, vis, scale=scale)


# Without a causal mask, the G = N // K query heads that share a key head can be taken as G x T
# rows of one head: the same scores and sums, and cuDNN's backward then has no per-query-head key
# gradients to reduce (measured on an H200: 5-7% less time for a call of 1k-2k queries over
# 15k-30k keys, with N = 32, K = 8). Rows are g-major, so the log-sum-exp [B, N, T] is a reshape.


def _folds_groups(q, k, causal: bool) -> bool:
    return not causal and q.shape[2] != k.shape[2]


def fold_groups(x, k):
    """[B, T, N, H] -> [B, G*T, K, H] (row g*T + t is head k*G + g's query t)."""
    b, t, n, h = x.shape
    kh = k.shape[2]
    return x.reshape(b, t, kh, n // kh, h).transpose(0, 3, 1, 2, 4).reshape(b, -1, kh, h)


def _unfold_groups(x, like):
    """The inverse of fold_groups, to ``like``'s [B, T, N, H]."""
    b, t, n, h = like.shape
    kh = x.shape[2]
    return x.reshape(b, n // kh, t, kh, h).transpose(0, 2, 3, 1, 4).reshape(b, t, n, h)
