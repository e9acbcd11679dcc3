"""The halo exchange for sliding windows under CP: each rank gets only the neighbours' K/V rows
its window can reach, and the VJP returns their dK/dV to the owners.

In the load-balanced layout (rank r of R holds global chunks r and 2R-1-r of c = S/(2R) rows), a
window ``(left, right)`` with ``left < c`` and ``right < c`` (query p sees key k when
``p - k <= left`` and ``k - p <= right``; ``right = 0`` when causal) means chunk j needs only the
last ``left`` rows of chunk j-1 and the first ``right`` rows of chunk j+1. For rank r those are
four pieces (the slots):

- ``A``: the tail (``left`` rows) of chunk r-1, rank r-1's first chunk (none for r = 0);
- ``B``: the head (``right`` rows) of chunk r+1, rank r+1's first chunk (for r = R-1 the rank's
  own second chunk: padding);
- ``C``: the tail of chunk 2R-2-r, rank r+1's second chunk (for r = R-1 the rank's own first
  chunk: padding);
- ``D``: the head of chunk 2R-r, rank r-1's second chunk (none for r = 0).

**The row contract.** :func:`halo_exchange` returns a :class:`Halo`: ``rows`` (the halo of each
array, ``[B, L, ...]`` with ``L = 2 * (left + right)``, sequence on axis 1), ``positions``
(int32 ``[L]``: each row's GLOBAL position) and ``valid`` (bool ``[L]``). The rows are in slot
order ``[A | B | C | D]``, except on rank R-1, where they are ``[A | D | B | C]``. Either way:

- ``positions`` strictly increase along the rows, so ``masks.visibility(mask, q_pos,
  halo.positions)`` can be built directly from them;
- the real rows (``valid``) are exactly the other ranks' keys that some query of this rank can
  see under the window, each once: together with the rank's own rows every key is counted once;
- a padding row (``valid`` False: a chunk that does not exist, or the rank's own rows) holds
  zeros, sits at position ``PAD_LOW + i`` if it comes before every real row and ``PAD_HIGH + i``
  after (``i`` its row index), beyond the reach of any window with ``left, right < c``; it is
  never between two real rows. Only the window excludes it: causal alone does not (a key at
  ``PAD_LOW`` is earlier than every query), so pass the window, or use ``valid``. Cotangents of
  padding rows are dropped.

:func:`halo_positions` gives the same positions and validity in numpy, for a rank known at trace
time (tests, references); :func:`rank_positions` indexes its tables with a traced rank (the
layer's masks).

:func:`halo_return_overlapped` is the exchange's transpose as an op with work beside (the
layer's backward: the halo's dK/dV return beside the local backward), the same code as
``halo_exchange``'s VJP: the receive's transpose, the move back (``ppermute`` each way back, or
:func:`jax_cpgrad.grad_return_overlapped`), the owner's float32 sum.

**Transports.**

- XLA collectives (no workspace): two ``jax.lax.ppermute`` per array, one to each neighbour,
  moving only the halo rows: rank s sends ``[tail of its first chunk | head of its second]`` to
  s+1 and ``[head of its first chunk | tail of its second]`` to s-1, ``left + right`` rows each.
- Peer transport (a workspace): each rank's edge rows (``[tail | head]`` of each of its chunks,
  ``2 * (left + right)`` rows; its whole two chunks when ``left + right >= c``, where tail and
  head overlap) go to its two neighbours alone, through :func:`jax_cpgrad.all_gather` with a
  reach of 1 (``WorkspaceSpec.within``: the other ranks' chunks of the result are zeros, and no
  byte moves to or from them, though every rank still signals every other), and each rank takes
  the rows it needs. Its VJP is :func:`jax_cpgrad.grad_return` with the same reach (float32 sums
  in rank order over the neighbours, deterministic, CUDA-graph safe, a dead peer named after
  the timeout). Both neighbours get all four pieces where each needs two, so it moves 2x the
  bytes of the XLA path whatever R (:func:`halo_transfer_nbytes`); it never needs more
  workspace than the layer's ``attention_workspace_nbytes``.

**Gradients.** The VJP sends each halo row's cotangent back to its owner in the arrays' dtype
(a halo row's cotangent already is in that dtype, so a float32 move would carry the same values
in twice the bytes). The owner sums in float32 and rounds once: on the XLA transport it adds
the pieces' cotangents into its rows in a fixed order (a row gets two when it is both in its
chunk's tail and head, ``left + right > c``); on the peer transport ``grad_return`` sums the
ranks' contributions in rank order. autodiff then adds the result to the row's other cotangents
(e.g. the local attention's dK) in the arrays' dtype, as with any custom VJP.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import api
from . import per_rank
from .mesh_axes import varying_like
from .rounding import rounded

_NAME = "jax_cpgrad.halo_exchange"
# Padding rows' positions: beyond the reach of any window with left, right < c on a sequence of
# fewer than 2^28 tokens, inside masks' int32 clipping range (2^30).
PAD_LOW = -(1 << 29)
PAD_HIGH = 1 << 29
_MAX_SEQ = 1 << 28
TRANSPORTS = ("xla", "peer")


class Halo(NamedTuple):
    """What :func:`halo_exchange` returns: ``rows`` in the structure of its input (each
    ``[B, L, ...]``), ``positions`` (int32 ``[L]``, strictly increasing, global), ``valid``
    (bool ``[L]``). See the module docstring for the order."""

    rows: Any
    positions: jax.Array
    valid: jax.Array


def halo_length(left: int, right: int) -> int:
    """L, the number of halo rows a rank gets for a window ``(left, right)``."""
    return 2 * (left + right)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def check_window(left, right, chunk_len: int, where: str = _NAME) -> tuple[int, int]:
    """``(left, right)`` as ints, or ValueError naming the bad one: ints with 0 <= side < c."""
    for name, side in (("left", left), ("right", right)):
        if not _is_int(side):
            raise ValueError(f"{where}: {name} must be an int, got {side!r}")
        if not 0 <= side < chunk_len:
            raise ValueError(
                f"{where}: {name} must be >= 0 and smaller than the chunk length c = {chunk_len} "
                f"(S/(2R) rows), got {name}={side}; a window that reaches past the neighbouring "
                "chunk needs the all-gather path"
            )
    return int(left), int(right)


def _slots(rank: int, n: int, c: int, left: int, right: int):
    """[(global start, length, real)] of slots A, B, C, D for ``rank`` of ``n``."""
    return [
        ((rank - 1) * c + c - left, left, rank >= 1),  # A: tail of chunk r-1
        ((rank + 1) * c, right, rank <= n - 2),  # B: head of chunk r+1
        ((2 * n - 2 - rank) * c + c - left, left, rank <= n - 2),  # C: tail of chunk 2R-2-r
        ((2 * n - rank) * c, right, rank >= 1),  # D: head of chunk 2R-r
    ]


def _slot_order(rank: int, n: int) -> tuple[int, ...]:
    return (0, 3, 1, 2) if rank == n - 1 else (0, 1, 2, 3)


def halo_positions(rank: int, num_ranks: int, chunk_len: int, left: int, right: int):
    """numpy ``(positions int32 [L], valid bool [L])`` of rank ``rank``'s halo rows (the module
    docstring's contract)."""
    check_window(left, right, chunk_len, "halo_positions")
    slots = _slots(rank, num_ranks, chunk_len, left, right)
    pos: list[int | None] = []
    valid: list[bool] = []
    for s in _slot_order(rank, num_ranks):
        start, length, real = slots[s]
        pos.extend(range(start, start + length) if real else [None] * length)
        valid.extend([real] * length)
    first_real = next((i for i, v in enumerate(valid) if v), len(valid))
    out = [
        p if p is not None else (PAD_LOW + i if i < first_real else PAD_HIGH + i) for i, p in enumerate(pos)
    ]
    return np.asarray(out, np.int32), np.asarray(valid, bool)


