"""The public, differentiable API: ``grad_return`` and ``all_gather``, each the other's VJP."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import peer_transport
from ._native import MAX_TENSORS
from .layout import chunk_geometry, normalize_seq_axis
from .peer_transport import all_gather_peer, grad_return_peer
from .spec import WorkspaceSpec
from .xla_transport import all_gather_xla, grad_return_xla

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _as_tuple(arrays, op: str):
    """(tuple of arrays, function that rebuilds the caller's structure)."""
    if isinstance(arrays, (tuple, list)):
        xs = tuple(arrays)
        if not xs:
            raise ValueError(f"jax_cpgrad.{op}: got an empty {type(arrays).__name__}")
        return xs, type(arrays)
    return (arrays,), lambda out: out[0]


def axis_size(axis_name: str, op: str) -> int:
    """The size of the bound mesh axis ``axis_name``; ValueError (naming ``op``) outside shard_map."""
    try:
        return int(jax.lax.axis_size(axis_name))
    except (NameError, KeyError, ValueError) as err:
        raise ValueError(
            f"jax_cpgrad.{op}: axis name {axis_name!r} is not bound here; call it inside "
            f"jax.shard_map over a mesh that has the axis {axis_name!r}"
        ) from err


def _validate(xs: tuple, seq_axis: int, num_ranks: int, op: str, *, global_: bool) -> int:
    """Check the arrays of one call; return the non-negative sequence axis."""
    if len(xs) > MAX_TENSORS:
        raise ValueError(f"jax_cpgrad.{op}: at most {MAX_TENSORS} arrays per call, got {len(xs)}")
    first = xs[0]
    for i, x in enumerate(xs):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"jax_cpgrad.{op}: argument {i} is not an array: {type(x).__name__}")
        if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
            raise ValueError(
                f"jax_cpgrad.{op}: argument {i} has dtype {x.dtype}; "
                "float32, bfloat16 and float16 are supported"
            )
        if x.shape != first.shape or x.dtype != first.dtype:
            raise ValueError(
                f"jax_cpgrad.{op}: all arrays of one call must have the same shape and "
                f"dtype: argument 0 is {first.dtype}{list(first.shape)}, argument {i} is "
                f"{x.dtype}{list(x.shape)}"
            )
    seq = normalize_seq_axis(seq_axis, first.ndim)
    try:
        chunk_geometry(first.shape, seq, num_ranks, global_=global_)
    except ValueError as err:
        raise ValueError(f"jax_cpgrad.{op}: {err}") from None
    return seq


