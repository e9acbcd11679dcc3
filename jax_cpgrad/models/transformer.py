"""A causal transformer (token embedding, attention + MLP layers, next-token loss), configurable.

The same functions run unsharded on one device (the reference) and inside ``shard_map`` on one CP
rank's tokens with ``jax_cpgrad.dot_product_attention`` (``cp_train_step.py``): only the attention
differs, passed in as ``attend``. The demo, the example script, the tests and the training-step
benchmark (``benchmarks/cp_step.py``, which times the layers alone) all build this one model.

Shapes follow ``jax.nn.dot_product_attention``: B batch, T tokens, N query heads, K key/value
heads (K = N: MHA; K < N dividing N: GQA), H the head dimension. Parameters are float32 master
weights, used in ``Config.dtype``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..attention import masks_checkpoint_policy
from ..attention.masks import run_ids

# attend(q [B, T, N, H], k [B, T, K, H], v [B, T, K, H], **layer options) -> [B, T, N, H]
Attend = Callable[..., jax.Array]


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 256
    d_model: int = 128
    heads: int = 4  # N, query heads
    d_head: int = 32  # H
    layers: int = 2
    d_ff: int = 256
    seq_len: int = 1024  # S, the global sequence
    batch: int = 2
    dtype: str = "float32"  # activations, K and V; parameters and the loss stay float32
    kv_heads: int | None = None  # K; None: K = N (MHA)
    implementation: str | None = None  # the CP layer's kernels: None (its choice), "cudnn", "xla"
    head_groups: int = 1  # the CP layer's transfer pipelined over this many groups of K/V heads
    # Per layer, extra keyword arguments for the attention, cycled over the layers: () or ({},)
    # gives every layer the default (global causal); ({"local_window_size": 1024},) * 3 + ({},)
    # makes three sliding-window layers and one global, repeated. Passed through unchanged to the
    # CP layer and to the unsharded reference (jax.nn.dot_product_attention), so an option works
    # here as soon as the layer takes it.
    layer_attention: tuple[Mapping[str, Any], ...] = ()
    # Packed documents in the synthetic data: ``synthetic_batch`` cuts each row into documents of
    # about this many tokens (random lengths) and returns their segment ids too, which the step and
    # the reference take (any ids do: the step takes a batch with or without them). None: each row
    # is one sequence.
    documents: int | None = None
    # Each layer under ``jax.checkpoint`` (recomputed in the backward), with the policy that keeps
    # the CP layer's masks (``jax_cpgrad.masks_checkpoint_policy``).
    remat: bool = False

    def __post_init__(self):
        k = self.num_kv_heads
        if k < 1 or self.heads % k:
            raise ValueError(f"kv_heads={self.kv_heads} must divide heads={self.heads}")
        if self.head_groups < 1 or k % self.head_groups:
            raise ValueError(f"head_groups={self.head_groups} must divide the {k} key/value heads")
        if self.documents is not None and self.documents < 1:
            raise ValueError(f"documents={self.documents} must be a positive length, or None")
        object.__setattr__(self, "layer_attention", tuple(dict(o) for o in self.layer_attention))

    @property
    def num_kv_heads(self) -> int:
        """K: ``kv_heads``, or N where it is None."""
        return self.heads if self.kv_heads is None else self.kv_heads

    def attention_options(self, layer: int) -> dict[str, Any]:
        """The extra keyword arguments of layer ``layer``'s attention (a copy)."""
        if not self.layer_attention:
            return {}
        return dict(self.layer_attention[layer % len(self.layer_attention)])

    def local_kv(self, ranks: int) -> jax.ShapeDtypeStruct:
        """One layer's K (or V) on one rank of ``ranks``: ``[B, S/R, K, H]`` in ``dtype``."""
        shape = (self.batch, self.seq_len // ranks, self.num_kv_heads, self.d_head)
        return jax.ShapeDtypeStruct(shape, jnp.dtype(self.dtype))


def layer_param_shapes(cfg: Config) -> dict[str, tuple[tuple[int, ...], float | None]]:
    """One layer's parameters: name -> (shape, scale of its normal init; None: ones)."""
    d, q, kv = cfg.d_model, cfg.heads * cfg.d_head, cfg.num_kv_heads * cfg.d_head
    return {
        "norm1": ((d,), None),
        "wq": ((d, q), d**-0.5),
        "wk": ((d, kv), d**-0.5),
        "wv": ((d, kv), d**-0.5),
        "wo": ((q, d), q**-0.5),
        "norm2": ((d,), None),
        "w1": ((d, cfg.d_ff), d**-0.5),
        "w2": ((cfg.d_ff, d), cfg.d_ff**-0.5),
    }


def init_params(cfg: Config, seed: int = 0) -> dict:
    """{"embed": [vocab, d_model], "layers": [per layer {name: array}], "norm_f"}, float32, drawn on
    the host (``layer_param_shapes`` gives the shapes, for a model too large for that)."""
    rng = np.random.default_rng(seed)

    def make(shape, scale):
        if scale is None:
            return jnp.ones(shape, jnp.float32)
        return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)

    embed = make((cfg.vocab, cfg.d_model), cfg.d_model**-0.5)
    layers = [
        {name: make(*spec) for name, spec in layer_param_shapes(cfg).items()} for _ in range(cfg.layers)
    ]
    return {"embed": embed, "layers": layers, "norm_f": jnp.ones((cfg.d_model,), jnp.float32)}


