"""A rank of the layer without transfers: its real shapes and kernel calls on one device, a local
copy in place of every transfer. To measure a rank's attention work (benchmarks/attention.py,
benchmarks/cp_step.py's ``none`` transport); not for training: the gathered keys are copies of the
rank's own, not the other ranks'. With documents across ranks, pass the whole sequence's segment
ids (``sequence_segment_ids``): the work of a masked call follows the ids it sees, and copies of
the rank's own would put the documents' edges elsewhere."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from ..layout import to_cp_layout
from . import layer, per_rank, schedule
from .halo import halo_length
from .plan import id_words


@dataclasses.dataclass(frozen=True, eq=False)
class _Constant:
    """A numpy array as a hashable constant (the stand-in is static configuration)."""

    value: np.ndarray

    @property
    def key(self):
        return self.value.shape, self.value.dtype.str, self.value.tobytes()

    def __eq__(self, other):
        return isinstance(other, _Constant) and self.key == other.key

    def __hash__(self):
        return hash(self.key)


@dataclasses.dataclass(frozen=True)
class NoTransfer:
    """A rank of ``num_ranks`` alone: the gathered arrays are ``num_ranks`` copies of the local
    ones, and the returned gradients are their first S/R rows (the shape a rank gets back, not its
    chunks). Both sides are materialized behind a barrier, as a transport writes and reads them:
    the gathered arrays are one copy of their own (``benchmarks/attention.py`` times it alone and
    takes it off a rank's time), which XLA would otherwise fuse into whatever reads them (a copy
    of the other ranks' chunks would then read the local arrays, and cost less than a real rank's,
    which reads the transfer's buffer, while a call that reads the gathered arrays in place would
    pay the whole stand-in); the whole gradients are computed (without the barrier XLA would
    compute only the rows kept, and the timing would miss work a real rank does). The gathered
    segment ids are ``gathered_ids`` (the whole sequence's, natural order, as words) where given,
    else copies of the rank's own."""

    num_ranks: int
    gathered_ids: _Constant | None = None
    # a wide window gathers all K/V, as on the peer transport (the GPU's)
    moves_window_chunks: ClassVar[bool] = False

    def gather(self, xs, fn, *args):
        gathered = tuple(jnp.concatenate([x] * self.num_ranks, axis=1) for x in xs)
        return jax.lax.optimization_barrier(gathered), fn(*args)

    def near(self, reach: int) -> NoTransfer:
        return self  # the same shapes, and the copies stand in for any rows

    def return_grads(self, grads, fn, *args):
        grads = jax.lax.optimization_barrier(tuple(grads))
        return tuple(g[:, : g.shape[1] // self.num_ranks] for g in grads), fn(*args)

    @classmethod
    def with_sequence_ids(cls, num_ranks: int, sequence_ids) -> NoTransfer:
        """The stand-in whose gathered ids are those of ``sequence_ids`` (the whole sequence's,
        natural order ``[B, S]``, concrete): what a rank's real gather brings (the whole
        sequence in natural order, as ``all_gather`` returns it)."""
        with jax.ensure_compile_time_eval():  # a constant, also when called under jit
            words = per_rank.shared(id_words(np.asarray(sequence_ids)))
        return cls(num_ranks, _Constant(words))

    def gather_ids(self, words):
        if self.gathered_ids is not None:
            return jnp.asarray(self.gathered_ids.value)
        return jnp.concatenate([words] * self.num_ranks, axis=1)

    def halo(self, xs, window, fn, *args):
        """The halo's shapes, ``[B, 2 * (left + right), ...]``: the local rows, repeated."""
        return tuple(_rows(x, halo_length(*window)) for x in xs), fn(*args)

    def return_halo(self, grads, window, chunk_len, fn, *args):
        grads = jax.lax.optimization_barrier(tuple(grads))
        return tuple(_rows(g, 2 * chunk_len) for g in grads), fn(*args)


def _rows(x, length: int):
    """``length`` rows along axis 1 of ``x`` repeated as often as needed."""
    copies = -(-length // x.shape[1])
    return jnp.concatenate([x] * copies, axis=1)[:, :length]


def rank_without_transfer(
    query,
    key,
    value,
    rank,
    num_ranks: int,
    *,
    is_causal: bool = True,
    scale: float | None = None,
    segment_ids=None,
    sequence_segment_ids=None,
    local_window_size=None,
    implementation=None,
    head_groups: int = 1,
    max_document_length: int | None = None,
):
    """The layer's computation for rank ``rank`` of ``num_ranks``, alone: real shapes, a local copy
    in place of every transfer (see the module). Options as :func:`dot_product_attention`'s.

    ``sequence_segment_ids``: instead of ``segment_ids``, the whole sequence's ids ``[B, S]`` in
    natural order, a concrete (numpy) array: the rank's own are taken from it (``rank`` may be
    traced), and the gathered ids are the real ones."""
    if not (isinstance(num_ranks, int) and num_ranks >= 1):
        raise ValueError(f"rank_without_transfer: num_ranks must be an int >= 1, got {num_ranks!r}")
    if isinstance(rank, int) and not 0 <= rank < num_ranks:
        raise ValueError(f"rank_without_transfer: rank must be in [0, {num_ranks}), got {rank}")
    rank = jnp.asarray(rank, jnp.int32)
    stand_in = NoTransfer(num_ranks)
    if sequence_segment_ids is not None:
        segment_ids, stand_in = _rank_ids_and_stand_in(
            sequence_segment_ids, segment_ids, query, rank, num_ranks
        )
    options, words = layer.prepare(
        query, key, value, scale=scale, is_causal=is_causal, segment_ids=segment_ids,
        local_window_size=local_window_size, implementation=implementation, head_groups=head_groups,
        max_document_length=max_document_length,
    )  # fmt: skip
    cfg = layer.schedule_config(options, num_ranks, stand_in, transfer_when_alone=False)
    return schedule.attention(cfg, query, key, value, rank, words)


def _rank_ids_and_stand_in(sequence_ids, segment_ids, query, rank, num_ranks: int):
    """(the rank's ids [B, T], sliced at the possibly traced rank; the stand-in gathering all)."""
    name = "rank_without_transfer"
    if segment_ids is not None:
        raise ValueError(f"{name}: pass segment_ids or sequence_segment_ids, not both")
    if isinstance(sequence_ids, jax.core.Tracer):
        raise ValueError(f"{name}: sequence_segment_ids must be a concrete array (numpy), not traced")
    ids = np.asarray(sequence_ids)
    b, t = query.shape[:2]
    if ids.shape != (b, num_ranks * t) or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(
            f"{name}: sequence_segment_ids must be integer [B, S] = {[b, num_ranks * t]}, "
            f"got {ids.dtype} {list(ids.shape)}"
        )
    with jax.ensure_compile_time_eval():  # a constant, also when called under jit
        laid = per_rank.shared(to_cp_layout(ids, num_ranks))
    own = jax.lax.dynamic_slice_in_dim(jnp.asarray(laid), rank * t, t, axis=1)
    return own, NoTransfer.with_sequence_ids(num_ranks, ids)