def _position_tables(n: int, c: int, left: int, right: int):
    tables = [halo_positions(r, n, c, left, right) for r in range(n)]
    return np.stack([t[0] for t in tables]), np.stack([t[1] for t in tables])


# ---------------------------------------------------------------------------------------------
# The owner's side: its four pieces out, their cotangents summed back in float32.


def _pieces(x, c: int, left: int, right: int):
    """``[tail of first chunk | head of first | tail of second | head of second]`` of a local
    ``[B, 2c, ...]`` array, along axis 1."""
    return (x[:, c - left : c], x[:, :right], x[:, 2 * c - left :], x[:, c : c + right])


def _starts(c: int, left: int) -> tuple[int, int, int, int]:
    return (c - left, 0, 2 * c - left, c)


# The pieces' order in a packed array: per chunk ``[tail | head]`` for the all-gather (its chunk
# layout), ``[to the next rank | to the previous]`` for the two permutes.
GATHER_ORDER = (0, 1, 2, 3)
PERMUTE_ORDER = (0, 3, 1, 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _pack(x, c: int, left: int, right: int, order: tuple[int, ...]):
    """The four pieces in ``order``, concatenated along axis 1 (``2 * (left + right)`` rows)."""
    pieces = _pieces(x, c, left, right)
    return jnp.concatenate([pieces[i] for i in order], axis=1)


def _pack_fwd(x, c, left, right, order):
    return _pack(x, c, left, right, order), jax.ShapeDtypeStruct(x.shape, x.dtype)


def _pack_bwd(c, left, right, order, like, ct):
    """Each piece's cotangent added into its rows in float32, in piece order, rounded once."""
    sizes = [(left, right, left, right)[i] for i in order]
    offsets = np.cumsum([0, *sizes])
    at = {piece: (int(lo), size) for piece, lo, size in zip(order, offsets[:-1], sizes, strict=True)}
    acc = jnp.zeros(like.shape, jnp.float32)
    for piece, start in enumerate(_starts(c, left)):
        lo, size = at[piece]
        if size:
            pad = [(0, 0)] * ct.ndim
            pad[1] = (start, like.shape[1] - start - size)
            acc = acc + jnp.pad(ct[:, lo : lo + size].astype(jnp.float32), pad)
    return (rounded(acc, like.dtype),)


_pack.defvjp(_pack_fwd, _pack_bwd)


# ---------------------------------------------------------------------------------------------
# The receiving side: slots A-D in the rank's order, padding zeroed.


def _arrange(slots, rank, n: int):
    """``[A | B | C | D]``, or ``[A | D | B | C]`` on rank n-1."""
    a, b, c_, d = slots
    plain = jnp.concatenate((a, b, c_, d), axis=1)
    last = jnp.concatenate((a, d, b, c_), axis=1)
    return jnp.where(rank == n - 1, last, plain)


def _permute_pairs(n: int):
    """(to the next rank, to the previous): the two permutes' source-target pairs."""
    return [(s, s + 1) for s in range(n - 1)], [(s, s - 1) for s in range(1, n)]


def _split(x, sizes):
    offsets = np.cumsum((0,) + tuple(sizes))
    return tuple(x[:, int(lo) : int(hi)] for lo, hi in zip(offsets[:-1], offsets[1:], strict=True))


def gathered_rows_per_chunk(c: int, left: int, right: int) -> int:
    """Rows of each chunk the peer transport gathers: ``[tail | head]`` (``left + right``), or the
    whole chunk (``c``) when the two overlap, so a rank never sends more than its own rows."""
    return min(left + right, c)


def _gather_pack(x, c: int, left: int, right: int):
    """What the peer transport gathers of a local array: its two chunks' ``[tail | head]``, or
    the whole array when tails and heads overlap (left + right >= c)."""
    if left + right >= c:
        return x
    return _pack(x, c, left, right, GATHER_ORDER)


def _from_gathered(gathered, rank, n: int, c: int, left: int, right: int):
    """Peer transport: slots A-D taken from every rank's gathered rows (natural chunk order,
    ``w = gathered_rows_per_chunk`` rows a chunk: ``[tail | head]``, or the whole chunk)."""
    w = gathered_rows_per_chunk(c, left, right)
    tail_at, head_at = (0, left) if w == left + right else (c - left, 0)

    def take(chunk, offset, size, real):
        start = jnp.clip(chunk, 0, 2 * n - 1) * w + offset
        rows = jax.lax.dynamic_slice_in_dim(gathered, start, size, axis=1)
        return jnp.where(real, rows, jnp.zeros_like(rows))

    return (
        take(rank - 1, tail_at, left, rank >= 1),
        take(rank + 1, head_at, right, rank <= n - 2),
        take(2 * n - 2 - rank, tail_at, left, rank <= n - 2),
        take(2 * n - rank, head_at, right, rank >= 1),
    )


# ---------------------------------------------------------------------------------------------
# The public calls.


@dataclasses.dataclass(frozen=True)
class _Call:
    xs: tuple
    rebuild: Any
    n: int
    c: int
    left: int
    right: int
    spec: Any  # WorkspaceSpec or None


def _as_tuple(xs):
    if isinstance(xs, (tuple, list)):
        if not xs:
            raise ValueError(f"{_NAME}: got an empty {type(xs).__name__}")
        return tuple(xs), type(xs)
    return (xs,), lambda out: out[0]


def _prepare(xs, axis_name, left, right, workspace, op: str) -> _Call:
    arrays, rebuild = _as_tuple(xs)
    n = api.axis_size(axis_name, op)
    first = arrays[0]
    for i, x in enumerate(arrays):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"{_NAME}: argument {i} is not an array: {type(x).__name__}")
        if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in api.FLOAT_DTYPES]:
            raise ValueError(
                f"{_NAME}: argument {i} has dtype {x.dtype}; float32, bfloat16 and float16 are supported"
            )
        if x.shape != first.shape or x.dtype != first.dtype:
            raise ValueError(
                f"{_NAME}: all arrays must have the same shape and dtype: argument 0 is "
                f"{first.dtype}{list(first.shape)}, argument {i} is {x.dtype}{list(x.shape)}"
            )
    if first.ndim < 2 or first.shape[1] % 2 or first.shape[1] == 0:
        raise ValueError(
            f"{_NAME}: arrays must be [B, T, ...] with the rank's two chunks along axis 1 (T even, "
            f"> 0), got shape {list(first.shape)}"
        )
    c = first.shape[1] // 2
    if 2 * n * c >= _MAX_SEQ:
        raise ValueError(f"{_NAME}: the global sequence ({2 * n * c} rows) must be shorter than {_MAX_SEQ}")
    left, right = check_window(left, right, c)
    spec = api.spec_of(workspace, op)
    if spec is not None and n > 1:
        spec = spec.within(1)  # the neighbours' rows alone move
        rows = 2 * gathered_rows_per_chunk(c, left, right)
        needed = len(arrays) * first.shape[0] * rows * int(np.prod(first.shape[2:])) * first.dtype.itemsize
        if needed > spec.nbytes:
            raise ValueError(
                f"{_NAME}: this halo moves {needed} bytes per device through the all-gather but "
                f"workspace '{spec.name}' holds {spec.nbytes}; attention_workspace_nbytes(key) is enough"
            )
        spec.check_call(axis_name, n, needed, op)
    return _Call(arrays, rebuild, n, c, left, right, spec)


