"""jax_cpgrad.models: the transformer trained with CP on CPU devices matches the unsharded model
(MHA and GQA, the config's implementation and head groups), and per-layer attention options reach
the attention."""

import dataclasses
import inspect

import jax
import numpy as np
import pytest

from jax_cpgrad import dot_product_attention
from jax_cpgrad.models.cp_train_step import local_value, make_train_step, replicate, shard_batch
from jax_cpgrad.models.transformer import (
    Config,
    forward_loss,
    init_params,
    layer_param_shapes,
    reference_loss_and_grads,
    synthetic_batch,
    unsharded_attention,
)
from spmd import cp_mesh

SMALL = Config(vocab=64, d_model=32, heads=2, d_head=16, layers=2, d_ff=64, seq_len=64, batch=2)
# float32: the CP model does the same per-row math, only sums run in another order (~1e-6).
# bfloat16: activations, K and V round to 8 bits; differences of a few 1e-3 are rounding noise.
TOL = {"float32": dict(rtol=2e-4, atol=2e-6), "bfloat16": dict(rtol=5e-2, atol=5e-4)}


def _check_against_unsharded(cfg, ranks, dtype):
    params = init_params(cfg, seed=1)
    batch = synthetic_batch(cfg, seed=2)  # tokens, targets (and segment ids with cfg.documents)
    with jax.default_device(jax.devices("cpu")[0]):  # on a GPU machine, keep TF32 matmuls out
        ref_loss, ref_grads = reference_loss_and_grads(params, *batch[:2], cfg, *batch[2:])
    mesh = cp_mesh(ranks, "cpu")
    step = make_train_step(cfg, mesh)
    _, loss, grads = local_value(step(replicate(mesh, params), *shard_batch(mesh, *batch)))
    np.testing.assert_allclose(loss, ref_loss, **TOL[dtype])
    for (path, g), r in zip(
        jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads), strict=True
    ):
        scale = float(np.max(np.abs(r))) or 1.0
        np.testing.assert_allclose(
            g, r, rtol=TOL[dtype]["rtol"], atol=TOL[dtype]["rtol"] * scale, err_msg=jax.tree_util.keystr(path)
        )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
def test_cp_loss_and_gradients_match_unsharded(ranks, dtype):
    _check_against_unsharded(dataclasses.replace(SMALL, dtype=dtype), ranks, dtype)


@pytest.mark.parametrize("kv_heads,head_groups", [(2, 1), (2, 2), (1, 1)], ids=["gqa", "gqa-groups", "mqa"])
def test_gqa_and_head_groups_match_unsharded(kv_heads, head_groups):
    cfg = dataclasses.replace(
        SMALL, heads=4, kv_heads=kv_heads, head_groups=head_groups, implementation="xla"
    )
    assert layer_param_shapes(cfg)["wk"][0] == (cfg.d_model, kv_heads * cfg.d_head)
    _check_against_unsharded(cfg, 4, "float32")


def test_the_config_checks_heads_and_groups():
    with pytest.raises(ValueError, match="must divide heads"):
        Config(heads=4, kv_heads=3)
    with pytest.raises(ValueError, match="must divide the 2 key/value heads"):
        Config(heads=4, kv_heads=2, head_groups=4)
    assert Config(heads=4).num_kv_heads == 4 and Config(heads=4).local_kv(2).shape == (2, 512, 4, 32)


def test_per_layer_attention_options_reach_the_attention_cycled_over_the_layers():
    """A config mixing sliding-window layers with global ones: each layer's options go, unchanged,
    to attend (the CP layer's or jax.nn.dot_product_attention's keywords)."""
    window = {"local_window_size": 16}
    cfg = dataclasses.replace(SMALL, layers=4, layer_attention=(window, window, {}))
    assert [cfg.attention_options(i) for i in range(4)] == [window, window, {}, window]
    seen = []

    def attend(q, k, v, **options):
        seen.append(options)
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, **options)

    tokens, targets = synthetic_batch(cfg, seed=0)
    windowed = forward_loss(init_params(cfg), tokens, targets, cfg, attend)
    assert seen == [window, window, {}, window]
    plain = forward_loss(
        init_params(cfg), tokens, targets, dataclasses.replace(cfg, layer_attention=()), attend
    )
    assert float(windowed) != float(plain)  # the window changed what the layers attend to


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


