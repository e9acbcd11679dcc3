import numpy as np
import pytest

import jax_cpgrad as cpg
from jax_cpgrad._native import ext


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_chunk_arithmetic_is_consistent(n):
    order = cpg.layout_order(n)
    assert sorted(order) == list(range(2 * n))
    for r in range(n):
        first, second = cpg.local_chunks(r, n)
        assert (first, second) == (r, 2 * n - 1 - r)
        assert order[2 * r : 2 * r + 2] == [first, second]
        for half, chunk in enumerate((first, second)):
            assert ext.owner_of(chunk, n) == r
            assert ext.half_of(chunk, n) == half


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("seq_axis", [0, 1, -3])
def test_layout_round_trip(n, seq_axis):
    x = (
        np.arange(2 * 4 * n * 3 * 5).reshape(2, 4 * n, 3, 5)
        if seq_axis != 0
        else np.arange(4 * n * 2 * 3).reshape(4 * n, 2, 3)
    )
    ax = seq_axis % x.ndim
    y = cpg.to_cp_layout(x, n, seq_axis)
    # Rank r's shard of the CP-layout array is chunks r and 2n-1-r of the natural one.
    shards = np.split(y, n, axis=ax)
    chunks = np.split(x, 2 * n, axis=ax)
    for r, shard in enumerate(shards):
        np.testing.assert_array_equal(shard, np.concatenate([chunks[r], chunks[2 * n - 1 - r]], axis=ax))
    np.testing.assert_array_equal(cpg.from_cp_layout(y, n, seq_axis), x)


def test_layout_works_on_jax_arrays():
    import jax.numpy as jnp

    x = jnp.arange(16.0).reshape(1, 16)
    np.testing.assert_array_equal(cpg.from_cp_layout(cpg.to_cp_layout(x, 4, 1), 4, 1), x)


@pytest.mark.parametrize(
    "shape,seq_axis,n,match",
    [
        ((2, 12, 3), 1, 4, "must be a positive multiple of 8"),
        ((2, 12, 3), 3, 2, "out of range"),
        ((2, 12, 3), -4, 2, "out of range"),
        ((2, 12, 3), 1.0, 2, "must be an int"),
        ((2, 12, 3), 1, 0, "CP size"),
    ],
)
def test_layout_rejects_bad_input(shape, seq_axis, n, match):
    with pytest.raises(ValueError, match=match):
        cpg.to_cp_layout(np.zeros(shape), n, seq_axis)


def test_native_argument_checks():
    with pytest.raises(ValueError):
        ext.chunk_of(4, 0, 4)
    with pytest.raises(ValueError):
        ext.owner_of(8, 4)
    with pytest.raises(ValueError):
        ext.geometry([4, 0], 1, 1, True)
    assert ext.geometry([2, 16, 3, 4], 1, 4, True) == (2, 24, 2, 16, 4)
    assert ext.geometry([2, 4, 3, 4], 1, 4, False) == (2, 24, 2, 16, 4)


def test_workspace_bytes_is_double_buffered_slots_plus_flags_and_ll_slots():
    # Two sets of N slots (rounded up to 256 bytes), a 256-byte control block, 8 KiB of flags per
    # rank (2048 tiles x 4 bytes) and two sets of N LL slots, each twice the slot up to 256 KiB of
    # payload (16-byte words of 8), whatever the depth.
    assert cpg.workspace_bytes(4, 1000) == 256 + 4 * 8192 + 2 * 4 * 2048 + 2 * 4 * 1024
    assert cpg.workspace_bytes(8, 1 << 20) == 256 + 8 * 8192 + 2 * 8 * (512 << 10) + 16 * (1 << 20)
    with pytest.raises(ValueError):
        cpg.workspace_bytes(4, 0)


def _launch_shape(**kwargs):
    from jax_cpgrad._native import bench_ext

    if bench_ext is None:
        pytest.skip("the launch shapes come from the CUDA build's benchmark module")
    return bench_ext.launch_shape(**kwargs)


@pytest.mark.parametrize("op", ["grad_return", "all_gather"])
def test_small_calls_travel_as_ll_words_and_larger_ones_as_tiles(op):
    """The wire format is a function of the call's shape alone (every rank must pick the same):
    LL words from 2 ranks up, for payloads up to 256 KiB per owner whose runs are a multiple of
    8 bytes, one 8-byte unit per thread (512 per block) up to the block budget."""
    ll = lambda **kw: _launch_shape(op=op, **{"n": 2, "tensors": 2, "outer": 1, "element_bytes": 2, **kw})
    # payload = tensors * outer * 2 * run * element_bytes
    assert ll(run=8192)["payload_bytes"] == 64 << 10
    assert ll(run=8192)["ll_blocks"] == (64 << 10) // 8 // 512
    assert ll(run=32768)["ll_blocks"] == 64  # 256 KiB: the largest LL payload
    assert ll(run=32768, block_budget=16)["ll_blocks"] == 16
    assert ll(run=32768 + 4)["ll_blocks"] == 0  # just over 256 KiB: tiles
    assert ll(run=105)["ll_blocks"] == 0  # runs of 210 bytes: tiles
    assert ll(run=8192, n=1)["ll_blocks"] == 0  # nothing to send
    assert ll(run=4, element_bytes=4, outer=3, n=8)["ll_blocks"] == 1
    tiles = ll(run=1 << 18)
    assert tiles["ll_blocks"] == 0 and tiles["tiles"] * tiles["tile_bytes"] >= tiles["payload_bytes"]