def rank_positions(rank, num_ranks: int, chunk_len: int, left: int, right: int):
    """int32 ``positions [L]`` and bool ``valid [L]`` of the halo rows of ``rank`` (an int or a
    traced int32): :func:`halo_positions`'s tables, indexed at run time. The layer's masks and
    :func:`halo_exchange` both take them from here."""
    pos_table, valid_table = _position_tables(num_ranks, chunk_len, left, right)
    return per_rank.row(pos_table, rank), per_rank.row(valid_table, rank)


# The exchange in three steps, shared by the forward and its transpose: ``_send`` (what a rank
# sends of one array: local, linear), the move (the collective), ``_receive`` (the rank's halo
# rows from what arrived: local, linear). The transpose runs the receive's transpose, the move's
# (``ppermute`` back, or ``grad_return``) and ``_pack``'s own VJP (the owner's float32 sum).


def _send(call: _Call, x):
    left, right = call.left, call.right
    if call.spec is None:  # [to the next rank | to the previous], left + right rows each
        packed = _pack(x, call.c, left, right, PERMUTE_ORDER)
        return packed[:, : left + right], packed[:, left + right :]
    return (_gather_pack(x, call.c, left, right),)


def _send_transpose(call: _Call, like, cts):
    """The owner's rows' cotangent ``[B, 2c, ...]`` from what it sent's, summed in float32."""
    if call.spec is None:
        return _pack_bwd(call.c, call.left, call.right, PERMUTE_ORDER, like, jnp.concatenate(cts, axis=1))[0]
    if call.left + call.right >= call.c:  # the whole array was sent
        return cts[0]
    return _pack_bwd(call.c, call.left, call.right, GATHER_ORDER, like, cts[0])[0]


