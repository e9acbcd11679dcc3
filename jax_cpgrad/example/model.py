"""A small causal transformer (token embedding, attention + MLP blocks, next-token loss).

The same functions run unsharded on one device (the reference) and inside ``shard_map`` on one CP
rank's tokens with ``jax_cpgrad.dot_product_attention`` (cp_step.py): only the attention differs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 256
    d_model: int = 128
    heads: int = 4
    d_head: int = 32
    layers: int = 2
    d_ff: int = 256
    seq_len: int = 1024
    batch: int = 2
    dtype: str = "float32"  # activations, K and V; parameters and the loss stay float32


def init_params(cfg: Config, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    normal = lambda *shape, scale: jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)
    hd = cfg.heads * cfg.d_head
    layer = lambda: {
        "norm1": jnp.ones((cfg.d_model,), jnp.float32),
        "wq": normal(cfg.d_model, hd, scale=cfg.d_model**-0.5),
        "wk": normal(cfg.d_model, hd, scale=cfg.d_model**-0.5),
        "wv": normal(cfg.d_model, hd, scale=cfg.d_model**-0.5),
        "wo": normal(hd, cfg.d_model, scale=hd**-0.5),
        "norm2": jnp.ones((cfg.d_model,), jnp.float32),
        "w1": normal(cfg.d_model, cfg.d_ff, scale=cfg.d_model**-0.5),
        "w2": normal(cfg.d_ff, cfg.d_model, scale=cfg.d_ff**-0.5),
    }
    return {
        "embed": normal(cfg.vocab, cfg.d_model, scale=cfg.d_model**-0.5),
        "layers": [layer() for _ in range(cfg.layers)],
        "norm_f": jnp.ones((cfg.d_model,), jnp.float32),
    }


def synthetic_batch(cfg: Config, seed: int):
    """Token rows that follow t[i+1] = (t[i] + stride) mod vocab: learnable from the context."""
    rng = np.random.default_rng(seed)
    start = rng.integers(0, cfg.vocab, size=(cfg.batch, 1))
    stride = rng.integers(1, 8, size=(cfg.batch, 1))
    tokens = (start + stride * np.arange(cfg.seq_len + 1)) % cfg.vocab
    return tokens[:, :-1].astype(np.int32), tokens[:, 1:].astype(np.int32)  # inputs, targets


def _rms_norm(x, scale):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6) * scale).astype(x.dtype)


def unsharded_attention(q, k, v):
    """Causal attention of the whole sequence on one device ([B, S, H, Dh])."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def forward_loss(params, tokens, targets, cfg: Config, attend):
    """Summed next-token cross-entropy of the given (local) tokens.

    attend(q, k, v) -> [B, S, H, Dh]: causal attention; unsharded on one device, or
    ``jax_cpgrad.dot_product_attention`` on one CP rank's tokens.
    """
    dt = jnp.dtype(cfg.dtype)
    x = params["embed"][tokens].astype(dt)
    b, s, _ = x.shape
    for layer in params["layers"]:
        h = _rms_norm(x, layer["norm1"])
        q, k, v = ((h @ layer[w].astype(dt)).reshape(b, s, cfg.heads, cfg.d_head) for w in ("wq", "wk", "wv"))
        x = x + attend(q, k, v).reshape(b, s, -1) @ layer["wo"].astype(dt)
        h = _rms_norm(x, layer["norm2"])
        x = x + jax.nn.gelu(h @ layer["w1"].astype(dt)) @ layer["w2"].astype(dt)
    logits = _rms_norm(x, params["norm_f"]).astype(jnp.float32) @ params["embed"].T
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.sum(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def reference_loss_and_grads(params, tokens, targets, cfg: Config):
    """The unsharded model on one device: mean loss and its gradients."""

    def mean_loss(p):
        return forward_loss(p, tokens, targets, cfg, unsharded_attention) / tokens.size

    return jax.value_and_grad(mean_loss)(params)
