"""The halo exchange for windows (jax_cpgrad.attention.halo) on 2, 4 and 8 CPU devices: the rows,
their positions and validity, the VJP against a dense reference, determinism, what each transport
lowers to, and the argument checks."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cpgrad as cpg
from jax_cpgrad import api
from jax_cpgrad.attention import halo as H
from spmd import cp_mesh, place, spmd, spmd_jit
from workspace_stub import workspace_spec

B, K, D = 2, 2, 3
C = 4  # chunk length: T = 8 local rows
# (left, right): a window on both sides whose tail and head overlap (left + right > c), causal
# (right = 0), right only, the widest, and nothing.
WINDOWS = [(3, 2), (2, 0), (0, 1), (3, 3), (0, 0)]
XLA_COLLECTIVES = re.compile(
    r"stablehlo\.(all_reduce|all_gather|reduce_scatter|all_to_all|collective_permute)"
)


def _natural(n, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((B, 2 * n * C, K, D)).astype(dtype)


def _stacked(x_nat, n):
    """[n, B, T, ...]: rank r's local rows of the CP layout."""
    cp = np.asarray(cpg.to_cp_layout(x_nat, n, seq_axis=1))
    return np.stack(np.split(cp, n, axis=1))


def _expected_real(rank, n, left, right):
    """The other ranks' positions some query of this rank sees: brute force over the sequence."""
    own = set(range(rank * C, (rank + 1) * C)) | set(range((2 * n - 1 - rank) * C, (2 * n - rank) * C))
    return sorted(
        k for k in range(2 * n * C) if k not in own and any(q - left <= k <= q + right for q in own)
    )


@pytest.fixture(params=["xla", "peer-on-cpu"])
def transport(request, monkeypatch):
    """A function n -> workspace for the body: None (XLA collectives), or a stub workspace with
    the peer all-gather swapped for the XLA one, so that the peer path's choice of rows (and the
    VJP through it) runs on the CPU. Its sums are then XLA's, not the peer transport's."""
    if request.param == "xla":
        return lambda n: None
    real = api.all_gather_overlapped

    def on_xla(xs, fn, *args, workspace, **kw):
        assert workspace is not None
        return real(xs, fn, *args, workspace=None, **kw)

    real_back = api.grad_return_overlapped

    def back_on_xla(grads, fn, *args, workspace, **kw):
        assert workspace is not None
        return real_back(grads, fn, *args, workspace=None, **kw)

    monkeypatch.setattr(api, "all_gather_overlapped", on_xla)
    monkeypatch.setattr(api, "grad_return_overlapped", back_on_xla)
    return lambda n: workspace_spec(n)


def _halo_body(left, right, workspace=None):
    def body(k, v):
        h = H.halo_exchange((k, v), axis_name="cp", left=left, right=right, workspace=workspace)
        return (*h.rows, h.positions, h.valid)

    return body


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("window", WINDOWS)
def test_halo_rows_are_the_global_rows_at_their_positions(n, window, transport):
    left, right = window
    k_nat, v_nat = _natural(n, 0), _natural(n, 1)
    body = _halo_body(left, right, transport(n))
    kh, vh, pos, valid = spmd(cp_mesh(n), body)(_stacked(k_nat, n), _stacked(v_nat, n))
    s = 2 * n * C
    for r in range(n):
        assert kh[r].shape == (B, H.halo_length(left, right), K, D)
        p, ok = pos[r], valid[r]
        np_pos, np_valid = H.halo_positions(r, n, C, left, right)
        np.testing.assert_array_equal(p, np_pos)
        np.testing.assert_array_equal(ok, np_valid)
        assert np.all(np.diff(p.astype(np.int64)) > 0), (r, p)  # strictly increasing
        assert sorted(p[ok].tolist()) == _expected_real(r, n, left, right), r
        for got, nat in ((kh[r], k_nat), (vh[r], v_nat)):
            np.testing.assert_array_equal(got[:, ok], nat[:, p[ok]])
            assert not np.any(got[:, ~ok])  # padding holds zeros
        pad = p[~ok].astype(np.int64)
        assert np.all((pad < -s - C) | (pad > 2 * s + C))  # beyond any window's reach
        # no padding between two real rows
        idx = np.flatnonzero(ok)
        if idx.size:
            assert ok[idx[0] : idx[-1] + 1].all()