def _receive(call: _Call, rank, moved):
    n, left, right = call.n, call.left, call.right
    if call.spec is None:  # (from the previous rank, from the next)
        a, d = _split(moved[0], (left, right))
        b, c_ = _split(moved[1], (right, left))
        slots = (a, b, c_, d)
    else:
        slots = _from_gathered(moved[0], rank, n, call.c, left, right)
    return _arrange(slots, rank, n)


def _permute(call: _Call, axis_name: str, sent, transpose: bool = False):
    """XLA transport: the two permutes (``transpose``: each back the way it came)."""
    up, down = _permute_pairs(call.n)
    first, second = (down, up) if transpose else (up, down)
    return jax.lax.ppermute(sent[0], axis_name, first), jax.lax.ppermute(sent[1], axis_name, second)


def _rank(axis_name: str):
    return jax.lax.axis_index(axis_name).astype(jnp.int32)


def _run(call: _Call, axis_name: str, fn, args):
    """(Halo, fn(*args)), fn beside the transfer where the transport can place it."""
    n, c, left, right = call.n, call.c, call.left, call.right
    length = halo_length(left, right)
    rank = _rank(axis_name)
    positions, valid = rank_positions(rank, n, c, left, right)
    if length == 0 or n == 1:  # nothing to move: every row is padding
        shape = lambda x: x.shape[:1] + (length,) + x.shape[2:]
        rows = tuple(jnp.zeros(shape(x), x.dtype) for x in call.xs)
        return Halo(call.rebuild(rows), positions, valid), fn(*args)
    sent = [_send(call, x) for x in call.xs]
    if call.spec is None:
        y = fn(*args)  # XLA schedules its collective-permutes asynchronously around this
        moved = [_permute(call, axis_name, s) for s in sent]
    else:
        gathered, y = api.all_gather_overlapped(
            tuple(s[0] for s in sent), fn, *args, axis_name=axis_name, seq_axis=1, workspace=call.spec
        )
        moved = [(g,) for g in gathered]
    rows = tuple(_receive(call, rank, m) for m in moved)
    return Halo(call.rebuild(rows), positions, valid), y