def synthetic_batch(cfg: Config, seed: int):
    """Token rows that follow t[i+1] = (t[i] + stride) mod vocab: learnable from the context.
    ``(tokens, targets)``, and with ``cfg.documents`` their segment ids too (int32 ``[B, S]``,
    increasing: documents of random lengths, ``cfg.documents`` tokens on average)."""
    rng = np.random.default_rng(seed)
    start = rng.integers(0, cfg.vocab, size=(cfg.batch, 1))
    stride = rng.integers(1, 8, size=(cfg.batch, 1))
    tokens = (start + stride * np.arange(cfg.seq_len + 1)) % cfg.vocab
    batch = tokens[:, :-1].astype(np.int32), tokens[:, 1:].astype(np.int32)  # inputs, targets
    if cfg.documents is None:
        return batch
    # a document starts at each token with probability 1 / documents (the first always)
    starts = rng.random((cfg.batch, cfg.seq_len)) < 1 / cfg.documents
    starts[:, 0] = True
    return (*batch, np.cumsum(starts, axis=1, dtype=np.int32) - 1)


def rms_norm(x, scale):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6) * scale).astype(x.dtype)


def unsharded_attention(q, k, v, segment_ids=None, **options):
    """Causal attention of the whole sequence on one device (``[B, S, N, H]``, K/V at K heads);
    with ``segment_ids`` (``[B, S]``, each document one run of equal ids, as the CP layer takes
    them) within each document."""
    runs = None if segment_ids is None else run_ids(segment_ids)
    mask = None if runs is None else (runs[:, :, None] == runs[:, None, :])[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, **options)


def apply_layers(
    layers: Sequence[Mapping],
    x,
    cfg: Config,
    attend: Attend,
    kv_probes: Sequence | None = None,
    segment_ids=None,
):
    """The stack of layers on hidden states ``x [B, T, d_model]`` (in ``cfg.dtype``): per layer
    RMSNorm, Q/K/V projections, ``attend(q, k, v, **cfg.attention_options(i))``, output
    projection, residual, RMSNorm, GELU MLP, residual; each under ``jax.checkpoint`` with
    ``cfg.remat``.

    kv_probes: per layer (pk, pv) ``[B, T, K, H]`` added to K and V after their projection; with
    zeros, their gradients are dK/dV as the owners of these tokens receive them (the benchmark's
    precision mode). None: nothing added. segment_ids: ``[B, T]``, passed to every ``attend`` as
    its ``segment_ids``; None: not passed.
    """
    dt = jnp.dtype(cfg.dtype)
    b, t, _ = x.shape
    project = lambda h, w, heads: (h @ w.astype(dt)).reshape(b, t, heads, cfg.d_head)
    documents = {} if segment_ids is None else {"segment_ids": segment_ids}

    def layer(i: int, p, x, probes):
        h = rms_norm(x, p["norm1"])
        q = project(h, p["wq"], cfg.heads)
        k, v = project(h, p["wk"], cfg.num_kv_heads), project(h, p["wv"], cfg.num_kv_heads)
        if probes:
            k, v = k + probes[0], v + probes[1]
        attended = attend(q, k, v, **documents, **cfg.attention_options(i))
        x = x + attended.reshape(b, t, -1) @ p["wo"].astype(dt)
        h = rms_norm(x, p["norm2"])
        return x + jax.nn.gelu(h @ p["w1"].astype(dt)) @ p["w2"].astype(dt)

    for i, p in enumerate(layers):
        step: Callable[..., Any] = functools.partial(layer, i)
        if cfg.remat:  # the CP layer's masks kept for the backward, the rest recomputed
            step = jax.checkpoint(step, policy=masks_checkpoint_policy())
        x = step(p, x, kv_probes[i] if kv_probes else ())
    return x


def forward_loss(params, tokens, targets, cfg: Config, attend: Attend, segment_ids=None):
    """Summed next-token cross-entropy of the given (local) tokens.

    attend(q, k, v, **options) -> [B, T, N, H]: causal attention; unsharded on one device, or
    ``jax_cpgrad.dot_product_attention`` on one CP rank's tokens. segment_ids: the tokens'
    documents (``synthetic_batch``'s, in the tokens' layout), or None.
    """
    x = params["embed"][tokens].astype(jnp.dtype(cfg.dtype))
    x = apply_layers(params["layers"], x, cfg, attend, segment_ids=segment_ids)
    logits = rms_norm(x, params["norm_f"]).astype(jnp.float32) @ params["embed"].T
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.sum(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def reference_loss_and_grads(params, tokens, targets, cfg: Config, segment_ids=None):
    """The unsharded model on one device: mean loss and its gradients (``segment_ids``: the
    documents of ``synthetic_batch`` with ``cfg.documents``, else None)."""

    def mean_loss(p):
        return forward_loss(p, tokens, targets, cfg, unsharded_attention, segment_ids) / tokens.size

    return jax.value_and_grad(mean_loss)(params)