def _reference_rows(x_nat, n, left, right):
    """The halo as a gather from the natural-order global array (the dense reference)."""
    rows = []
    for r in range(n):
        pos, valid = H.halo_positions(r, n, C, left, right)
        taken = jnp.take(x_nat, np.clip(pos, 0, x_nat.shape[1] - 1), axis=1)
        rows.append(jnp.where(valid[None, :, None, None], taken, 0))
    return jnp.stack(rows)


def _vjp_body(left, right, workspace=None):
    def body(k, v, ck, cv):
        def rows(k, v):
            return H.halo_exchange((k, v), axis_name="cp", left=left, right=right, workspace=workspace).rows

        _, vjp = jax.vjp(rows, k, v)
        return vjp((ck, cv))

    return body


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("window", WINDOWS[:4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_vjp_is_the_transpose_of_the_gather_bitwise(n, window, dtype, transport):
    left, right = window
    k_nat, v_nat = (jnp.asarray(_natural(n, s), dtype) for s in (0, 1))
    rng = np.random.default_rng(2)
    shape = (n, B, H.halo_length(left, right), K, D)
    ck, cv = (jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(2))
    run = spmd(cp_mesh(n), _vjp_body(left, right, transport(n)))
    dk, dv = run(
        _stacked(np.asarray(k_nat), n), _stacked(np.asarray(v_nat), n), np.asarray(ck), np.asarray(cv)
    )
    for got, x_nat, ct in ((dk, k_nat, ck), (dv, v_nat, cv)):
        # the transpose in float32 (sums of at most two values: order does not matter), rounded once
        _, ref_vjp = jax.vjp(lambda x: _reference_rows(x, n, left, right), x_nat.astype(jnp.float32))
        (ref,) = ref_vjp(ct.astype(jnp.float32))
        want = _stacked(np.asarray(ref.astype(dtype)), n)
        for r in range(n):
            assert got[r].dtype == want[r].dtype
            np.testing.assert_array_equal(got[r], want[r])


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("window", WINDOWS[:4])
def test_the_return_with_work_beside_is_the_vjp_bitwise(n, window, transport):
    """halo_return_overlapped (the layer's backward move) equals halo_exchange's VJP bit for bit,
    bfloat16, and returns the work's result."""
    left, right = window
    k, v = (np.asarray(jnp.asarray(_stacked(_natural(n, s), n), jnp.bfloat16)) for s in (0, 1))
    rng = np.random.default_rng(5)
    shape = (n, B, H.halo_length(left, right), K, D)
    ck, cv = (np.asarray(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)) for _ in range(2))
    workspace = transport(n)

    def body(k, v, ck, cv):
        grads, y = H.halo_return_overlapped(
            (ck, cv), jnp.sin, k, axis_name="cp", left=left, right=right, chunk_len=C, workspace=workspace
        )
        return (*grads, y)

    dk, dv, y = spmd(cp_mesh(n), body)(k, v, ck, cv)
    want_k, want_v = spmd(cp_mesh(n), _vjp_body(left, right, workspace))(k, v, ck, cv)
    for r in range(n):
        np.testing.assert_array_equal(dk[r], want_k[r])
        np.testing.assert_array_equal(dv[r], want_v[r])
        np.testing.assert_array_equal(y[r], np.asarray(jnp.sin(jnp.asarray(k[r]))))


def test_forward_and_backward_are_bitwise_equal_on_two_runs():
    n, (left, right) = 4, (3, 2)
    mesh = cp_mesh(n)
    k, v = _stacked(_natural(n, 0), n), _stacked(_natural(n, 1), n)
    rng = np.random.default_rng(3)
    cts = [rng.standard_normal((n, B, 10, K, D)).astype(np.float32) for _ in range(2)]
    fwd, bwd = spmd(mesh, _halo_body(left, right)), spmd(mesh, _vjp_body(left, right))
    first, second = (fwd(k, v), bwd(k, v, *cts)), (fwd(k, v), bwd(k, v, *cts))
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second), strict=True):
        assert a.tobytes() == b.tobytes()