def _run_transpose(call: _Call, axis_name: str, cts, fn, args):
    """(the owners' cotangents of ``call.xs`` from the halo rows' ``cts``, fn(*args)): the
    transpose of :func:`_run`'s exchange, fn beside the move back."""
    n, left, right = call.n, call.left, call.right
    if halo_length(left, right) == 0 or n == 1:
        return tuple(jnp.zeros(x.shape, x.dtype) for x in call.xs), fn(*args)
    rank = _rank(axis_name)
    like = jax.ShapeDtypeStruct(call.xs[0].shape, call.xs[0].dtype)
    # the receive's transpose: its VJP at zeros of what arrived (it is linear; the zeros' own
    # receive is dead code). The zeros vary over the axes the cotangents do, as what arrived
    # does: the VJP of a value that does not would sum its cotangent over the axis.
    moved_like = jax.eval_shape(lambda x: _permute_shapes(call, _send(call, x)), like)
    zeros = varying_like([jnp.zeros(m.shape, m.dtype) for m in moved_like], cts)
    _, receive_t = jax.vjp(lambda m: _receive(call, rank, m), zeros)
    ct_moved = [receive_t(ct)[0] for ct in cts]
    if call.spec is None:
        y = fn(*args)  # XLA schedules its collective-permutes asynchronously around this
        ct_sent = [_permute(call, axis_name, m, transpose=True) for m in ct_moved]
    else:
        back, y = api.grad_return_overlapped(
            tuple(m[0] for m in ct_moved), fn, *args, axis_name=axis_name, seq_axis=1, workspace=call.spec
        )
        ct_sent = [(b,) for b in back]
    return tuple(_send_transpose(call, like, s) for s in ct_sent), y


