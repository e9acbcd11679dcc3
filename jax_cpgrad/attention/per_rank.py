"""Values that depend on the rank's index alone, looked up in a constant table on the device.

Without documents, a rank's masks (its calls' :class:`~jax_cpgrad.attention.masks.Visibility`,
``plan.py``) and the tile plans a kernel makes of them (``tile_plan.py``) depend on nothing but
the rank's index on the axis and static shapes. Computed on a GPU they are tens of small launches
a pass (searches, sorts, reductions: about 40 us of a rank's 550 us forward and backward at
R = 8, 32k tokens, a window of 512; ``benchmarks/results/README.md``). :func:`tabulate` computes
such a value for every rank while the program is traced (``jax.ensure_compile_time_eval``: the
same jnp code, run on concrete values) and leaves the program one lookup an array, a dynamic slice
of a constant by the rank's index. The values are the same integers either way, so the results
are the same bits.

Tables are kept by a key the caller gives (what ``fn`` depends on: the plan, the shapes, the
kernel's tiles), so that a model's layers of one configuration, and a backward pass after its
forward, compute them once (about 3.5 s of a layer's first trace at R = 8, on the host's CPU),
and every table is one constant array (:func:`shared`, also for the other rank-indexed tables of
the package), so that XLA computes what two layers look up once.

A value too large for a table (more than :data:`MAX_ELEMENTS` elements over every rank; the
masks hold a few int32 a query row per call, so at R = 8 a window's fit to about 16k tokens a rank
and a causal mask's to about 4k, past which the kernels' time dwarfs the masks') or one that does
not depend on the rank alone (it reads a traced value) is computed in the program, as it would be
without this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# int32 elements of one table, every rank's value together (4 MiB)
MAX_ELEMENTS = 1 << 20
# where each leaf starts in a looked-up row (a Mosaic GPU kernel's inputs must be 256-byte aligned)
ALIGN_BYTES = 256


@dataclasses.dataclass(frozen=True, eq=False)
class Table:
    """A value for every rank, index r the rank's (pytrees of concrete arrays). Compared and
    hashed by identity, so that it can be a pytree's static field."""

    values: tuple[Any, ...]
    key: Hashable | None = None  # the cache's key (tabulate's), None where not cached

    @property
    def num_ranks(self) -> int:
        return len(self.values)


def tabulate(
    fn: Callable[[int], Any], rank, num_ranks: int, key: Hashable | None = None
) -> tuple[Any, Table | None]:
    """``(fn(rank), table)``: ``fn`` (a rank's index -> a pytree of arrays) computed for every
    rank at trace time and the rank's value looked up, with the :class:`Table` of every rank's;
    or ``(fn(rank), None)`` computed in the program where ``fn`` reads a traced value, its ranks
    disagree on shapes, or the table would be too large. ``rank``: the int32 index on the axis
    (traced) or a Python int (then the value is a constant). ``key``: where given, the tables of
    an equal key are reused, so it must name everything ``fn`` depends on."""
    table = _table(fn, num_ranks, key)
    if table is None:  # computed in the program, outside the compile-time evaluation
        return fn(rank), None
    structure = jax.tree.structure(table.values[0])
    if isinstance(rank, (int, np.integer)):
        return jax.tree.map(jnp.asarray, table.values[rank]), table
    return jax.tree.unflatten(structure, _look_up_leaves(table, rank)), table


_CACHE: dict[Hashable, Table | None] = {}
_CACHE_SIZE = 256  # tables (the oldest go first), a few MiB at most each
_SHARED: dict[tuple, np.ndarray] = {}  # shared()'s arrays by contents, as many at most


def shared(x) -> np.ndarray:
    """``x`` (a concrete array) as the one numpy array of its contents kept here, read-only: what
    a program takes as a constant. jax passes each constant array to XLA once however often it
    is used, but two equal arrays twice (from jax 0.12.1 as parameters of their own), and XLA
    shares the work of two layers (the lookups and what follows from them) only where they read
    the same one."""
    x = np.asarray(x)
    key = (x.shape, x.dtype.str, x.tobytes())
    kept = _SHARED.get(key)
    if kept is None:
        if len(_SHARED) >= _CACHE_SIZE:
            del _SHARED[next(iter(_SHARED))]
        kept = _SHARED[key] = x.copy()
        kept.setflags(write=False)
    return kept


