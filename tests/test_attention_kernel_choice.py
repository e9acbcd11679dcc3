"""Which kernel the layer runs: the project's Pallas kernels only when asked for by name (not yet
measured on a GPU), refused off Hopper GPUs with what to use instead; the masked XLA kernel's
blockwise path for large calls gives the dense path's results."""

import jax.numpy as jnp
import numpy as np
import pytest

from attention_check import cp_layer, random_inputs, reference, relative_errors
from jax_cpgrad.attention import kernels, layer
from spmd import cp_mesh


def _query(dtype=jnp.bfloat16, head_dim=64):
    return jnp.zeros((1, 8, 4, head_dim), dtype)


def test_none_never_picks_a_kernel_marked_not_by_default():
    assert not kernels.by_name("mosaic").by_default
    for masked in (False, True):
        impl = layer._choose_implementation(None, jnp.bfloat16, 64, masked)
        assert impl != "mosaic"


@pytest.mark.parametrize("masked", [False, True])
def test_mosaic_off_hopper_is_a_value_error_naming_what_it_needs(masked):
    if kernels.mosaic.refuses(jnp.bfloat16, 64) is None:
        pytest.skip("this machine has a Hopper GPU: the kernel can run")
    with pytest.raises(
        ValueError, match=r"implementation='mosaic' needs a Hopper GPU \(compute capability 9.0\)"
    ):
        layer._choose_implementation("mosaic", jnp.bfloat16, 64, masked)


@pytest.mark.parametrize(
    ("dtype", "head_dim", "needs"),
    [
        (jnp.float32, 64, "bfloat16 or float16 inputs, got float32"),
        (jnp.bfloat16, 96, "a head dim of 64 or 128, got 96"),
    ],
)
def test_mosaic_refuses_dtypes_and_head_dims(dtype, head_dim, needs):
    assert kernels.mosaic.refuses(dtype, head_dim) == needs


def test_mosaic_runs_plain_attention_as_masked_calls():
    options = layer.Options(0.125, "mosaic", True, None, False, 1)
    plan = layer.schedule_config(options, 4, None, transfer_when_alone=False).plan
    assert plan.masked and plan.plain_as_masked
    calls = plan.calls(_query(), jnp.int32(1))
    assert all(call.vis is not None for call in (*calls.local, *calls.remote))


def test_masked_xla_kernel_takes_the_blockwise_path_beyond_the_dense_limit(monkeypatch):
    """The layer with documents and a window, its masked calls forced through blockwise.py, equals
    the unsharded attention (values and gradients), as the dense path does."""
    monkeypatch.setattr(kernels, "DENSE_SCORES_MAX", 0)
    n, seq = 2, 128
    ids = np.repeat(np.arange(4), seq // 4)[None]
    q, k, v, ct = random_inputs(seq, heads=2, kv_heads=1)
    want = reference(q, k, v, ct, segment_ids=ids, local_window_size=(40, 0))
    got = cp_layer(cp_mesh(n), (q, k, v, ct), dtype=jnp.float32, segment_ids=ids, local_window_size=(40, 0))
    errors = relative_errors(got, want)
    assert max(errors.values()) < 2e-5, errors