def _permute_shapes(call: _Call, sent):
    """What arrives for what is sent: the same shapes on the XLA transport; the gathered rows of
    every rank (natural chunk order) on the peer transport."""
    if call.spec is None:
        return sent
    (x,) = sent
    return (jnp.zeros((x.shape[0], x.shape[1] * call.n, *x.shape[2:]), x.dtype),)


def halo_exchange(xs, *, axis_name: str, left: int, right: int, workspace=None) -> Halo:
    """The halo rows of a window ``(left, right)`` for this rank, inside ``jax.shard_map``.

    ``xs``: one array or a tuple/list of same-shape arrays such as ``(k, v)``, each the rank's
    local ``[B, T, ...]`` (chunks r and 2R-1-r along axis 1, T = 2c), float32, bfloat16 or
    float16. ``left`` and ``right``: ints in ``[0, c)`` (``right = 0`` for causal windows).
    Returns a :class:`Halo`: ``rows`` in the structure of ``xs``, each ``[B, 2 * (left + right),
    ...]``, ``positions`` and ``valid`` as the module docstring specifies. Differentiable: the
    VJP returns each halo row's cotangent to its owner, which adds it into its rows in float32.

    ``workspace``: None for XLA collectives (``ppermute`` of the halo rows only), or a
    ``Workspace`` (peer transport: an :func:`jax_cpgrad.all_gather` of each rank's
    ``2 * min(left + right, c)`` edge rows to its two neighbours alone, 2x the ideal bytes).
    Raises ValueError for bad windows, shapes, dtypes, an unbound axis, or a workspace that is
    closed, of another axis, or too small.
    """
    call = _prepare(xs, axis_name, left, right, workspace, "halo_exchange")
    halo, _ = _run(call, axis_name, lambda: None, ())
    return halo


def halo_exchange_overlapped(
    xs, fn, *args, axis_name: str, left: int, right: int, workspace=None
) -> tuple[Halo, Any]:
    """``(halo_exchange(xs, ...), fn(*args))``, with ``fn``'s work run while the halo travels.

    With a workspace made with ``overlap=True`` this is :func:`jax_cpgrad.all_gather_overlapped`
    (``fn`` between the start and the done; in the backward pass ``fn``'s VJP beside the
    ``grad_return``). With XLA collectives XLA's scheduler places the permutes around ``fn``.
    ``fn`` must not need the halo.
    """
    if not callable(fn):
        raise ValueError(f"{_NAME}_overlapped: fn must be callable, got {type(fn).__name__}")
    call = _prepare(xs, axis_name, left, right, workspace, "halo_exchange_overlapped")
    return _run(call, axis_name, fn, args)


