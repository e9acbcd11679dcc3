"""``dot_product_attention``: context-parallel attention of one rank, inside ``jax.shard_map``."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np

from .. import api
from . import kernels, public_path, split_attention
from .plan import RankPlan
from .transfer import NoTransfer, OnMeshAxis

_FLOAT_DTYPES = tuple(jnp.dtype(d) for d in api.FLOAT_DTYPES)
IMPLEMENTATIONS = (None, "xla", "cudnn")
# At N = 1 the local layout is the whole sequence in natural order: no transfer is needed, and
# the layer is one attention call. Tests turn this off to run the transfer's path at N = 1.
SKIP_TRANSFER_WHEN_ALONE = True
_NAME = "jax_cpgrad.dot_product_attention"  # in messages
_warned_public_path = False
kernels.cudnn_binds()  # looked up once, at import; a jax without them is told at first use


def attention_workspace_nbytes(key) -> int:
    """The ``nbytes`` a :class:`jax_cpgrad.Workspace` needs for :func:`dot_product_attention` on
    keys shaped like ``key`` (an array or ``jax.ShapeDtypeStruct``): the rank's local K and V,
    ``2 * B * T * K * H * itemsize`` (one workspace serves every layer of that size or smaller)."""
    shape = tuple(key.shape)
    if len(shape) != 4:
        raise ValueError(f"attention_workspace_nbytes: key must be [B, T, K, H], got shape {shape}")
    return 2 * int(np.prod(shape)) * jnp.dtype(key.dtype).itemsize


def _check_shapes(query, key, value) -> None:
    for label, x in (("query", query), ("key", key), ("value", value)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"{_NAME}: {label} is not an array: {type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(f"{_NAME}: {label} must be [B, T, N, H] (4 dimensions), got shape {x.shape}")
        if jnp.dtype(x.dtype) not in _FLOAT_DTYPES:
            raise ValueError(
                f"{_NAME}: {label} has dtype {x.dtype}; float32, bfloat16 and float16 are supported"
            )
    if not query.dtype == key.dtype == value.dtype:
        raise ValueError(
            f"{_NAME}: query, key and value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}"
        )
    if key.shape != value.shape:
        raise ValueError(
            f"{_NAME}: key and value must have the same shape, got {key.shape} and {value.shape}"
        )
    (b, t, n, h), (bk, tk, nk, hk) = query.shape, key.shape
    if (b, t) != (bk, tk):
        raise ValueError(
            f"{_NAME}: query and key must have the same batch and local length, got [B, T] = "
            f"{[b, t]} and {[bk, tk]}"
        )
    if h != hk:
        raise ValueError(f"{_NAME}: query and key head dims differ: {h} and {hk}")
    if nk == 0 or n % nk:
        raise ValueError(f"{_NAME}: the query heads ({n}) must be a multiple of the key/value heads ({nk})")
    if t % 2:
        raise ValueError(
            f"{_NAME}: the local length T = {t} must be even: a rank holds two chunks of the "
            "load-balanced layout (jax_cpgrad.to_cp_layout)"
        )


def _choose_implementation(implementation, dtype, head_dim: int) -> str:
    """'xla', 'cudnn' or 'public' (cuDNN wanted, but this jax lacks the private primitives)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{_NAME}: implementation must be None, 'xla' or 'cudnn', got {implementation!r}")
    if implementation == "xla":
        return "xla"
    max_head_dim = cudnn_max_head_dim()
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in kernels.CUDNN_DTYPES]:
        why_not = f"bfloat16 or float16 inputs, got {jnp.dtype(dtype).name}"
    elif max_head_dim is None:
        why_not = (
            f"an NVIDIA GPU of compute capability 8.0 or newer, not {jax.local_devices()[0].device_kind}"
        )
    elif head_dim % 8 or head_dim > max_head_dim:
        why_not = f"a head dim that is a multiple of 8, at most {max_head_dim} on this GPU; got {head_dim}"
    else:
        why_not = None
    if why_not is not None:
        if implementation == "cudnn":
            raise ValueError(f"{_NAME}: implementation='cudnn' needs {why_not}")
        return "xla"
    if kernels.cudnn_binds() is None:
        _warn_public_path()
        return "public"
    return "cudnn"


