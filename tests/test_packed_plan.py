"""A Mosaic GPU kernel's mask operands packed into one array
(``jax_cpgrad/attention/mosaic_gpu/packed_plan.py``): every section starts at a multiple of 256
bytes, holds its array and nothing of another's, and a wrong section is named."""

from __future__ import annotations

import numpy as np
import pytest

from jax_cpgrad.attention import tile_plan
from jax_cpgrad.attention.mosaic_gpu.packed_plan import SECTION, PackedPlan, ranges_lengths, ranges_sections


def test_sections_start_256_byte_aligned_and_do_not_overlap():
    layout = PackedPlan.of(row_lo=130, row_hi=130, **ranges_lengths("q_", 3), col_lo=64, col_hi=1)
    ends = 0
    for name, start, length in layout.sections:
        assert start * 4 % 256 == 0 and start >= ends, (name, start)
        assert layout.start(name) == start and layout.length(name) == length
        ends = start + length
    assert layout.width >= ends and layout.width % SECTION == 0


def test_pack_puts_each_array_at_its_start_and_zeros_between():
    rng = np.random.default_rng(0)
    lengths = dict(row_lo=70, row_hi=70, **ranges_lengths("", 2))
    layout = PackedPlan.of(**lengths)
    arrays = {name: rng.integers(1, 1000, (3, n)).astype(np.int32) for name, n in lengths.items()}
    packed = np.asarray(layout.pack(**arrays))
    assert packed.shape == (3, layout.width) and packed.dtype == np.int32
    covered = np.zeros(layout.width, bool)
    for name, start, length in layout.sections:
        np.testing.assert_array_equal(packed[:, start : start + length], arrays[name])
        covered[start : start + length] = True
    assert not packed[:, ~covered].any()


def test_the_tile_ranges_sections_name_every_field():
    lo = np.array([[0, 0, 10, 10]], np.int32)
    ranges = tile_plan.tile_ranges(lo, lo + 5, outer_block=2, inner_block=4, inner_len=16)
    sections = ranges_sections("k_", ranges)
    assert set(sections) == set(ranges_lengths("k_", ranges.n_outer))
    np.testing.assert_array_equal(sections["k_order"], ranges.order)


def test_a_missing_or_misshapen_section_is_named():
    layout = PackedPlan.of(a=4, b=8)
    with pytest.raises(ValueError, match="sections"):
        layout.pack(a=np.zeros((1, 4), np.int32))
    with pytest.raises(ValueError, match="section 'b' is"):
        layout.pack(a=np.zeros((1, 4), np.int32), b=np.zeros((1, 7), np.int32))
    with pytest.raises(KeyError):
        layout.start("c")
