"""The example model trained with CP on CPU devices matches the unsharded model."""

import dataclasses

import jax
import numpy as np
import pytest

from jax_cpgrad.example.cp_step import local_value, make_train_step, replicate, shard_batch
from jax_cpgrad.example.model import Config, init_params, reference_loss_and_grads, synthetic_batch
from spmd import cp_mesh

SMALL = Config(vocab=64, d_model=32, heads=2, d_head=16, layers=2, d_ff=64, seq_len=64, batch=2)
# float32: the CP model does the same per-row math, only sums run in another order (~1e-6).
# bfloat16: activations, K and V round to 8 bits; differences of a few 1e-3 are rounding noise.
TOL = {"float32": dict(rtol=2e-4, atol=2e-6), "bfloat16": dict(rtol=5e-2, atol=5e-4)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_cp_loss_and_gradients_match_unsharded(n, dtype):
    cfg = dataclasses.replace(SMALL, dtype=dtype)
    params = init_params(cfg, seed=1)
    tokens, targets = synthetic_batch(cfg, seed=2)
    with jax.default_device(jax.devices("cpu")[0]):  # on a GPU machine, keep TF32 matmuls out
        ref_loss, ref_grads = reference_loss_and_grads(params, tokens, targets, cfg)
    mesh = cp_mesh(n, "cpu")
    step = make_train_step(cfg, mesh)
    _, loss, grads = local_value(step(replicate(mesh, params), *shard_batch(mesh, tokens, targets)))
    np.testing.assert_allclose(loss, ref_loss, **TOL[dtype])
    for (path, g), r in zip(
        jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads), strict=True
    ):
        scale = float(np.max(np.abs(r))) or 1.0
        np.testing.assert_allclose(
            g, r, rtol=TOL[dtype]["rtol"], atol=TOL[dtype]["rtol"] * scale, err_msg=jax.tree_util.keystr(path)
        )


def test_training_reduces_the_loss():
    mesh = cp_mesh(4, "cpu")
    step = make_train_step(SMALL, mesh, lr=0.5)
    params = replicate(mesh, init_params(SMALL, seed=3))
    batch = shard_batch(mesh, *synthetic_batch(SMALL, seed=0))
    losses = []
    for _ in range(8):
        params, loss, _ = step(params, *batch)
        losses.append(float(local_value(loss)))
    assert losses[-1] < losses[0] * 0.9, losses