def test_overlapped_returns_the_halo_and_the_work_with_its_gradients():
    n, (left, right) = 4, (2, 1)
    mesh = cp_mesh(n)
    k = _stacked(_natural(n, 0), n)
    w = np.random.default_rng(4).standard_normal((n, 3)).astype(np.float32)

    def loss(k, w, overlapped):
        if overlapped:
            h, y = H.halo_exchange_overlapped(
                k, lambda a: jnp.sum(a**2), w, axis_name="cp", left=left, right=right
            )
        else:
            h, y = H.halo_exchange(k, axis_name="cp", left=left, right=right), jnp.sum(w**2)
        return jnp.sum(h.rows**3) + y

    grads = [
        spmd(mesh, lambda k, w, o=o: jax.grad(loss, argnums=(0, 1))(k, w, o))(k, w) for o in (True, False)
    ]
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1]), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(grads[0][1][0], 2 * w[0])


def _lowered_text(fn, n, platforms=None):
    mesh = cp_mesh(n, "cpu")
    x = place(mesh, np.zeros((n, B, 2 * C, K, D), np.float32))
    traced = spmd_jit(mesh, fn).trace(x, x)
    return traced.lower(lowering_platforms=platforms).as_text() if platforms else traced.lower().as_text()


def _grad_of_halo(workspace=None, overlapped=False):
    def fn(k, v):
        def loss(k, v):
            if overlapped:
                h, y = H.halo_exchange_overlapped(
                    (k, v), jnp.sin, k, axis_name="cp", left=2, right=1, workspace=workspace
                )
                return jnp.sum(h.rows[0] * h.rows[1]) + jnp.sum(y)
            h = H.halo_exchange((k, v), axis_name="cp", left=2, right=1, workspace=workspace)
            return jnp.sum(h.rows[0] * h.rows[1])

        return jax.grad(loss, argnums=(0, 1))(k, v)

    return fn


def test_the_xla_path_moves_the_halo_by_collective_permute_and_gathers_nothing():
    text = _lowered_text(_grad_of_halo(), 4)
    permutes = [line for line in text.splitlines() if "stablehlo.collective_permute" in line]
    assert len(permutes) == 8  # 2 arrays x 2 neighbours x (forward, backward)
    # each moves the halo rows only: left + right = 3 rows of [B, ., K, D]
    assert all("(tensor<2x3x2x3xf32>) -> tensor<2x3x2x3xf32>" in line for line in permutes), permutes
    for op in ("all_gather", "all_reduce", "reduce_scatter", "all_to_all"):
        assert f"stablehlo.{op}" not in text, op
    # the owner's sum of the returned rows runs in float32
    assert "tensor<2x8x2x3xf32>" in text


@pytest.mark.parametrize(
    "protocol,overlap,targets",
    [
        ("memop", False, ["@jax_cpgrad_all_gather(", "@jax_cpgrad_grad_return("]),
        ("device", False, ["@jax_cpgrad_all_gather_device(", "@jax_cpgrad_grad_return_device("]),
        ("device", True, ["@jax_cpgrad_all_gather_device_start(", "@jax_cpgrad_grad_return_device_start("]),
    ],
)
def test_the_peer_path_lowers_to_our_all_gather_and_its_grad_return(protocol, overlap, targets):
    ws = workspace_spec(4, protocol=protocol, overlap=overlap)
    text = _lowered_text(_grad_of_halo(ws, overlapped=overlap), 4, ("cuda",))
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    for target in targets:
        (call,) = [c for c in calls if target in c]
        assert "reach = 1" in call, call  # the neighbours' rows alone move, both ways
    if overlap:
        assert sum("@jax_cpgrad_done(" in c for c in calls) == 2
    assert not XLA_COLLECTIVES.search(text)


