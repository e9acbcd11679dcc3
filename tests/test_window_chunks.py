"""A wide window's chunks moved alone on the XLA transport (jax_cpgrad.attention.window_chunks), on
2, 4 and 8 CPU devices: which chunks each rank gets, their rows and positions against the
natural-order array, the return bitwise against a numpy float32 sum, the same chunks laid out in
natural order for plain calls (and their return), and what the layer lowers to (whole chunks by
collective-permute, no all-gather of K/V). On the peer transport such a window gathers from the
ranks it reaches alone (emulated on the CPU)."""

import functools
import re

import jax.numpy as jnp
import numpy as np
import pytest

from jax_cpgrad.attention import plan, window_chunks as W
from jax_cpgrad.attention.masks import normalize_window as normalize
from spmd import cp_mesh, spmd
from test_attention_masks import CHUNK as LAYER_CHUNK, _check, _lowered_without_ids
from test_halo import B, C, D, K, _natural, _stacked
from workspace_stub import peer_calls_on_xla, workspace_spec

# (left, right) in effect, chunks of C = 4: a chunk, more than one, two-sided, right only
WINDOWS = [(4, 0), (9, 0), (5, 6), (0, 4), (3, 8)]


def _reached(rank, n, left, right):
    """The other ranks' chunks that some query of this rank sees: brute force over positions."""
    own = [rank, 2 * n - 1 - rank]
    q = [p for j in own for p in range(j * C, (j + 1) * C)]
    return sorted(
        {k // C for k in range(2 * n * C) if k // C not in own and any(p - left <= k <= p + right for p in q)}
    )


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("window", WINDOWS)
def test_each_rank_gets_exactly_the_chunks_its_window_reaches(n, window):
    lay = W.layout(n, C, *window)
    if lay is None:  # the busiest rank needs every other chunk: the layer gathers instead
        assert max(len(_reached(r, n, *window)) for r in range(n)) == 2 * n - 2, (n, window)
        return
    for r in range(n):
        real = sorted(int(s) for s in lay.chunk[r] if s >= 0)
        assert real == _reached(r, n, *window), (r, real)
        pos, valid = W.positions(lay, r)
        assert np.all(np.diff(pos.astype(np.int64)) > 0)  # strictly increasing
        assert valid[: len(real) * C].all() and not valid[len(real) * C :].any()  # real rows first
        assert sorted(set((pos[valid] // C).tolist())) == real


def test_no_layout_within_a_chunk_at_one_rank_or_where_all_is_reached():
    assert W.layout(4, C, C - 1, C - 1) is None  # the halo's case
    assert W.layout(1, C, 100, 0) is None
    assert W.layout(4, C, 100, 0) is None  # reaches every chunk: the gather moves the same
    assert W.layout(4, C, 1 << 40, 0) is None  # a window longer than any sequence: the same
    lay = W.layout(8, 2048, 4096, 0)
    assert lay is not None and lay.real_slots() == 4  # 4 chunks, against the gather's 14


# (R, window) with a layout (the others gather): a window of a chunk, of more, two-sided
MOVED = [(n, w) for n in (2, 4, 8) for w in [(4, 0), (9, 0), (5, 6)] if W.layout(n, C, *w) is not None]


def _moved_body(move, lay):
    """The spmd body of ``move`` (``W.exchange`` or ``W.gather_natural``) of K and V."""

    def body(k, v):
        return move(lay, (k, v), "cp")

    return body


@pytest.mark.parametrize("n,window", MOVED, ids=str)
def test_rows_are_the_global_chunks_at_their_positions(n, window):
    lay = W.layout(n, C, *window)
    k_nat, v_nat = _natural(n, 0), _natural(n, 1)
    kr, vr = spmd(cp_mesh(n), _moved_body(W.exchange, lay))(_stacked(k_nat, n), _stacked(v_nat, n))
    for r in range(n):
        pos, valid = W.positions(lay, r)
        for got, nat in ((kr[r], k_nat), (vr[r], v_nat)):
            assert got.shape == (B, lay.rows, K, D)
            np.testing.assert_array_equal(got[:, valid], nat[:, pos[valid]])
            assert not np.any(got[:, ~valid])


def _return_oracle(lay, cts, n, dtype):
    """Each owner's [B, 2C, ...]: the rows' cotangents added into its chunks in float32, slot by
    slot in slot order, rounded once."""
    acc = {r: np.zeros((B, 2 * C, K, D), np.float32) for r in range(n)}
    inverse = np.argsort(lay.order, axis=1)
    for k in range(lay.n_slots):
        for r in range(n):
            s = int(lay.chunk[r, k])
            if s < 0:
                continue
            owner, first = lay.owner(s)
            i = inverse[r, k]
            rows = cts[r][:, i * C : (i + 1) * C].astype(np.float32)
            where = slice(0, C) if first else slice(C, 2 * C)
            acc[owner][:, where] = acc[owner][:, where] + rows
    return {r: np.asarray(jnp.asarray(a, dtype)) for r, a in acc.items()}


@pytest.mark.parametrize("n,window", MOVED, ids=str)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_return_is_the_owners_float32_sum_bitwise(n, window, dtype):
    lay = W.layout(n, C, *window)
    rng = np.random.default_rng(n)
    cts = rng.standard_normal((n, B, lay.rows, K, D)).astype(np.float32)
    cts = np.array(jnp.asarray(cts, dtype))
    for r in range(n):  # the padding rows' cotangents are the kernel's zeros
        cts[r][:, ~W.positions(lay, r)[1]] = 0
    (got,) = spmd(cp_mesh(n), lambda ct: W.return_grads(lay, (ct,), "cp"))(jnp.asarray(cts))
    want = _return_oracle(lay, cts, n, dtype)
    for r in range(n):
        assert got[r].dtype == jnp.dtype(dtype)
        np.testing.assert_array_equal(np.asarray(got[r]).view(np.uint8), want[r].view(np.uint8))


@pytest.mark.parametrize("n,window", MOVED, ids=str)
def test_natural_rows_hold_the_own_and_reached_chunks_in_place(n, window):
    """gather_natural (for plain calls): the natural-order sequence with the rank's own chunks and
    those its window reaches, zeros in every other chunk."""
    lay = W.layout(n, C, *window)
    k_nat, v_nat = _natural(n, 0), _natural(n, 1)
    kr, vr = spmd(cp_mesh(n), _moved_body(W.gather_natural, lay))(_stacked(k_nat, n), _stacked(v_nat, n))
    for r in range(n):
        kept = {r, 2 * n - 1 - r} | set(_reached(r, n, *window))
        for got, nat in ((kr[r], k_nat), (vr[r], v_nat)):
            assert got.shape == nat.shape
            for s in range(2 * n):
                rows = slice(s * C, (s + 1) * C)
                want = nat[:, rows] if s in kept else np.zeros_like(nat[:, rows])
                np.testing.assert_array_equal(got[:, rows], want, err_msg=f"rank {r} chunk {s}")


@pytest.mark.parametrize("n,window", MOVED, ids=str)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_return_natural_is_the_owners_float32_sum_bitwise(n, window, dtype):
    """return_natural: each owner's own chunks' cotangents, then every slot's that held them, in
    slot order, in float32, rounded once; the cotangents of chunks not reached are dropped."""
    lay = W.layout(n, C, *window)
    rng = np.random.default_rng(n + 1)
    cts = np.array(jnp.asarray(rng.standard_normal((n, B, 2 * n * C, K, D)).astype(np.float32), dtype))
    (got,) = spmd(cp_mesh(n), lambda ct: W.return_natural(lay, (ct,), "cp"))(jnp.asarray(cts))
    acc = {}
    for r in range(n):  # own chunks first
        own = [cts[r][:, j * C : (j + 1) * C].astype(np.float32) for j in (r, 2 * n - 1 - r)]
        acc[r] = np.concatenate(own, axis=1)
    for k in range(lay.n_slots):
        for r in range(n):
            s = int(lay.chunk[r, k])
            if s >= 0:
                owner, first = lay.owner(s)
                where = slice(0, C) if first else slice(C, 2 * C)
                acc[owner][:, where] = acc[owner][:, where] + cts[r][:, s * C : (s + 1) * C].astype(
                    np.float32
                )
    for r in range(n):
        want = np.asarray(jnp.asarray(acc[r], dtype))
        assert got[r].dtype == jnp.dtype(dtype)
        np.testing.assert_array_equal(np.asarray(got[r]).view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize(
    "window,causal",
    [((LAYER_CHUNK, 0), True), ((2 * LAYER_CHUNK + 1, 0), True), ((3, LAYER_CHUNK + 2), False)],
    ids=str,
)
def test_the_layer_moves_whole_chunks_by_permutes_and_gathers_nothing(window, causal):
    """R = 8: the layer's only collectives are permutes of whole chunks (K and V forward, dK and
    dV back), no all-gather, no reduce-scatter; a window reaching every chunk gathers (control)."""
    text = _lowered_without_ids(8, local_window_size=window, is_causal=causal)
    permutes = re.findall(r"stablehlo.collective_permute.*?-> tensor<([\dx]+)xf32>", text)
    assert permutes and all(p == f"1x{LAYER_CHUNK}x2x16" for p in permutes), permutes
    assert "all_gather" not in text and "reduce_scatter" not in text
    everything = _lowered_without_ids(8, local_window_size=1000, is_causal=False)
    assert "all_gather" in everything and "collective_permute" not in everything


def test_a_window_of_a_chunk_moves_a_quarter_of_the_gather_at_r8():
    """Bytes a rank receives: 2 chunks for a window of one chunk (its two chunks' left
    neighbours) against the gather's 14."""
    lay = W.layout(8, C, C, 0)
    assert lay.real_slots() == 2
    assert W.transfer_nbytes(lay, 10) == 2 * C * 10


@pytest.mark.parametrize(
    "ranks,causal,window",
    [(4, True, 9), (8, True, 17), (8, False, (3, 9)), (8, True, 2 * LAYER_CHUNK)],
    ids=str,
)
def test_the_peer_gather_of_a_wider_window_needs_only_the_ranks_it_reaches(
    monkeypatch, ranks, causal, window
):
    """On the peer transport a wide window gathers K/V from the ranks within its reach alone
    (ceil(side / c)), the others' rows zeros: the layer still equals the dense reference, values
    and gradients (the peer calls emulated on XLA's with the kernels' reach). The control: one
    rank less of reach than the plan's gives wrong results."""
    peer_calls_on_xla(monkeypatch)
    ws = workspace_spec(ranks)
    check = functools.partial(_check, ranks, causal=causal, window=window, workspace=ws)
    check()
    reach = plan.RankPlan.window_reach
    assert reach(plan.RankPlan(ranks, causal, window=normalize(window)), LAYER_CHUNK) > 1
    monkeypatch.setattr(plan.RankPlan, "window_reach", lambda self, c: reach(self, c) - 1)
    with pytest.raises(AssertionError):
        check()
