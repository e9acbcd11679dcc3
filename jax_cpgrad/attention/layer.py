"""``dot_product_attention``: context-parallel attention of one rank, inside ``jax.shard_map``.

Here the arguments are checked (all before anything runs), the mask is normalised (``masks.py``)
and a kernel chosen (``kernels.KERNELS``); ``plan.py`` lays out the rank's calls and
``schedule.py`` runs them beside the transfers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .. import api
from . import kernels, schedule
from .kernels.contract import PLAIN_WINDOWS
from .masks import normalize_window, within_documents
from .plan import RankPlan, id_words, plain_window
from .transfer import OnMeshAxis

_FLOAT_DTYPES = tuple(jnp.dtype(d) for d in api.FLOAT_DTYPES)
IMPLEMENTATIONS = kernels.IMPLEMENTATIONS  # the names implementation= takes (None: the first that can run)
_NAME = "jax_cpgrad.dot_product_attention"  # in messages


def attention_workspace_nbytes(key) -> int:
    """The ``nbytes`` a :class:`jax_cpgrad.Workspace` needs for :func:`dot_product_attention` on
    keys shaped like ``key`` (an array or ``jax.ShapeDtypeStruct``): the rank's local K and V,
    ``2 * B * T * K * H * itemsize`` (one workspace serves every layer of that size or smaller)."""
    shape = tuple(key.shape)
    if len(shape) != 4:
        raise ValueError(f"attention_workspace_nbytes: key must be [B, T, K, H], got shape {shape}")
    return 2 * int(np.prod(shape)) * jnp.dtype(key.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Options:
    """The layer's static options, checked."""

    scale: float
    impl: str  # a kernels.KERNELS name
    causal: bool
    window: tuple[int, int] | None  # (left, right)
    documents: bool
    head_groups: int

    @property
    def masked(self) -> bool:
        return self.documents or self.window is not None


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


def _check_segment_ids(segment_ids, query):
    """The segment ids as int32 words [B, T, W] (``plan.id_words``), or None."""
    if segment_ids is None:
        return None
    if not hasattr(segment_ids, "shape") or not hasattr(segment_ids, "dtype"):
        raise ValueError(f"{_NAME}: segment_ids is not an array: {type(segment_ids).__name__}")
    if tuple(segment_ids.shape) != tuple(query.shape[:2]):
        raise ValueError(
            f"{_NAME}: segment_ids must be [B, T] = {list(query.shape[:2])} (the rank's local ids "
            f"in CP layout: jax_cpgrad.to_cp_layout of the global ids), got shape {tuple(segment_ids.shape)}"
        )
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(f"{_NAME}: segment_ids must have an integer dtype, got {segment_ids.dtype}")
    return id_words(segment_ids)


def _check_document_bound(max_document_length, words) -> int | None:
    """``max_document_length``, checked: None, or an int >= 1 given with segment ids."""
    if max_document_length is None:
        return None
    if (
        not isinstance(max_document_length, (int, np.integer))
        or isinstance(max_document_length, bool)
        or max_document_length < 1
    ):
        got = repr(max_document_length)
        raise ValueError(f"{_NAME}: max_document_length must be None or an int >= 1, got {got}")
    if words is None:
        raise ValueError(
            f"{_NAME}: max_document_length bounds the documents of segment_ids; pass segment_ids with it"
        )
    return int(max_document_length)


def _choose_implementation(
    implementation, dtype, head_dim: int, masked: bool, plain_window: bool = False
) -> str:
    """The kernel to run: ``implementation``, checked, or for None the first kernel of
    ``kernels.choice_order`` that can run these inputs (``plain_window``: ``plan.plain_window``)."""
    if implementation is None:
        for kernel in kernels.choice_order(masked):
            if kernel.by_default and kernel.why_not(dtype, head_dim, masked, plain_window) is None:
                return kernel.name
        raise AssertionError("the XLA kernel runs everything")
    if not isinstance(implementation, str) or implementation not in IMPLEMENTATIONS:
        names = " or ".join(repr(name) for name in IMPLEMENTATIONS)
        raise ValueError(f"{_NAME}: implementation must be None, {names}, got {implementation!r}")
    kernel = kernels.by_name(implementation)
    if not kernel.takes(masked, plain_window):
        alternatives = " or ".join(
            f"{k.name!r}" + (f" ({k.where})" if k.where else "") for k in kernels.KERNELS if k.takes_masks
        )
        if kernel.plain_windows:
            takes = f"no documents (segment_ids), and a local window only {PLAIN_WINDOWS}"
        else:
            takes = "no documents and no local window (segment_ids, local_window_size)"
        raise ValueError(
            f"{_NAME}: implementation={implementation!r} takes {takes}; "
            f"use implementation={alternatives} (or None)"
        )
    why_not = kernel.why_not(dtype, head_dim, masked, plain_window)
    if why_not is not None:
        raise ValueError(f"{_NAME}: implementation={implementation!r} needs {why_not}")
    return implementation


