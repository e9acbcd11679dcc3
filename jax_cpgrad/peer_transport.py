"""The peer transport: the CUDA FFI handlers, called on one of XLA's streams inside ``shard_map``.

A workspace made with ``overlap=True`` takes every call as a pair of custom calls (see
``ffi/call_stream.h``): the start enqueues the whole call on the workspace's own stream, writing
its results; the done makes XLA's stream wait for it. The done takes the start's results and
inputs, so that XLA keeps them alive until then, and returns a token; the results go on only through a barrier
with that token, so nothing reads them earlier. Whatever XLA runs between the two runs beside the
transfer. :func:`beside` places given work there by data dependencies alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .spec import WorkspaceSpec


def _result_type(x, shape):
    """x's type (dtype, mesh and varying axes, or gradients come out wrong) with a new shape."""
    return jax.typeof(x).update(shape=tuple(shape))


def _out_len(op: str, xs: tuple, seq_axis: int, num_ranks: int) -> int:
    length = xs[0].shape[seq_axis]
    return length // num_ranks if op == "grad_return" else length * num_ranks


def _ffi_call(
    target: str, side_effect: bool, operands: tuple, results: tuple, num_ranks, seq_axis, spec, **kw
):
    call = jax.ffi.ffi_call(
        target,
        results,
        has_side_effect=side_effect,
        # vmap adds leading axes; the handler counts seq_axis from the back, so it still holds.
        vmap_method="broadcast_all",
        **kw,
    )
    return tuple(
        call(
            *operands,
            workspace_id=np.int64(spec.id),
            axis_size=np.int64(num_ranks),
            seq_axis_from_end=np.int64(operands[0].ndim - seq_axis),
            reach=np.int64(spec.reach),
        )
    )


def _op_call(
    target: tuple[str, bool], op: str, xs: tuple, seq_axis: int, num_ranks: int, spec: WorkspaceSpec
):
    """A whole call or a start: ``target`` (name, has_side_effect) on ``xs``, op's result shapes."""
    out_shape = (
        xs[0].shape[:seq_axis] + (_out_len(op, xs, seq_axis, num_ranks),) + xs[0].shape[seq_axis + 1 :]
    )
    results = tuple(_result_type(x, out_shape) for x in xs)
    return _ffi_call(*target, xs, results, num_ranks, seq_axis, spec)


def operands(xs: tuple) -> tuple:
    """A call's arrays as its custom calls take them: behind a barrier, so that none is a slice
    to XLA. XLA's GPU compiler may wrap a custom call whose operand is a slice in a fusion that
    reads the slice in place, and jax 0.11.2's keeps the original call too when it has side
    effects, as ours all do: the call would run twice, a start without its done."""
    return tuple(jax.lax.optimization_barrier(tuple(xs)))


def start(op: str, xs: tuple, seq_axis: int, num_ranks: int, spec: WorkspaceSpec) -> tuple:
    """The start of an overlapped call: its results, not to be read before :func:`done`."""
    return _op_call(spec.start_target(op), op, xs, seq_axis, num_ranks, spec)


def done(pending: tuple, xs: tuple, seq_axis: int, num_ranks: int, spec: WorkspaceSpec) -> tuple:
    """The results of the call that :func:`start` began on ``xs``: ``pending``, released by the
    done's token. (The done does not return the results itself, aliased or copied: XLA places a
    custom call's results where it likes, e.g. straight into a scan's stacked output, and would
    copy aliased ones there before the done, unfinished; a copy would cost an HBM pass.)"""
    token_type = jax.typeof(xs[0]).update(shape=(1,), dtype=jnp.int32)
    # The start's results as operands place the done after whatever they were tied to (the work
    # beside); it does not read them. Side effects: XLA must never drop the done, or the
    # workspace's stream could still write the results after XLA has reused their memory.
    (token,) = _ffi_call(spec.done_target, True, (*pending, *xs), (token_type,), num_ranks, seq_axis, spec)
    results, _ = jax.lax.optimization_barrier((pending, token))
    return tuple(results)


def _tieable(leaf) -> bool:
    return hasattr(leaf, "dtype") and leaf.dtype != jax.dtypes.float0


def tie(pending: tuple, values):
    """(pending, values), each available only once both are: an order XLA must keep."""
    leaves, tree = jax.tree.flatten(values)
    picked = [i for i, leaf in enumerate(leaves) if _tieable(leaf)]
    pending, chosen = jax.lax.optimization_barrier((pending, [leaves[i] for i in picked]))
    for i, leaf in zip(picked, chosen, strict=True):
        leaves[i] = leaf
    return pending, jax.tree.unflatten(tree, leaves)


def beside(op: str, xs: tuple, seq_axis: int, num_ranks: int, spec: WorkspaceSpec, work, inputs):
    """op's results, and ``work(inputs)`` run while the call is in flight (overlap=True).

    ``work`` returns (value, extra): the done waits for ``value`` (so the work is placed between
    start and done), and ``value`` comes back through the same tie: XLA drops a barrier's
    outputs that nothing uses, and with them the order. ``extra`` passes through (e.g. a VJP
    function).
    """
    xs = operands(xs)  # the start and the done take the same buffers
    pending = start(op, xs, seq_axis, num_ranks, spec)
    pending, inputs = tie(pending, inputs)  # the work cannot begin before the start
    value, extra = work(inputs)
    pending, value = tie(pending, value)  # nor the done come before the work
    return done(pending, xs, seq_axis, num_ranks, spec), value, extra


def _call(op: str, xs: tuple, seq_axis: int, num_ranks: int, spec: WorkspaceSpec):
    if spec.overlap:  # a pair with nothing between: the call stays on the workspace's stream
        return beside(op, xs, seq_axis, num_ranks, spec, lambda _: ((), None), ())[0]
    return _op_call(spec.target(op), op, operands(xs), seq_axis, num_ranks, spec)


def grad_return_peer(xs: tuple, seq_axis: int, num_ranks: int, spec: WorkspaceSpec):
    return _call("grad_return", xs, seq_axis, num_ranks, spec)


def all_gather_peer(xs: tuple, seq_axis: int, num_ranks: int, spec: WorkspaceSpec):
    return _call("all_gather", xs, seq_axis, num_ranks, spec)