def cudnn_max_head_dim() -> int | None:
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


def _warn_public_path() -> None:
    global _warned_public_path
    if not _warned_public_path:
        _warned_public_path = True
        warnings.warn(
            f"jax_cpgrad.dot_product_attention: jax {jax.__version__} lacks the private cuDNN "
            "attention primitives the layer uses (jax._src.cudnn.fused_attention_stablehlo), so it "
            "falls back to jax.nn.dot_product_attention with a boolean mask: exact, but about 1.5x "
            "the causal attention work plus a mask read (measured 2.7-3.4x slower on an H200), and "
            "the K/V transfer is not hidden behind attention work. Use jax 0.11.2-0.12.x for the fast path.",
            stacklevel=4,
        )


def _prepare(query, key, value, scale, implementation, head_groups) -> tuple[float, str]:
    """Every check of the arrays and options; (the scale, the implementation to run)."""
    _check_shapes(query, key, value)
    kv_heads = key.shape[2]
    if not isinstance(head_groups, (int, np.integer)) or isinstance(head_groups, bool) or head_groups < 1:
        raise ValueError(f"{_NAME}: head_groups must be a positive int, got {head_groups!r}")
    if kv_heads % head_groups:
        raise ValueError(f"{_NAME}: head_groups ({head_groups}) must divide the key/value heads ({kv_heads})")
    head_dim = query.shape[-1]
    if scale is None:
        scale = head_dim**-0.5
    if not isinstance(scale, (int, float, np.integer, np.floating)) or isinstance(scale, bool):
        raise ValueError(
            f"{_NAME}: scale must be a Python or numpy number (static), got {type(scale).__name__}"
        )
    return float(scale), _choose_implementation(implementation, query.dtype, head_dim)


def _split_config(
    n: int, is_causal, scale: float, impl: str, transfer, head_groups
) -> split_attention.Config:
    """The split computation's configuration for a rank of ``n``, moving K/V with ``transfer``."""
    plan = RankPlan(n=n, causal=bool(is_causal), split_when_alone=not SKIP_TRANSFER_WHEN_ALONE)
    return split_attention.Config(
        plan=plan, scale=scale, impl=impl, transfer=transfer, head_groups=int(head_groups)
    )


def _check_workspace(spec, axis_name: str, n: int, key) -> None:
    if spec is None:
        return
    needed = attention_workspace_nbytes(key)
    if needed > spec.nbytes:
        raise ValueError(
            f"{_NAME}: workspace '{spec.name}' holds {spec.nbytes} bytes per call but this layer "
            f"needs {needed} (the local K and V: 2 x {list(key.shape)} x {jnp.dtype(key.dtype).itemsize} "
            "bytes); create it with nbytes=jax_cpgrad.attention_workspace_nbytes(key) or more"
        )
    spec.check_call(axis_name, n, needed, "dot_product_attention")