def row(table, rank):
    """Row ``rank`` (an int or a traced int32) of a numpy table ``[R, ...]`` of every rank's
    values, taken from its :func:`shared` constant."""
    return jnp.asarray(shared(table))[rank]


def _table(fn: Callable[[int], Any], num_ranks: int, key: Hashable | None) -> Table | None:
    """The :class:`Table` of ``fn`` over the ranks, from the cache where ``key`` is in it."""
    full_key = None if key is None else (key, num_ranks)
    if full_key in _CACHE:
        return _CACHE[full_key]
    values = _every_rank(fn, num_ranks)
    table = None if values is None else Table(jax.tree.map(np.asarray, values), full_key)
    if full_key is not None:
        if len(_CACHE) >= _CACHE_SIZE:
            del _CACHE[next(iter(_CACHE))]
        _CACHE[full_key] = table
    return table


def _every_rank(fn: Callable[[int], Any], num_ranks: int) -> tuple[Any, ...] | None:
    """Every rank's value, concrete, or None where they cannot make one table."""
    with jax.ensure_compile_time_eval(), _on_the_host():
        first = fn(0)
        if not _fits(first, num_ranks):
            return None
        values = (first, *(fn(r) for r in range(1, num_ranks)))
    structures = {jax.tree.structure(v) for v in values}  # hashed: PyTreeDef's == is untyped
    shapes = {tuple(np.shape(x) for x in jax.tree.leaves(v)) for v in values}
    if len(structures) > 1 or len(shapes) > 1:
        return None
    return values


def _on_the_host():
    """This process's CPU as the default device: the values' small integer ops compile and run
    there in milliseconds each, where on a GPU each would compile a kernel. A local device: with
    several processes, ``jax.devices("cpu")[0]`` is process 0's, which another process cannot
    read."""
    try:
        return jax.default_device(jax.local_devices(backend="cpu")[0])
    except RuntimeError:  # no CPU backend (JAX_PLATFORMS without cpu): the default device
        return contextlib.nullcontext()


def _fits(value, num_ranks: int) -> bool:
    """Every leaf concrete (the value did not read a traced one) and the table small enough."""
    leaves = jax.tree.leaves(value)
    concrete = not any(isinstance(x, jax.core.Tracer) for x in leaves)
    return concrete and sum(np.size(x) for x in leaves) * num_ranks <= MAX_ELEMENTS


def _look_up_leaves(table: Table, rank) -> list[jax.Array]:
    """The rank's leaves, in order. The leaves of one dtype are looked up together, flattened into
    one row a rank: one dynamic slice of one constant (one lookup a leaf was a launch a leaf), then
    static slices (none where a leaf fills its row). Where a custom call (a Mosaic GPU kernel)
    takes a slice as an operand, XLA copies it out, a launch a slice (``experiments/rank_thunks.py``),
    and it hands a whole row in place: so each Mosaic GPU kernel takes one packed operand
    (``mosaic_gpu/packed_plan.py``). Every leaf starts at a multiple of
    :data:`ALIGN_BYTES` in its row and every row is a multiple long: XLA may hand a kernel a slice
    of the constant in place, and a Mosaic GPU kernel refuses an input not 256-byte aligned."""
    every_rank = [jax.tree.leaves(v) for v in table.values]
    first = every_rank[0]
    looked_up: list[Any] = [None] * len(first)
    for dtype in sorted({x.dtype.str for x in first}):
        where = [i for i, x in enumerate(first) if x.dtype.str == dtype]
        align = max(1, ALIGN_BYTES // first[where[0]].dtype.itemsize)
        spans = [-(-first[i].size // align) * align for i in where]  # each leaf's room in a row
        rows = shared(np.stack([_row(leaves, where, spans) for leaves in every_rank]))
        looked = jax.lax.dynamic_index_in_dim(jnp.asarray(rows), rank, axis=0, keepdims=False)
        start = 0
        for i, span in zip(where, spans, strict=True):
            looked_up[i] = looked[start : start + first[i].size].reshape(first[i].shape)
            start += span
    return looked_up


def _row(leaves, where: list[int], spans: list[int]) -> np.ndarray:
    """Leaves ``where`` of one rank flattened into one row, each zero-padded to its span."""
    parts = zip(where, spans, strict=True)
    return np.concatenate([np.pad(leaves[i].ravel(), (0, span - leaves[i].size)) for i, span in parts])