def test_a_cp_step_mixing_sliding_window_and_global_layers_matches_unsharded():
    if "local_window_size" not in inspect.signature(dot_product_attention).parameters:
        pytest.skip("the CP layer does not take local_window_size yet")
    window = {"local_window_size": 24}  # wider than a chunk (8 tokens at R = 4): crosses ranks
    cfg = dataclasses.replace(SMALL, layers=3, layer_attention=(window, {}))
    _check_against_unsharded(cfg, 4, "float32")


def test_a_cp_step_with_packed_documents_a_window_and_checkpointed_layers_matches_unsharded():
    """Documents of about 12 tokens (across chunks and ranks at R = 4), a window layer and a global
    one, each layer under jax.checkpoint with the masks kept: the unsharded model with the same
    document mask gets the same loss and gradients."""
    window = {"local_window_size": 10}
    cfg = dataclasses.replace(
        SMALL, kv_heads=1, layers=3, layer_attention=(window, {}), documents=12, remat=True
    )
    _check_against_unsharded(cfg, 4, "float32")
    mesh = cp_mesh(4, "cpu")
    batch = shard_batch(mesh, *synthetic_batch(cfg, seed=2))
    text = str(jax.make_jaxpr(make_train_step(cfg, mesh))(replicate(mesh, init_params(cfg)), *batch))
    # jax.checkpoint: "remat2" in a differentiated jaxpr (its forward and its recomputation)
    assert text.count("remat2[") >= cfg.layers and "name=jax_cpgrad_masks" in text


def test_the_step_takes_a_batch_with_or_without_segment_ids():
    """The step's arity follows the batch, not the config: ids of one document each row give the
    plain causal step's loss; four arrays are refused."""
    mesh = cp_mesh(2, "cpu")
    step = make_train_step(SMALL, mesh)
    params = replicate(mesh, init_params(SMALL))
    tokens, targets = synthetic_batch(SMALL, seed=0)
    one_document = np.zeros_like(tokens)
    plain = local_value(step(params, *shard_batch(mesh, tokens, targets))[1])
    packed = local_value(step(params, *shard_batch(mesh, tokens, targets, one_document))[1])
    np.testing.assert_allclose(packed, plain, rtol=1e-6)
    with pytest.raises(ValueError, match="got 4 batch arrays"):
        step(params, *shard_batch(mesh, tokens, targets, one_document, one_document))


def test_synthetic_documents_reach_every_layer():
    """synthetic_batch's segment ids: increasing from 0, documents of about the length asked; the
    loss with them differs from the loss without (each layer's attention stays in its document)."""
    cfg = dataclasses.replace(SMALL, documents=8)
    tokens, targets, ids = synthetic_batch(cfg, seed=0)
    assert ids.shape == tokens.shape and ids.dtype == np.int32
    assert (ids[:, 0] == 0).all() and (np.diff(ids, axis=1) >= 0).all()
    assert 3 < cfg.seq_len / (ids[:, -1].mean() + 1) < 20  # about 8 tokens a document
    seen = []

    def attend(q, k, v, **options):
        seen.append(sorted(options))
        return unsharded_attention(q, k, v, **options)

    params = init_params(cfg)
    packed = forward_loss(params, tokens, targets, cfg, attend, ids)
    assert seen == [["segment_ids"]] * cfg.layers
    assert float(packed) != float(forward_loss(params, tokens, targets, cfg, attend))


def test_the_config_checks_the_documents_length():
    with pytest.raises(ValueError, match="documents=0 must be a positive length"):
        Config(documents=0)