def prepare(
    query,
    key,
    value,
    *,
    scale,
    is_causal,
    segment_ids,
    local_window_size,
    implementation,
    head_groups,
    max_document_length=None,
) -> tuple[Options, jax.Array | None]:
    """Every check of the arrays and options (none needs the mesh axis: outside ``shard_map`` a
    bad argument is named before the unbound axis): (the options, the segment ids as int32 words
    or None)."""
    _check_shapes(query, key, value)
    if not isinstance(is_causal, (bool, np.bool_)):
        shown = repr(is_causal) if isinstance(is_causal, (str, int, float)) else type(is_causal).__name__
        raise ValueError(f"{_NAME}: is_causal must be a Python bool (static), got {shown}")
    words = _check_segment_ids(segment_ids, query)
    window = normalize_window(local_window_size, where=f"{_NAME}: local_window_size")
    longest = _check_document_bound(max_document_length, words)
    window = within_documents(window, longest, bool(is_causal))
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
    masked = words is not None or window is not None
    plain = plain_window(window, bool(is_causal), words is not None)
    impl = _choose_implementation(implementation, query.dtype, head_dim, masked, plain)
    options = Options(float(scale), impl, bool(is_causal), window, words is not None, int(head_groups))
    return options, words


def schedule_config(
    options: Options, num_ranks: int, transfer, *, transfer_when_alone: bool
) -> schedule.Config:
    """The schedule's configuration for a rank of ``num_ranks``, moving data with ``transfer``."""
    plan = RankPlan(
        num_ranks=num_ranks,
        causal=options.causal,
        window=options.window,
        documents=options.documents,
        transfer_when_alone=transfer_when_alone,
        plain_as_masked=kernels.by_name(options.impl).plain_as_masked,
        plain_windows=kernels.by_name(options.impl).plain_windows,
        moves_window_chunks=getattr(transfer, "moves_window_chunks", False),
    )
    return schedule.Config(
        plan=plan, scale=options.scale, impl=options.impl, transfer=transfer, head_groups=options.head_groups
    )


def _check_workspace(spec, axis_name: str, num_ranks: int, key) -> None:
    if spec is None:
        return
    needed = attention_workspace_nbytes(key)
    if needed > spec.nbytes:
        raise ValueError(
            f"{_NAME}: workspace '{spec.name}' holds {spec.nbytes} bytes per call but this layer "
            f"needs {needed} (the local K and V: 2 x {list(key.shape)} x {jnp.dtype(key.dtype).itemsize} "
            "bytes); create it with nbytes=jax_cpgrad.attention_workspace_nbytes(key) or more"
        )
    spec.check_call(axis_name, num_ranks, needed, "dot_product_attention")


