"""The attention kernels the layer can call, behind one contract (``contract.py``).

- ``cudnn.py``: jax's private cuDNN flash-attention primitives, plain calls (causal or full, and
  causal with a left window: the layer's causal windows, ``plan.py``);
- ``xla.py``: plain jnp, every mask, any dtype and platform (the reference, the CPU tests); masked
  calls of more than :data:`DENSE_SCORES_MAX` scores per head take ``blockwise.py`` instead, which
  visits only the tiles a Visibility needs and never holds the whole score matrix;
- ``mosaic.py``: the project's Pallas Mosaic GPU kernels for sm_90 (``mosaic_gpu/``), masked
  calls only (plain attention goes to them as masked calls).

:data:`KERNELS` is the one list of implementations: ``implementation=`` takes their names, and
``implementation=None`` takes the first of them that can run the call among those marked
``by_default``: in :data:`KERNELS`' order for plain attention, in :data:`MASKED_ORDER` for
documents and windows.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from .. import blockwise
from ..masks import Visibility
from ..merging import merge
from ..rounding import firm, rounded
from . import cudnn, mosaic, xla
from .contract import Kernel

F32 = jnp.float32
# Up to this many scores per head (T x L) the masked XLA kernel materializes them (fastest for
# the small calls of tests and short sequences); beyond, it runs the blockwise path, whose memory
# does not grow with T x L (a 16k x 112k call would need 7 GiB of float32 scores per head).
DENSE_SCORES_MAX = 1 << 22


def _xla_masked_forward(q, k, v, vis: Visibility, *, scale: float):
    if q.shape[1] * k.shape[1] <= DENSE_SCORES_MAX:
        return xla.masked_forward(q, k, v, vis, scale=scale)
    return blockwise.forward(q, k, v, vis, scale=scale)


def _xla_masked_backward(q, k, v, o, lse, do, vis: Visibility, *, scale: float):
    if q.shape[1] * k.shape[1] <= DENSE_SCORES_MAX:
        return xla.masked_backward(q, k, v, o, lse, do, vis, scale=scale)
    return blockwise.backward(q, k, v, o, lse, do, vis, scale=scale)


# implementation=None takes the first that can run a call: cuDNN for plain calls, the Pallas
# kernels for masked ones on sm_90, XLA for everything else.
KERNELS: tuple[Kernel, ...] = (
    cudnn.KERNEL,
    mosaic.KERNEL,
    Kernel("xla", xla.forward, xla.backward, _xla_masked_forward, _xla_masked_backward),
)
IMPLEMENTATIONS = tuple(kernel.name for kernel in KERNELS)
# Documents and windows: the Pallas kernels where they run (sm_90: one masked call a part), cuDNN
# for a window its plain calls can take (elsewhere), XLA for the rest.
MASKED_ORDER = ("mosaic", "cudnn", "xla")


def choice_order(masked: bool) -> tuple[Kernel, ...]:
    """The kernels implementation=None tries, in order."""
    return tuple(by_name(name) for name in MASKED_ORDER) if masked else KERNELS


def by_name(name: str) -> Kernel:
    return next(kernel for kernel in KERNELS if kernel.name == name)


def _entry(impl: str, call: str) -> Callable:
    """Kernel ``impl``'s ``call`` (the layer's choice checked that it has one)."""
    entry = getattr(by_name(impl), call)
    if entry is None:
        raise NotImplementedError(f"implementation={impl!r} has no {call}")
    return entry


# Every call's results are firm (``rounding.py``): the XLA kernel rounds its output in plain jnp,
# and the layer widens it again to merge.


def forward(impl: str, q, k, v, *, causal: bool, scale: float, kv_len=None, window=None):
    """(out, lse) of a plain call (causal or full, ``kv_len``, a causal ``window``) of ``impl``;
    see ``contract.py``."""
    kernel = _entry(impl, "forward")
    if _folds_groups(q, k, causal):
        out, lse = kernel(fold_groups(q, k), k, v, causal=False, scale=scale, kv_len=kv_len)
        return firm((_unfold_groups(out, q), lse.reshape(q.shape[0], q.shape[2], q.shape[1])))
    return firm(kernel(q, k, v, causal=causal, scale=scale, kv_len=kv_len, window=window))


def backward(impl: str, q, k, v, o, lse, do, *, causal: bool, scale: float, kv_len=None, window=None):
    """(dq, dk, dv) of a plain call whose merged output and log-sum-exp are o and lse."""
    kernel = _entry(impl, "backward")
    if _folds_groups(q, k, causal):
        fold = lambda x: fold_groups(x, k)
        lse = lse.reshape(q.shape[0], k.shape[2], -1)
        dq, dk, dv = kernel(fold(q), k, v, fold(o), lse, fold(do), causal=False, scale=scale, kv_len=kv_len)
        return firm((_unfold_groups(dq, q), dk, dv))
    return firm(kernel(q, k, v, o, lse, do, causal=causal, scale=scale, kv_len=kv_len, window=window))


def masked_forward(impl: str, q, k, v, vis: Visibility, *, scale: float, prev=None):
    """(out, lse) of a masked call of ``impl`` (of q's first ``vis.q_len`` rows). ``prev``: the
    (out, lse) of the same rows against other keys (out's rows taken as q's are), which the call
    continues: the result is the two merged (``merging.merge``), in the kernel itself where it
    ``continues`` (no pass of XLA's over both parts), else after it."""
    call = _entry(impl, "masked_forward")
    if prev is None:
        (q,) = _call_rows(impl, vis, q)
        return firm(call(q, k, v, vis, scale=scale))
    q, prev_out = _call_rows(impl, vis, q, prev[0])
    if by_name(impl).continues:
        return firm(call(q, k, v, vis, scale=scale, prev=(prev_out, prev[1])))
    part = firm(call(q, k, v, vis, scale=scale))
    return merge((prev_out, prev[1]), part)


def masked_backward(impl: str, q, k, v, o, lse, do, vis: Visibility, *, scale: float, dq_add=None):
    """(dq, dk, dv) of a masked call whose merged output and log-sum-exp are o and lse.
    ``dq_add``: another part's dq of the same rows (in q's dtype, the call's rows), added to this
    call's in float32 and rounded once (in the kernel where it ``continues``): the same bits
    either way."""
    q, o, do = _call_rows(impl, vis, q, o, do)
    call = _entry(impl, "masked_backward")
    if dq_add is not None and by_name(impl).continues:
        return firm(call(q, k, v, o, lse, do, vis, scale=scale, dq_add=dq_add))
    dq, dk, dv = firm(call(q, k, v, o, lse, do, vis, scale=scale))
    if dq_add is not None:
        dq = rounded(dq.astype(F32) + dq_add.astype(F32), dq.dtype)
    return dq, dk, dv


def prime_masked(impl: str, q, k, vis: Visibility) -> Visibility:
    """``vis`` with what the masked forward and backward of ``impl`` on these q and k (arrays or
    shapes) make of it (their tile plans) made now, where the kernel makes any: the layer calls
    this with its masks, and its calls take them from the result."""
    prime = by_name(impl).prime
    if prime is None:
        return vis
    if not by_name(impl).rows_in_place:  # the call's first rows (a shape: only it counts)
        q = jax.ShapeDtypeStruct((q.shape[0], vis.q_len, *q.shape[2:]), q.dtype)
    return prime(q, k, vis)


def _call_rows(impl: str, vis: Visibility, *xs):
    """``xs`` as the kernel takes them: whole where it reads a call's first rows in place
    (``rows_in_place``), else their first ``vis.q_len`` rows."""
    if by_name(impl).rows_in_place:
        return xs
    return tuple(x if x.shape[1] == vis.q_len else x[:, : vis.q_len] for x in xs)


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
