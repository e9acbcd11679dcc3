"""jax_cpgrad.dot_product_attention on CPU devices against unsharded jax.nn.dot_product_attention:
values and q/k/v gradients for N = 1, 2, 4, 8, causal and not, MHA, GQA and MQA, float32 and
bfloat16, under jit, grad and jax.checkpoint; the public fallback; the bad inputs it refuses."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_check as ac
import jax_cpgrad as cpg
from jax_cpgrad.attention import kernels, layer
from spmd import cp_mesh
from workspace_stub import workspace_spec

TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 5e-2}
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


def _check(n, *, causal=True, heads="gqa", dtype=jnp.float32, chunk=8, **kw):
    h, hk = HEADS[heads]
    inputs = ac.random_inputs(2 * n * chunk, heads=h, kv_heads=hk, dtype=dtype, seed=n)
    ref = ac.reference(*inputs, causal=causal, scale=kw.get("scale"))
    got = ac.cp_layer(cp_mesh(n), inputs, dtype=dtype, causal=causal, **kw)
    errs = ac.relative_errors(got, ref)
    assert max(errs.values()) <= TOLERANCE[dtype], errs
    return errs


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads", sorted(HEADS))
def test_matches_unsharded_attention_float32(n, causal, heads):
    _check(n, causal=causal, heads=heads)


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_matches_unsharded_attention_bfloat16(n, causal):
    _check(n, causal=causal, dtype=jnp.bfloat16, chunk=16)


@pytest.mark.parametrize("n", [1, 4])
def test_under_jax_checkpoint(n):
    _check(n, remat=True)


def test_custom_scale_and_batch_rows():
    h, hk = HEADS["gqa"]
    inputs = ac.random_inputs(32, batch=3, heads=h, kv_heads=hk, seed=5)
    ref = ac.reference(*inputs, scale=0.3)
    errs = ac.relative_errors(ac.cp_layer(cp_mesh(2), inputs, dtype=jnp.float32, scale=0.3), ref)
    assert max(errs.values()) <= TOLERANCE[jnp.float32], errs


def test_the_split_path_at_n1(monkeypatch):
    """At N = 1 the layer is one attention call; the two-part path (what the transfer's path
    runs at N = 1 on one GPU) must be exact too."""
    monkeypatch.setattr(layer, "SKIP_TRANSFER_WHEN_ALONE", False)
    _check(1)


def test_grad_of_a_loss_through_the_layer():
    """jax.grad of a scalar loss (not only jax.vjp) reaches q, k and v through the transfer."""
    n, seq = 4, 64
    q, k, v, _ = ac.random_inputs(seq, seed=3)
    mesh = cp_mesh(n)
    spec = jax.sharding.PartitionSpec(None, "cp")

    def loss(q, k, v):
        out = cpg.dot_product_attention(q, k, v, axis_name="cp")
        return jax.lax.psum(jnp.sum(jnp.sin(out)), "cp")

    grad = jax.jit(jax.shard_map(jax.grad(loss, argnums=(0, 1, 2)), mesh=mesh, in_specs=spec, out_specs=spec))
    laid = [cpg.to_cp_layout(x, n, seq_axis=1) for x in (q, k, v)]
    got = [np.asarray(cpg.from_cp_layout(g, n, seq_axis=1)) for g in grad(*laid)]
    ref = jax.grad(
        lambda q, k, v: jnp.sum(jnp.sin(jax.nn.dot_product_attention(q, k, v, is_causal=True))), (0, 1, 2)
    )
    for g, r in zip(got, ref(q, k, v), strict=True):
        np.testing.assert_allclose(g, r, atol=2e-5 * np.abs(r).max())


def test_same_bits_every_run():
    inputs = ac.random_inputs(64, seed=9)
    first = ac.cp_layer(cp_mesh(4), inputs, dtype=jnp.float32)
    second = ac.cp_layer(cp_mesh(4), inputs, dtype=jnp.float32)
    for name in ac.NAMES:
        for rank, rows in first[name].items():
            assert np.array_equal(rows, second[name][rank]), (name, rank)


def test_public_fallback_when_the_private_cudnn_binds_are_missing(monkeypatch):
    """Without jax's private cuDNN primitives, implementation='cudnn' falls back to public
    jax.nn.dot_product_attention with a mask (XLA's on the CPU), warning once what it costs."""
    monkeypatch.setattr(kernels, "cudnn_binds", lambda: None)
    monkeypatch.setattr(layer, "_warned_public_path", False)
    with pytest.warns(UserWarning, match="falls back to jax.nn.dot_product_attention"):
        _check(4, dtype=jnp.bfloat16, chunk=16, implementation="cudnn")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        _check(2, causal=False, dtype=jnp.bfloat16, chunk=16, implementation="cudnn")


def test_the_private_cudnn_binds_are_found_on_this_jax():
    """The fast path's dependency on jax internals: found on every supported jax (the CPU suite
    runs the newest, the GPU machine the oldest); a jax that changes them fails here first."""
    assert kernels.cudnn_binds() is not None, (
        f"jax {jax.__version__}: private cuDNN attention binds not found"
    )


def test_the_xla_kernels_clear_rows_that_see_no_key():
    q, k, v, ct = (jnp.asarray(x) for x in ac.random_inputs(8, batch=2, heads=2, kv_heads=1, seed=1))
    kv_len = jnp.array([0, 5], jnp.int32)
    out, lse = kernels.forward("xla", q, k, v, causal=False, scale=0.25, kv_len=kv_len)
    assert np.all(np.asarray(out[0]) == 0) and np.all(np.isneginf(np.asarray(lse[0])))
    ref = jax.nn.dot_product_attention(q[1:], k[1:, :5], v[1:, :5], scale=0.25)
    np.testing.assert_allclose(out[1:], ref, atol=1e-6)
    dq, dk, dv = kernels.backward("xla", q, k, v, out, lse, ct, causal=False, scale=0.25, kv_len=kv_len)
    assert not np.any(np.asarray(dq[0])) and not np.any(np.asarray(dk[1, 5:]))


def test_workspace_nbytes_helper():
    key = jax.ShapeDtypeStruct((2, 1024, 8, 128), jnp.bfloat16)
    assert cpg.attention_workspace_nbytes(key) == 2 * 2 * 1024 * 8 * 128 * 2


# -- bad input: a ValueError before anything runs -----------------------------------------------


def _trace(q_shape, k_shape, v_shape=None, *, n=2, dtype=jnp.float32, **kw):
    mesh = cp_mesh(n)
    spec = jax.sharding.PartitionSpec(None, "cp")
    body = lambda q, k, v: cpg.dot_product_attention(q, k, v, axis_name="cp", **kw)
    shapes = [jax.ShapeDtypeStruct(s, dtype) for s in (q_shape, k_shape, v_shape or k_shape)]
    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)).trace(*shapes)