def halo_return_overlapped(
    grads, fn, *args, axis_name: str, left: int, right: int, chunk_len: int, workspace=None
) -> tuple[Any, Any]:
    """``(the owners' gradients, fn(*args))``: the transpose of :func:`halo_exchange`, the halo
    rows' cotangents sent back to their owners, with ``fn``'s work run while they travel. The
    same code as ``halo_exchange``'s VJP (which is this with no work beside).

    ``grads``: one array or a tuple/list of same-shape arrays ``[B, 2 * (left + right), ...]``,
    cotangents of :class:`Halo` rows in its order (padding rows' are dropped); ``chunk_len``: c,
    the owners' arrays being ``[B, 2c, ...]``. Returns the owners' gradients in the structure of
    ``grads``, each ``[B, 2c, ...]`` in its dtype: on the XLA transport each row's returned
    cotangents added in float32 and rounded once; on the peer transport
    :func:`jax_cpgrad.grad_return_overlapped` (float32 sums in rank order), ``fn`` between its
    start and done with a workspace made with ``overlap=True``. ``fn`` must not need the result.
    """
    if not callable(fn):
        raise ValueError(f"jax_cpgrad.halo_return_overlapped: fn must be callable, got {type(fn).__name__}")
    arrays, rebuild = _as_tuple(grads)
    if not _is_int(chunk_len) or chunk_len < 1:
        raise ValueError(
            f"jax_cpgrad.halo_return_overlapped: chunk_len must be an int >= 1, got {chunk_len!r}"
        )
    first = arrays[0]
    if not hasattr(first, "shape") or first.ndim < 2:
        raise ValueError("jax_cpgrad.halo_return_overlapped: grads must be arrays [B, L, ...]")
    like = [jax.ShapeDtypeStruct((g.shape[0], 2 * chunk_len, *g.shape[2:]), g.dtype) for g in arrays]
    call = _prepare(tuple(like), axis_name, left, right, workspace, "halo_return_overlapped")
    length = halo_length(call.left, call.right)
    for i, g in enumerate(arrays):
        if g.shape[1] != length or g.shape != first.shape or g.dtype != first.dtype:
            raise ValueError(
                f"jax_cpgrad.halo_return_overlapped: grads must share one shape [B, L = 2 * (left + "
                f"right) = {length}, ...] and dtype; argument {i} is {g.dtype}{list(g.shape)}"
            )
    back, y = _run_transpose(call, axis_name, arrays, fn, args)
    return rebuild(back), y


class HaloBytes(NamedTuple):
    """Bytes one rank sends (and receives) per direction: in the forward pass for K and V, and
    the same again in the backward pass for dK and dV. ``halo``: the halo exchange on the given
    transport (an interior rank; ranks 0 and R-1 send half on the XLA transport); ``all_gather``:
    the all-gather of all K/V it replaces, ``(R-1)/R x 2 x B x S x K x H x itemsize``."""

    halo: int
    all_gather: int


def halo_transfer_nbytes(
    batch: int,
    seq: int,
    num_ranks: int,
    kv_heads: int,
    head_dim: int,
    itemsize: int,
    left: int,
    right: int,
    transport: str,
) -> HaloBytes:
    """Bytes per rank per direction of the halo exchange of K and V, and of the all-gather it
    replaces (:class:`HaloBytes`). ``transport``: ``"xla"`` (ppermute to the two neighbours:
    ``2 x B x 2(left + right) x K x H x itemsize``) or ``"peer"`` (the rank's edge rows to each
    of its neighbours, two but for R = 2: ``min(R-1, 2) x 2 x B x 2 min(left + right, c) x K x H x
    itemsize``, 2x the XLA figure while ``left + right <= c``)."""
    sizes = dict(batch=batch, seq=seq, num_ranks=num_ranks, kv_heads=kv_heads, head_dim=head_dim)
    for name, value in {**sizes, "itemsize": itemsize}.items():
        if not _is_int(value) or value < 1:
            raise ValueError(f"halo_transfer_nbytes: {name} must be an int >= 1, got {value!r}")
    if transport not in TRANSPORTS:
        raise ValueError(f"halo_transfer_nbytes: transport must be one of {TRANSPORTS}, got {transport!r}")
    if seq % (2 * num_ranks):
        raise ValueError(f"halo_transfer_nbytes: seq ({seq}) must be a multiple of 2 x num_ranks")
    left, right = check_window(left, right, seq // (2 * num_ranks), "halo_transfer_nbytes")
    row = batch * kv_heads * head_dim * itemsize
    r = num_ranks
    if r == 1:
        halo = 0
    elif transport == "xla":
        halo = 2 * halo_length(left, right) * row  # K and V, left + right rows to each neighbour
    else:  # K and V, the rank's gathered rows to each neighbour
        halo = min(r - 1, 2) * 2 * 2 * gathered_rows_per_chunk(seq // (2 * r), left, right) * row
    return HaloBytes(halo=halo, all_gather=(r - 1) * 2 * (seq // r) * row)