def dot_product_attention(
    query,
    key,
    value,
    *,
    axis_name: str,
    workspace=None,
    scale: float | None = None,
    is_causal: bool = True,
    segment_ids=None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | None = None,
    head_groups: int = 1,
    max_document_length: int | None = None,
):
    """Context-parallel scaled dot-product attention, exact, for one rank inside ``jax.shard_map``.

    The global sequence of S tokens is split over the R devices of the mesh axis ``axis_name`` in
    the load-balanced layout (:func:`jax_cpgrad.to_cp_layout`): each rank holds T = S/R tokens,
    global chunks r and 2R-1-r of S/(2R) tokens each. Each rank passes its local
    ``query [B, T, N, H]`` and ``key``/``value [B, T, K, H]`` (N query heads, K key/value heads
    dividing N: MHA, GQA, MQA; the letters are ``jax.nn.dot_product_attention``'s) and gets back
    its rows ``[B, T, N, H]`` of the unsharded attention on the natural-order global arrays, with
    that attention's gradients: ``jax.nn.dot_product_attention`` with ``is_causal``,
    ``local_window_size`` and the documents' mask together.

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
      is_causal: a Python bool: causal attention (query i sees keys 0..i of the global
        sequence), or full.
      segment_ids: packed documents: the rank's local integer ids ``[B, T]`` in CP layout
        (``to_cp_layout`` of the global ``[B, S]`` ids), or None. A query sees only keys of its own
        document. A document is a contiguous run of equal ids in the natural order: an id that
        appears in two separate runs is two documents (``jax.nn.dot_product_attention``'s mask
        ``q_id == k_id`` would join them). The layer moves the other ranks' ids itself (over the
        same transport as K/V, before it; a few bytes per token); they get no gradient.
      local_window_size: as ``jax.nn.dot_product_attention``'s: an int w (w keys on each side) or
        a pair ``(left, right)``: query p sees keys k with ``p - left <= k <= p + right``;
        with ``is_causal`` the right side is 0 in effect. None: no window.
      implementation: None, ``"cudnn"``, ``"xla"`` or ``"mosaic"``. None is cuDNN flash attention
        for plain attention where it can run (bfloat16/float16 on an NVIDIA GPU of compute
        capability 8.0+, a head dim it takes), ``"mosaic"`` for documents and windows where it
        can run, cuDNN for a causal window it takes where ``"mosaic"`` cannot, and XLA elsewhere
        (``jax.nn.dot_product_attention``'s None means XLA). ``"mosaic"``: the project's own
        Pallas Mosaic GPU kernels (bfloat16/float16, head dims 64 and 128, Hopper GPUs only),
        every mask in one call per part, deterministic. ``"cudnn"`` takes no documents, and a
        window only with ``is_causal=True``, as plain calls: under a chunk the diagonal blocks
        with its sliding window and the halo's edge rows as causal calls on reversed rows and
        keys; from a chunk on the diagonal blocks causal, the keys before each chunk whole and
        the band before those reversed. XLA's masked calls visit only the tiles the mask needs once they
        are large (``jax_cpgrad/attention/blockwise.py``). The softmax and the merge of the parts
        run in float32 in all.
      head_groups: pipeline the transfer over this many groups of key/value heads (it must
        divide K): group g+1's K/V travel while group g's remote part computes, and group g's
        dK/dV return while group g+1's backward runs, so that only a G-th of the transfer waits
        on the local part. For transfers longer than the local part (many key/value heads,
        small chunks: ``experiments/attention_overlap_window.py``); it splits every remote
        kernel call G ways. 1 (the default): no pipeline. Ignored at R = 1 (no transfer).
      max_document_length: with ``segment_ids``, a bound the caller guarantees on the documents:
        none is longer than this many tokens (padding runs included). Then no query sees a key
        further than ``max_document_length - 1`` positions away, and the layer attends with that
        window added (on both sides, or the left with ``is_causal``), which is the same attention,
        so that the transfer moves only what the window reaches: the halo rows where the bound
        is at most a chunk (S/2R), not a gather of every rank's K/V. A longer document is not
        detected here: its queries lose the keys beyond the bound (check the input pipeline with
        ``jax_cpgrad.longest_document``; a longer padding run changes only the padding rows'
        outputs: with a loss that ignores padding, no gradient changes). None: no bound, the
        gather of all K/V.

    At R = 1 the layer is one attention call and no transfer. With documents or a window each
    rank's queries meet its own keys (the local part, beside the transfer) and the other ranks'
    keys (the remote part), each through one masked call; the remote part and the K/V transfer are
    left out where no query can see another rank's key (a window of (0, 0) in effect).

    Raises:
      ValueError: before anything runs, for mismatched shapes or dtypes, query heads that are not
        a multiple of the key heads, an odd local length, ``is_causal`` that is not a Python bool,
        ``segment_ids`` that are not an integer array ``[B, T]``, a ``local_window_size`` that is
        not None, an int >= 0 or a pair of them, a scale that is not a static number, an axis that
        is not bound (called outside ``shard_map``), a workspace that is closed, of another axis
        or too small, an unknown ``implementation``, ``implementation="cudnn"`` where cuDNN cannot
        run these inputs (or with documents, or a window it cannot take), ``head_groups`` that
        does not divide the key/value heads, or a ``max_document_length`` that is not an int >= 1
        or comes without ``segment_ids``.
    """
    return attention(
        query, key, value, axis_name=axis_name, workspace=workspace, scale=scale, is_causal=is_causal,
        segment_ids=segment_ids, local_window_size=local_window_size, implementation=implementation,
        head_groups=head_groups, max_document_length=max_document_length, transfer_when_alone=False,
    )  # fmt: skip


def attention(
    query,
    key,
    value,
    *,
    axis_name: str,
    transfer_when_alone: bool,
    workspace=None,
    scale: float | None = None,
    is_causal: bool = True,
    segment_ids=None,
    local_window_size=None,
    implementation: str | None = None,
    head_groups: int = 1,
    max_document_length: int | None = None,
):
    """:func:`dot_product_attention`, which is this with ``transfer_when_alone=False``. With True,
    at R = 1 plain causal attention takes the transfer's path anyway (two parts, K/V gathered from
    and dK/dV returned to the rank itself): for tests and benchmarks of the transport on one
    device. Masked calls have no remote part at R = 1 and ignore it."""
    options, words = prepare(
        query, key, value, scale=scale, is_causal=is_causal, segment_ids=segment_ids,
        local_window_size=local_window_size, implementation=implementation, head_groups=head_groups,
        max_document_length=max_document_length,
    )  # fmt: skip
    num_ranks = api.axis_size(axis_name, "dot_product_attention")
    spec = api.spec_of(workspace, "dot_product_attention")
    _check_workspace(spec, axis_name, num_ranks, key)
    rank = jax.lax.axis_index(axis_name).astype(jnp.int32)
    cfg = schedule_config(
        options, num_ranks, OnMeshAxis(axis_name, spec), transfer_when_alone=bool(transfer_when_alone)
    )
    return schedule.attention(cfg, query, key, value, rank, words)