def _trace(body, n=4, t=2 * C, dtype=np.float32):
    mesh = cp_mesh(n, "cpu")
    x = place(mesh, np.zeros((n, B, t, K, D), dtype))
    return spmd_jit(mesh, body).trace(x)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(left=-1, right=0), "left must be >= 0"),
        (dict(left=C, right=0), "left must be >= 0 and smaller than the chunk length c = 4"),
        (dict(left=0, right=C), "right must be"),
        (dict(left=1.5, right=0), "left must be an int"),
        (dict(left=True, right=0), "left must be an int"),
        (dict(left=1, right=None), "right must be an int"),
    ],
)
def test_bad_windows_raise_naming_the_side(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _trace(lambda k: H.halo_exchange(k, axis_name="cp", **kwargs).rows)


def test_bad_arrays_axes_and_workspaces_raise():
    ok = dict(left=1, right=1)
    with pytest.raises(ValueError, match="T even"):
        _trace(lambda k: H.halo_exchange(k, axis_name="cp", **ok).rows, t=7)
    with pytest.raises(ValueError, match="dtype int32"):
        _trace(lambda k: H.halo_exchange(k, axis_name="cp", **ok).rows, dtype=np.int32)
    with pytest.raises(ValueError, match="same shape"):
        _trace(lambda k: H.halo_exchange((k, k[:, :4]), axis_name="cp", **ok).rows)
    with pytest.raises(ValueError, match="not bound"):
        _trace(lambda k: H.halo_exchange(k, axis_name="sp", **ok).rows)
    with pytest.raises(ValueError, match="fn must be callable"):
        _trace(lambda k: H.halo_exchange_overlapped(k, 3, axis_name="cp", **ok)[0].rows)
    small = workspace_spec(4, nbytes=64)
    with pytest.raises(ValueError, match="holds 64"):
        _trace(lambda k: H.halo_exchange(k, axis_name="cp", workspace=small, **ok).rows)
    other = workspace_spec(2)
    with pytest.raises(ValueError, match="created for 2"):
        _trace(lambda k: H.halo_exchange(k, axis_name="cp", workspace=other, **ok).rows)


def test_a_workspace_sized_for_the_layer_holds_every_halo():
    key = jax.ShapeDtypeStruct((B, 2 * C, K, D), jnp.float32)
    ws = workspace_spec(4, nbytes=cpg.attention_workspace_nbytes(key))
    _trace(lambda k: H.halo_exchange((k, k), axis_name="cp", workspace=ws, left=C - 1, right=C - 1).rows)


def test_transfer_bytes():
    row = 1 * 8 * 128 * 2
    xla = H.halo_transfer_nbytes(1, 1 << 20, 8, 8, 128, 2, 4096, 0, "xla")
    peer = H.halo_transfer_nbytes(1, 1 << 20, 8, 8, 128, 2, 4096, 0, "peer")
    # the peer path sends both neighbours all four edge pieces (each needs two): 2x, whatever R
    assert xla.halo == 2 * 2 * 4096 * row and peer.halo == 2 * xla.halo
    two = H.halo_transfer_nbytes(1, 1 << 20, 2, 8, 128, 2, 4096, 0, "peer")
    assert two.halo == 2 * 2 * 4096 * row  # R = 2: one neighbour
    assert xla.all_gather == peer.all_gather == 7 * 2 * (1 << 17) * row
    assert H.halo_transfer_nbytes(1, 64, 1, 1, 1, 2, 3, 3, "peer").halo == 0
    # tail and head overlap (left + right > c = 8): the peer path sends the whole chunks, to the
    # two neighbours of the three other ranks
    wide = H.halo_transfer_nbytes(1, 64, 4, 1, 1, 2, 7, 7, "peer")
    assert wide.halo == 2 * 2 * 16 * 2 and wide.all_gather == 3 * 2 * 16 * 2
    with pytest.raises(ValueError, match="left must be"):
        H.halo_transfer_nbytes(1, 64, 4, 1, 1, 2, 8, 0, "xla")
    with pytest.raises(ValueError, match="transport"):
        H.halo_transfer_nbytes(1, 64, 4, 1, 1, 2, 1, 0, "nccl")
    with pytest.raises(ValueError, match="multiple"):
        H.halo_transfer_nbytes(1, 60, 4, 1, 1, 2, 1, 0, "xla")


def test_one_rank_has_only_padding_and_no_transfer():
    text = _lowered_text(_grad_of_halo(), 1)
    assert not XLA_COLLECTIVES.search(text)
    pos, valid = H.halo_positions(0, 1, C, 2, 1)
    assert not valid.any() and np.all(np.diff(pos) > 0)