def _local_nbytes(xs: tuple, num_ranks: int, global_: bool) -> int:
    """Bytes one call moves per device, counted in local shapes (what a workspace slot holds)."""
    per = xs[0].dtype.itemsize * int(np.prod(xs[0].shape))
    return len(xs) * (per // num_ranks if global_ else per)


def spec_of(workspace, op: str) -> WorkspaceSpec | None:
    """The workspace's description (None: the XLA transport); ValueError for a closed one."""
    if workspace is None or isinstance(workspace, WorkspaceSpec):
        return workspace
    if workspace.closed:
        raise ValueError(f"jax_cpgrad.{op}: workspace '{workspace.name}' is closed")
    return workspace.spec


def _prepare(arrays, axis_name, seq_axis, workspace, op: str, *, global_: bool):
    """Every trace-time check of one call: (tuple of arrays, rebuild, non-negative seq axis, R,
    workspace spec or None)."""
    xs, rebuild = _as_tuple(arrays, op)
    num_ranks = axis_size(axis_name, op)
    seq = _validate(xs, seq_axis, num_ranks, op, global_=global_)
    spec = spec_of(workspace, op)
    if spec is not None:
        spec.check_call(axis_name, num_ranks, _local_nbytes(xs, num_ranks, global_), op)
    return xs, rebuild, seq, num_ranks, spec


# The two transports behind one differentiable pair. `spec` None means the XLA transport.


def _grad_return_impl(xs, axis_name, seq, spec):
    num_ranks = jax.lax.axis_size(axis_name)
    if spec is None:
        return tuple(grad_return_xla(x, axis_name, seq, num_ranks) for x in xs)
    return grad_return_peer(xs, seq, num_ranks, spec)


def _all_gather_impl(xs, axis_name, seq, spec):
    num_ranks = jax.lax.axis_size(axis_name)
    if spec is None:
        return tuple(all_gather_xla(x, axis_name, seq, num_ranks) for x in xs)
    return all_gather_peer(xs, seq, num_ranks, spec)


def _linear_pair(forward, transpose):
    """A custom-VJP op whose cotangent map is `transpose` (the two ops are each other's transpose)."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
    def op(xs, axis_name, seq, spec):
        return forward(xs, axis_name, seq, spec)

    def fwd(xs, axis_name, seq, spec):
        return forward(xs, axis_name, seq, spec), None

    def bwd(axis_name, seq, spec, _, cts):
        return (transpose(tuple(cts), axis_name, seq, spec),)

    op.defvjp(fwd, bwd)
    return op


_grad_return = _linear_pair(_grad_return_impl, _all_gather_impl)
_all_gather = _linear_pair(_all_gather_impl, _grad_return_impl)


# Work placed beside a call in flight (overlap=True): a custom-VJP op over (the call's arrays,
# the work's inputs) whose backward places the work's VJP beside the transposed call.


def _overlapped_pair(op: str, transpose_op: str):
    @functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
    def run(fn, axis_name, seq, spec, xs, args):
        num_ranks = jax.lax.axis_size(axis_name)
        outs, y, _ = peer_transport.beside(op, xs, seq, num_ranks, spec, lambda a: (fn(*a), None), args)
        return outs, y

    def fwd(fn, axis_name, seq, spec, xs, args):
        num_ranks = jax.lax.axis_size(axis_name)
        outs, y, fn_vjp = peer_transport.beside(op, xs, seq, num_ranks, spec, lambda a: jax.vjp(fn, *a), args)
        return (outs, y), fn_vjp

    def bwd(fn, axis_name, seq, spec, fn_vjp, cts):
        num_ranks = jax.lax.axis_size(axis_name)
        ct_outs, ct_y = cts
        ct_xs, ct_args, _ = peer_transport.beside(
            transpose_op, tuple(ct_outs), seq, num_ranks, spec, lambda c: (fn_vjp(c), None), ct_y
        )
        return ct_xs, ct_args

    run.defvjp(fwd, bwd)
    return run


_OVERLAPPED = {
    "grad_return": (_grad_return, _overlapped_pair("grad_return", "all_gather")),
    "all_gather": (_all_gather, _overlapped_pair("all_gather", "grad_return")),
}


def _with_work_beside(op: str, arrays, fn, args, axis_name, seq_axis, workspace, *, global_: bool):
    """(op's result, fn(*args)), fn's work placed while the call is in flight where that can be."""
    if not callable(fn):
        raise ValueError(f"jax_cpgrad.{op}_overlapped: fn must be callable, got {type(fn).__name__}")
    xs, rebuild, seq, _, spec = _prepare(
        arrays, axis_name, seq_axis, workspace, f"{op}_overlapped", global_=global_
    )
    plain, overlapped = _OVERLAPPED[op]
    if spec is None or not spec.overlap:
        # XLA's collectives are asynchronous already (XLA schedules around them); a workspace
        # without overlap=True runs each call on XLA's stream, where nothing can run beside it.
        return rebuild(plain(xs, axis_name, seq, spec)), fn(*args)
    # Values fn closes over become explicit inputs, so that they get their cotangents.
    closed, consts = jax.closure_convert(fn, *args)
    outs, y = overlapped(closed, axis_name, seq, spec, xs, (*args, *consts))
    return rebuild(outs), y


def grad_return_overlapped(grads, fn, *args, axis_name: str, seq_axis: int = 1, workspace=None):
    """``(grad_return(grads, ...), fn(*args))``, with ``fn``'s work run while the return is in flight.

    With a workspace created with ``overlap=True`` the return runs on the workspace's own stream
    and ``fn(*args)`` on XLA's, between the call's start and its done (placed there by data
    dependencies), so the two overlap; in the backward pass ``fn``'s VJP runs beside the
    transposed call (an ``all_gather``) the same way. ``fn`` must not need the return's result.
    With the XLA transport, or a workspace without ``overlap=True``, it is the plain pair of
    calls (XLA schedules its own collectives asynchronously). Values ``fn`` closes over are
    differentiated like ``args``.
    """
    return _with_work_beside("grad_return", grads, fn, args, axis_name, seq_axis, workspace, global_=True)


def all_gather_overlapped(xs, fn, *args, axis_name: str, seq_axis: int = 1, workspace=None):
    """``(all_gather(xs, ...), fn(*args))``, with ``fn``'s work run while the gather is in flight.

    The forward pass of all-gather CP attention can compute the query projection while K and V
    travel: ``(k_all, v_all), q = all_gather_overlapped((k, v), project_q, h, ...)``; its backward
    then returns dK/dV (``grad_return``) while the query projection's VJP runs. See
    :func:`grad_return_overlapped` for when the two really overlap.
    """
    return _with_work_beside("all_gather", xs, fn, args, axis_name, seq_axis, workspace, global_=False)


def grad_return(grads, *, axis_name: str, seq_axis: int = 1, workspace=None):
    """Return context-parallel gradients to their owner ranks.

    Inside ``jax.shard_map`` over ``axis_name`` (R devices), each rank passes gradients for the
    *whole* global sequence (natural order, length S along ``seq_axis``): one array, or a
    tuple/list of same-shape arrays such as ``(dk, dv)``. Each rank gets back the same structure
    with local length S/R along ``seq_axis``: the sum over all ranks of global chunks
    ``(r, 2R-1-r)`` for its rank r, the load-balanced CP layout.

    With ``workspace`` (a :class:`jax_cpgrad.Workspace` for this mesh axis) the sum runs over the
    peer transport on the GPUs, in float32 in rank order, rounded once: deterministic, bitwise
    equal to :func:`jax_cpgrad.grad_return_reference`. Without one it runs over XLA collectives
    (reorder + ``psum_scatter``). Differentiable: its VJP is :func:`all_gather`.
    """
    xs, rebuild, seq, _, spec = _prepare(grads, axis_name, seq_axis, workspace, "grad_return", global_=True)
    return rebuild(_grad_return(xs, axis_name, seq, spec))


def all_gather(xs, *, axis_name: str, seq_axis: int = 1, workspace=None):
    """Gather CP-layout local shards into natural-order global arrays on every rank.

    The inverse layout of :func:`grad_return` (the forward pass of all-gather CP attention):
    each rank passes its local shard(s) of length S/R along ``seq_axis`` (chunks r and 2R-1-r)
    and gets the whole sequence, length S, in natural order. Differentiable: its VJP is
    :func:`grad_return` on the same transport.
    """
    arrays, rebuild, seq, _, spec = _prepare(xs, axis_name, seq_axis, workspace, "all_gather", global_=False)
    return rebuild(_all_gather(arrays, axis_name, seq, spec))


def grad_return_reference(grads, *, axis_name: str, seq_axis: int = 1):
    """:func:`grad_return`'s exact result (float32 sum in rank order) with XLA collectives.

    Not differentiable through a custom rule and slower (an all-to-all plus R adds); meant as
    the oracle that the peer transport must match bit for bit.
    """
    from .xla_transport import grad_return_reference as reference

    xs, rebuild, seq, num_ranks, _ = _prepare(
        grads, axis_name, seq_axis, None, "grad_return_reference", global_=True
    )
    return rebuild(tuple(reference(x, axis_name, seq, num_ranks) for x in xs))
