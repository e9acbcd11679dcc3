"""A Mosaic GPU kernel's mask operands as one int32 array.

A kernel reads its rows' intervals (TMA copies of a tile's rows) and its tile plan (scalars) from
GMEM. They travel as one ``[Bp, width]`` array: a row per batch entry of the plan (Bp = B with
documents, else 1), each named section of a row starting at a multiple of :data:`SECTION`
elements (256 bytes: TMA needs 16, and ``per_rank.py``'s lookups keep 256).

Why one array: without documents a rank's plan is looked up by the rank's index in a table made
while tracing (``per_rank.py``). XLA hands a kernel the looked-up row in place when the row is the
whole operand, but copies out every static slice of it that a kernel takes as an operand of its
own: a launch of about 1 us a slice, 30 of them in a rank's forward and backward at R = 8 with a
window of 512 (``benchmarks/results/README.md``, "The rank's masks as tables").
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .. import tile_plan

SECTION = 64  # int32 elements a section's start is a multiple of (256 bytes)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclasses.dataclass(frozen=True)
class PackedPlan:
    """Where each named section starts in a row and how long it is; the row's ``width``."""

    sections: tuple[tuple[str, int, int], ...]  # (name, start, length)
    width: int

    @classmethod
    def of(cls, **lengths: int) -> PackedPlan:
        """The layout of sections of these lengths, in this order."""
        sections, start = [], 0
        for name, length in lengths.items():
            sections.append((name, start, length))
            start += _round_up(length, SECTION)
        return cls(tuple(sections), max(start, SECTION))

    def start(self, name: str) -> int:
        """Where section ``name`` starts in a row (a static int, for the kernel's reads)."""
        return self._section(name)[1]

    def length(self, name: str) -> int:
        return self._section(name)[2]

    def _section(self, name: str) -> tuple[str, int, int]:
        for section in self.sections:
            if section[0] == name:
                return section
        raise KeyError(name)

    def pack(self, **arrays) -> jax.Array:
        """The int32 ``[Bp, width]`` of the sections' ``[Bp, length]`` arrays (every section's, by
        name), zeros between them."""
        if set(arrays) != {name for name, _, _ in self.sections}:
            names = [name for name, _, _ in self.sections]
            raise ValueError(f"PackedPlan.pack: sections {sorted(arrays)}, expected {names}")
        parts = []
        for name, _, length in self.sections:
            x = jnp.asarray(arrays[name], jnp.int32)
            if x.ndim != 2 or x.shape[1] != length:
                raise ValueError(f"PackedPlan.pack: section {name!r} is {x.shape}, expected [Bp, {length}]")
            parts.append(jnp.pad(x, ((0, 0), (0, _round_up(length, SECTION) - length))))
        packed = jnp.concatenate(parts, axis=1)
        return jnp.pad(packed, ((0, 0), (0, self.width - packed.shape[1])))


def ranges_lengths(prefix: str, n_outer: int) -> dict[str, int]:
    """The sections of one pass's :class:`~jax_cpgrad.attention.tile_plan.TileRanges` (their
    names ``prefix`` + the field's), each ``n_outer`` long."""
    return {prefix + field: n_outer for field in ("order", "lo", "full_lo", "full_hi", "hi")}


def ranges_sections(prefix: str, ranges: tile_plan.TileRanges) -> dict[str, jax.Array]:
    """The arrays of :func:`ranges_lengths`' sections."""
    return {prefix + field: getattr(ranges, field) for field in ("order", "lo", "full_lo", "full_hi", "hi")}
