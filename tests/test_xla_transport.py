"""The public API over the XLA transport on 8 CPU devices, against the numpy oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jax_cpgrad as cpg
from oracle import DTYPES, all_gather_oracle, bits, grad_return_oracle, random_array
from spmd import cp_mesh as _mesh, place, spmd, spmd_jit

cp_mesh = lambda n: _mesh(n, "cpu")

NS = [1, 2, 3, 4, 8]
# (per-rank global shape, seq_axis): [B, S, H, D] and [S, B, H, D].
LAYOUTS = {"BSHD": lambda n: ((2, 4 * n, 3, 8), 1), "SBHD": lambda n: ((4 * n, 2, 3, 8), 0)}
TOL = {"float32": 1e-6, "bfloat16": 2e-2, "float16": 2e-3}


def _grad_inputs(n, layout, dtype, seed=0):
    shape, seq_axis = LAYOUTS[layout](n)
    rng = np.random.default_rng(seed)
    dk = random_array(rng, (n,) + shape, dtype)
    dv = random_array(rng, (n,) + shape, dtype)
    return dk, dv, seq_axis


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("n", NS)
def test_grad_return_matches_oracle(n, layout, dtype):
    dk, dv, seq_axis = _grad_inputs(n, layout, dtype)
    mesh = cp_mesh(n)
    f = spmd(mesh, lambda a, b: cpg.grad_return((a, b), axis_name="cp", seq_axis=seq_axis))
    ref = spmd(mesh, lambda a, b: cpg.grad_return_reference((a, b), axis_name="cp", seq_axis=seq_axis))
    got_k, got_v = f(dk, dv)
    ref_k, ref_v = ref(dk, dv)
    for got, want_ref, src in ((got_k, ref_k, dk), (got_v, ref_v, dv)):
        want = grad_return_oracle(list(src), n, seq_axis)
        for o in range(n):
            # The reference formulation is bitwise the oracle (float32 sum in rank order).
            np.testing.assert_array_equal(bits(want_ref[o]), bits(want[o]))
            # psum_scatter sums in its own order and precision: close, not bitwise.
            np.testing.assert_allclose(
                np.asarray(got[o], np.float32),
                want[o].astype(np.float32),
                rtol=TOL[dtype],
                atol=TOL[dtype] * n,
            )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("n", NS)
def test_all_gather_matches_oracle(n, layout, dtype):
    shape, seq_axis = LAYOUTS[layout](n)
    local_shape = shape[:seq_axis] + (2,) + shape[seq_axis + 1 :]
    rng = np.random.default_rng(1)
    k = random_array(rng, (n,) + local_shape, dtype)
    mesh = cp_mesh(n)
    f = spmd(mesh, lambda a: cpg.all_gather(a, axis_name="cp", seq_axis=seq_axis))
    got = f(k)
    want = all_gather_oracle(list(k), n, seq_axis)
    for r in range(n):
        np.testing.assert_array_equal(bits(got[r]), bits(want))


@pytest.mark.parametrize("n", [2, 4])
def test_all_gather_of_cp_layout_restores_the_global_array(n):
    x = np.arange(2 * 8 * n * 3, dtype=np.float32).reshape(2, 8 * n, 3)
    mesh = cp_mesh(n)
    sharded = jax.device_put(cpg.to_cp_layout(x, n, 1), jax.sharding.NamedSharding(mesh, P(None, "cp")))
    f = jax.jit(
        jax.shard_map(
            lambda a: cpg.all_gather(a, axis_name="cp", seq_axis=1)[None],
            mesh=mesh,
            in_specs=P(None, "cp"),
            out_specs=P("cp"),
        )
    )
    out = np.asarray(f(sharded))
    for r in range(n):
        np.testing.assert_array_equal(out[r], x)


def test_single_array_and_list_structures_are_kept():
    n = 2
    dk, dv, seq_axis = _grad_inputs(n, "BSHD", "float32")
    mesh = cp_mesh(n)
    single = spmd(mesh, lambda a: cpg.grad_return(a, axis_name="cp", seq_axis=seq_axis))
    listed = spmd(mesh, lambda a, b: cpg.grad_return([a, b], axis_name="cp", seq_axis=seq_axis))
    out_single = single(dk)
    out_list = listed(dk, dv)
    assert isinstance(out_list, list) and len(out_list) == 2
    for o in range(n):
        np.testing.assert_array_equal(out_single[o], out_list[0][o])


@pytest.mark.parametrize("n", [2, 4])
def test_grad_of_all_gather_is_grad_return(n):
    """d/dK of sum(w * all_gather(K)) is grad_return(w), the owner-summed cotangent."""
    shape, seq_axis = LAYOUTS["BSHD"](n)
    local_shape = shape[:seq_axis] + (shape[seq_axis] // n,) + shape[seq_axis + 1 :]
    rng = np.random.default_rng(2)
    k = random_array(rng, (n,) + local_shape, "float32")
    w = random_array(rng, (n,) + shape, "float32")
    mesh = cp_mesh(n)

    def body(k_loc, w_glob):
        g = jax.grad(lambda kk: jnp.sum(w_glob * cpg.all_gather(kk, axis_name="cp", seq_axis=seq_axis)))(
            k_loc
        )
        return g, cpg.grad_return(w_glob, axis_name="cp", seq_axis=seq_axis)

    g, expected = spmd(mesh, body)(k, w)
    want = grad_return_oracle(list(w), n, seq_axis)
    for o in range(n):
        np.testing.assert_allclose(g[o], expected[o], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(g[o], want[o], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_check_grads_both_directions(n):
    shape, seq_axis = LAYOUTS["SBHD"](n)
    rng = np.random.default_rng(3)
    mesh = cp_mesh(n)
    x_glob = random_array(rng, (n,) + shape, "float32")
    local_shape = shape[:seq_axis] + (2,) + shape[seq_axis + 1 :]
    x_loc = random_array(rng, (n,) + local_shape, "float32")

    def run(op):
        sm = jax.shard_map(
            lambda a: op(a[0], axis_name="cp", seq_axis=seq_axis)[None],
            mesh=mesh,
            in_specs=P("cp"),
            out_specs=P("cp"),
        )
        return jax.jit(sm)  # jit places check_grads' host-perturbed inputs on the mesh

    # Reverse mode only: custom_vjp rules define no JVP.
    check_grads(run(cpg.grad_return), (x_glob,), order=1, modes=["rev"], atol=1e-2, rtol=1e-2)
    check_grads(run(cpg.all_gather), (x_loc,), order=1, modes=["rev"], atol=1e-2, rtol=1e-2)


def test_vmap_over_leading_batch_axes():
    n = 4
    dk, dv, seq_axis = _grad_inputs(n, "BSHD", "float32")
    # Treat B as a vmapped axis: the per-example array is [S, H, D] with seq_axis 0.
    mesh = cp_mesh(n)
    f = spmd(
        mesh, lambda a, b: jax.vmap(lambda x, y: cpg.grad_return((x, y), axis_name="cp", seq_axis=0))(a, b)
    )
    got_k, got_v = f(dk, dv)
    for got, src in ((got_k, dk), (got_v, dv)):
        want = grad_return_oracle(list(src), n, seq_axis)
        for o in range(n):
            np.testing.assert_allclose(got[o], want[o], rtol=1e-6, atol=1e-6)


def test_inside_jitted_scan_over_layers():
    n = 2
    dk, _, seq_axis = _grad_inputs(n, "BSHD", "float32")
    mesh = cp_mesh(n)

    def body(x):
        def step(carry, _):
            return carry + cpg.grad_return(x, axis_name="cp", seq_axis=seq_axis), None

        out, _ = jax.lax.scan(step, jnp.zeros_like(x[:, :4]), None, length=3)
        return out

    got = spmd(mesh, body)(dk)
    want = grad_return_oracle(list(dk), n, seq_axis)
    for o in range(n):
        np.testing.assert_allclose(got[o], 3 * want[o], rtol=1e-5, atol=1e-5)


def test_xla_transport_compiles_to_xla_collectives():
    n = 4
    dk, _, seq_axis = _grad_inputs(n, "BSHD", "float32")
    mesh = cp_mesh(n)
    f = spmd_jit(mesh, lambda a: cpg.grad_return(a, axis_name="cp", seq_axis=seq_axis))
    hlo = f.lower(place(mesh, dk)).compile().as_text()
    assert "reduce-scatter" in hlo or "all-reduce" in hlo
    assert "jax_cpgrad_grad_return" not in hlo
