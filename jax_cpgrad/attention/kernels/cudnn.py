"""jax's cuDNN flash-attention primitives, bound directly, and their limits: plain calls only
(causal or full, with ``kv_len``; causal with a left window, cuDNN's sliding window), bfloat16/
float16, an NVIDIA GPU of compute capability 8.0+.

They are private jax API (``jax._src.cudnn.fused_attention_stablehlo``): the public
``jax.nn.dot_product_attention`` rounds the log-sum-exp to the input dtype and its backward cannot
take an external output and log-sum-exp, which the layer's exact merge needs. Every supported jax
(0.11.2 to 0.12.x) has them; :func:`binds` looks them up on first use (never at import, so CPU
users never touch them), and a jax without them is told so when cuDNN is asked for.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp

from .contract import Kernel

F32 = jnp.float32
DTYPES = (jnp.bfloat16, jnp.float16)


@functools.cache
def binds():
    """(module, extra keyword arguments) of jax's private cuDNN attention primitives, or None when
    this jax does not have them in the form used here."""
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


def max_head_dim() -> int | None:
    """The largest head dim cuDNN flash attention takes on this process's devices (256 from
    Hopper on, 128 on Ampere), or None where it cannot run (no NVIDIA GPU of compute capability
    8.0 or newer)."""
    device = jax.local_devices()[0]
    if device.platform != "gpu" or "cuda" not in device.client.platform_version.lower():
        return None  # the CPU, or ROCm (the primitives lower for CUDA only)
    try:
        major = int(str(device.compute_capability).split(".")[0])
    except (AttributeError, ValueError):
        return None
    return None if major < 8 else 256 if major >= 9 else 128


def refuses(dtype, head_dim: int) -> str | None:
    """What these inputs lack for cuDNN here ("implementation='cudnn' needs ..."), or None."""
    largest = max_head_dim()
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES]:
        return f"bfloat16 or float16 inputs, got {jnp.dtype(dtype).name}"
    if largest is None:
        return f"an NVIDIA GPU of compute capability 8.0 or newer, not {jax.local_devices()[0].device_kind}"
    if head_dim % 8 or head_dim > largest:
        return f"a head dim that is a multiple of 8, at most {largest} on this GPU; got {head_dim}"
    if binds() is None:
        return (
            "jax's private cuDNN attention primitives (jax._src.cudnn.fused_attention_stablehlo, "
            f"as in jax 0.11.2-0.12.x), which jax {jax.__version__} lacks"
        )
    return None


def _operands(fas, q, causal: bool, scale: float, kv_len, window=None):
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
    if window is not None and (not causal or kv_len is not None):
        raise ValueError("cudnn attention: a window needs a causal call without kv_len")
    return (unused, *lengths, unused, unused, unused, unused), params(fas, mask, scale, window)


def params(fas, mask, scale: float, window: int | None = None) -> dict:
    """The primitives' parameters for ``mask`` (a ``fas.MaskType``): no dropout, no bias, BTNH;
    with ``window`` w (causal), query i sees keys i - w .. i: cuDNN's sliding window of w + 1
    (as ``jax.nn.dot_product_attention`` passes a left window)."""
    return dict(
        scale=float(scale),
        seed=0,
        dropout_rate=0.0,
        variadic_args=(False, False),
        mask_type=mask,
        layout=fas.AttentionLayout.BTNH.value,
        sliding_window_length=None if window is None else int(window) + 1,
    )


def _binds():
    found = binds()
    if found is None:  # the layer's choice refuses this earlier; a direct caller is told here
        raise NotImplementedError(f"implementation='cudnn' needs {refuses(jnp.bfloat16, 128)}")
    return found


def forward(q, k, v, *, causal: bool, scale: float, kv_len=None, window=None):
    fas, extra = _binds()
    operands, kw = _operands(fas, q, causal, scale, kv_len, window)
    out, lse = fas._dot_product_attention_fwd_p_wrapper.bind(
        q, k, v, *operands, is_training=True, **kw, **extra
    )
    return _clear_empty_rows(out, lse, kv_len)


def backward(q, k, v, o, lse, do, *, causal: bool, scale: float, kv_len=None, window=None):
    fas, extra = _binds()
    operands, kw = _operands(fas, q, causal, scale, kv_len, window)
    dq, dk, dv = fas._dot_product_attention_bwd_p_wrapper.bind(
        q, k, v, *operands, lse.astype(F32), o.astype(q.dtype), do.astype(q.dtype), **kw, **extra
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


KERNEL = Kernel("cudnn", forward, backward, refuses=refuses, plain_windows=True)