@pytest.mark.parametrize(
    "args, kw, message",
    [
        (((1, 16, 6, 8), (1, 16, 4, 8)), {}, "multiple of the key/value heads"),
        (((1, 18, 4, 8), (1, 18, 2, 8)), {}, "must be even"),  # local length 9 per rank
        (((1, 16, 4, 8), (1, 16, 2, 16)), {}, "head dims differ"),
        (((1, 16, 4, 8), (1, 16, 2, 8), (1, 16, 2, 4)), {}, "same shape"),
        (((1, 16, 4, 8), (1, 8, 2, 8)), {}, "same batch and local length"),
        (((16, 4, 8), (16, 2, 8)), {}, "4 dimensions"),
        (((1, 16, 4, 8), (1, 16, 2, 8)), {"dtype": jnp.int32}, "float32, bfloat16 and float16"),
        (((1, 16, 4, 8), (1, 16, 2, 8)), {"implementation": "flash"}, "implementation must be"),
        (((1, 16, 4, 8), (1, 16, 2, 8)), {"implementation": "cudnn"}, "needs bfloat16 or float16"),
        (((1, 16, 4, 8), (1, 16, 2, 8)), {"workspace": workspace_spec(2, nbytes=1000)}, "needs 1024"),
        (((1, 16, 4, 8), (1, 16, 2, 8)), {"workspace": workspace_spec(4)}, "created for 4"),
    ],
)
def test_bad_input_is_a_value_error(args, kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _trace(*args, **kw)


def test_outside_shard_map_is_a_value_error():
    q = jnp.zeros((1, 16, 4, 8))
    k = jnp.zeros((1, 16, 2, 8))
    with pytest.raises(ValueError, match="not bound here"):
        cpg.dot_product_attention(q, k, k, axis_name="cp")