def dot_product_attention(
    query,
    key,
    value,
    *,
    axis_name: str,
    workspace=None,
    scale: float | None = None,
    is_causal: bool = True,
    implementation: str | None = None,
    head_groups: int = 1,
):
    """Context-parallel scaled dot-product attention, exact, for one rank inside ``jax.shard_map``.

    The global sequence of S tokens is split over the R devices of the mesh axis ``axis_name`` in
    the load-balanced layout (:func:`jax_cpgrad.to_cp_layout`): each rank holds T = S/R tokens,
    global chunks r and 2R-1-r of S/(2R) tokens each. Each rank passes its local
    ``query [B, T, N, H]`` and ``key``/``value [B, T, K, H]`` (N query heads, K key/value heads
    dividing N: MHA, GQA, MQA; the letters are ``jax.nn.dot_product_attention``'s) and gets back
    its rows ``[B, T, N, H]`` of the unsharded attention on the natural-order global arrays, with
    that attention's gradients.

    K and V are gathered at K heads (never repeated to N) and dK/dV are returned to their owners:
    over the peer transport with ``workspace`` (a :class:`jax_cpgrad.Workspace` on this axis;
    :func:`attention_workspace_nbytes` sizes it), which sums the ranks' shares in float32 in rank
    order and rounds once, or over XLA collectives without (``psum_scatter``, in the inputs'
    dtype). Each rank's share and the local part's dK/dV are rounded to the inputs' dtype before
    they are summed. The part of the attention that needs only the rank's own keys runs
    while K/V travel, and in the backward pass while dK/dV travel (really beside them with a
    workspace made with ``overlap=True``; XLA schedules its own collectives otherwise).

    Args:
      query, key, value: the rank's local arrays, float32, bfloat16 or float16 (one dtype).
      axis_name: the CP mesh axis.
      workspace: a ``Workspace`` (peer transport) or None (XLA collectives).
      scale: the scores' scale; default ``1 / sqrt(H)``.
      is_causal: causal attention (query i sees keys 0..i of the global sequence), or full.
      implementation: None, ``"cudnn"`` or ``"xla"``. None is cuDNN flash attention where it can
        run (bfloat16/float16 on an NVIDIA GPU of compute capability 8.0+, a head dim it takes)
        and XLA elsewhere; ``jax.nn.dot_product_attention``'s None means XLA. The softmax and
        the merge of the parts run in float32 in both.
      head_groups: pipeline the transfer over this many groups of key/value heads (it must
        divide K): group g+1's K/V travel while group g's remote part computes, and group g's
        dK/dV return while group g+1's backward runs, so that only a G-th of the transfer waits
        on the local part. For transfers longer than the local part (many key/value heads,
        small chunks: ``benchmarks/sweeps/attention_overlap_window.py``); it splits every remote
        kernel call G ways. 1 (the default): no pipeline. Ignored at N = 1 (no transfer).

    Raises:
      ValueError: before anything runs, for mismatched shapes or dtypes, query heads that are not
        a multiple of the key heads, an odd local length, a scale that is not a static number,
        an axis that is not bound (called outside ``shard_map``), a workspace that is closed, of
        another axis or too small, ``implementation="cudnn"`` where cuDNN cannot run these
        inputs, or ``head_groups`` that does not divide the key/value heads.
    """
    scale, impl = _prepare(query, key, value, scale, implementation, head_groups)
    n = api.axis_size(axis_name, "dot_product_attention")
    spec = api.spec_of(workspace, "dot_product_attention")
    _check_workspace(spec, axis_name, n, key)
    rank = jax.lax.axis_index(axis_name).astype(jnp.int32)
    if impl == "public":
        return public_path.attention(
            query, key, value, axis_name=axis_name, spec=spec, rank=rank, n=n, causal=is_causal,
            scale=scale, implementation=("cudnn" if jax.local_devices()[0].platform == "gpu" else "xla"),
        )  # fmt: skip
    cfg = _split_config(n, is_causal, scale, impl, OnMeshAxis(axis_name, spec), head_groups)
    return split_attention.attention(cfg, query, key, value, rank)


def rank_without_transfer(
    query,
    key,
    value,
    rank,
    n: int,
    *,
    is_causal: bool = True,
    scale: float | None = None,
    implementation=None,
    head_groups: int = 1,
):
    """The layer's computation for rank ``rank`` of ``n``, alone: real shapes, a local copy in place
    of every transfer (the gathered keys are not the other ranks'). To measure a rank's
    attention work on one device (benchmarks/attention.py); not for training."""
    scale, impl = _prepare(query, key, value, scale, implementation, head_groups)
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"rank_without_transfer: n must be an int >= 1, got {n!r}")
    if isinstance(rank, int) and not 0 <= rank < n:
        raise ValueError(f"rank_without_transfer: rank must be in [0, {n}), got {rank}")
    if impl == "public":
        raise ValueError("rank_without_transfer needs the split implementation (xla or cudnn)")
    cfg = _split_config(n, is_causal, scale, impl, NoTransfer(n), head_groups)
    return split_attention.attention(cfg, query, key, value, jnp.asarray(rank, jnp.int32))
