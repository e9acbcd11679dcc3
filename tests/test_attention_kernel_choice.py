"""Which kernel the layer runs: for implementation=None cuDNN for plain calls, the project's
Pallas kernels for masked ones on Hopper GPUs, XLA elsewhere; the Pallas kernels refused off Hopper
GPUs with what to use instead; the masked XLA kernel's blockwise path for large calls gives the
dense path's results."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from attention_check import cp_layer, random_inputs, reference, relative_errors
from jax_cpgrad.attention import kernels, layer
from spmd import cp_mesh


def _query(dtype=jnp.bfloat16, head_dim=64):
    return jnp.zeros((1, 8, 4, head_dim), dtype)


def test_none_picks_the_pallas_kernels_for_masked_calls_where_they_run_and_xla_elsewhere(monkeypatch):
    if kernels.mosaic.refuses(jnp.bfloat16, 64) is None:
        pytest.skip("this machine has a Hopper GPU: see tests/test_gpu_attention.py")
    # Off Hopper (CI): the masked XLA kernel.
    assert layer._choose_implementation(None, jnp.bfloat16, 64, True) == "xla"
    # Where the Pallas kernels run (here: bfloat16 only), they take masked calls before XLA, and
    # XLA takes what they refuse.
    only_bf16 = lambda dtype, head_dim: None if dtype == jnp.bfloat16 else "bfloat16"
    monkeypatch.setattr(
        kernels,
        "KERNELS",
        tuple(
            dataclasses.replace(k, refuses=only_bf16) if k.name == "mosaic" else k for k in kernels.KERNELS
        ),
    )
    assert layer._choose_implementation(None, jnp.bfloat16, 64, True) == "mosaic"
    assert layer._choose_implementation(None, jnp.float32, 64, True) == "xla"


@pytest.mark.parametrize(
    "kw, want",
    [
        (dict(local_window_size=3), "cudnn"),  # under a chunk (4 of the rank's 8 tokens)
        (dict(local_window_size=100), "cudnn"),  # past the whole sequence
        (dict(local_window_size=(3, 2), is_causal=False), "xla"),  # two-sided
        (dict(local_window_size=3, segment_ids=np.zeros((1, 8), np.int32)), "xla"),  # documents
    ],
    ids=["causal_short", "causal_wide", "two_sided", "documents"],
)
def test_none_off_hopper_takes_cudnn_for_any_causal_window(monkeypatch, kw, want):
    """Where cuDNN runs and the Pallas kernels do not (a GPU other than Hopper), a causal window
    of any length without documents goes to cuDNN's plain calls, anything else masked to XLA."""
    if kernels.mosaic.refuses(jnp.bfloat16, 64) is None:
        pytest.skip("this machine has a Hopper GPU: None takes the Pallas kernels")
    runs = lambda dtype, head_dim: None
    monkeypatch.setattr(
        kernels,
        "KERNELS",
        tuple(dataclasses.replace(k, refuses=runs) if k.name == "cudnn" else k for k in kernels.KERNELS),
    )
    q = _query()
    options, _ = layer.prepare(
        q,
        q,
        q,
        scale=None,
        **{"is_causal": True, "segment_ids": None, **kw},
        implementation=None,
        head_groups=1,
    )
    assert options.impl == want


def test_cudnn_comes_before_the_pallas_kernels_for_plain_calls():
    names = [k.name for k in kernels.KERNELS if k.by_default]
    assert names.index("cudnn") < names.index("mosaic") < names.index("xla")


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
    ids = np.repeat(np.arange(4, dtype=np.int32), seq // 4)[None]
    q, k, v, ct = random_inputs(seq, heads=2, kv_heads=1)
    want = reference(q, k, v, ct, segment_ids=ids, local_window_size=(40, 0))
    got = cp_layer(cp_mesh(n), (q, k, v, ct), dtype=jnp.float32, segment_ids=ids, local_window_size=(40, 0))
    errors = relative_errors(got, want)
    assert max(errors.values()) < 2e-5, errors
