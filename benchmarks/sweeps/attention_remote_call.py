"""One remote call of the CP attention layer (c queries against the (2N-1)c keys of rank 0's far
chunk), fwd + bwd through the layer's cuDNN kernels, four ways side by side: the key count a run-time
value (padding mask over all S gathered keys, as the layer must: shapes are the same on every rank)
or static (no mask, the keys sliced beforehand, outside the timing); the G query heads of a key head
as heads (GQA) or folded into G x c rows of one head. Each against its ideal: the unsharded causal
call's time times the call's share of the causal work, (2N-1) / (2N^2).

    python benchmarks/sweeps/attention_remote_call.py   # benchmarks/results/h200_attention_remote_call.log
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from attention import fwd_bwd, seconds  # noqa: E402

from jax_cpgrad.attention import kernels  # noqa: E402


def bench(f, *args):
    """Milliseconds per call: the best of 5 runs of 10 calls (benchmarks/attention.py's timer)."""
    return seconds(f, args, iters=10, reps=5) * 1e3


def call(fold_heads, static):
    def f(q, k, v, do, kv_len):
        kl = None if static else kv_len
        qf, dof = (kernels._fold_groups(q, k), kernels._fold_groups(do, k)) if fold_heads else (q, do)
        o, lse = kernels._cudnn_forward(qf, k, v, causal=False, scale=0.1, kv_len=kl)
        dq, dk, dv = kernels._cudnn_backward(qf, k, v, o, lse, dof, causal=False, scale=0.1, kv_len=kl)
        return dq, dk, dv, o

    return jax.jit(f)


for S, n, hk in ((16384, 8, 8), (16384, 8, 32), (32768, 8, 8), (16384, 4, 8)):
    c = S // (2 * n)
    h, d = 32, 128
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (1, c, h, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (1, S, hk, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (1, S, hk, d), jnp.bfloat16)
    do = jax.random.normal(ks[3], (1, c, h, d), jnp.bfloat16)
    L = (2 * n - 1) * c
    kv_len = jnp.full((1,), L, jnp.int32)
    res = {}
    for fold in (False, True):
        if fold and hk == h:
            continue
        for static in (False, True):
            kk, vv = (k[:, :L], v[:, :L]) if static else (k, v)
            res[(fold, static)] = bench(call(fold, static), q, kk, vv, do, kv_len)
    # the causal share: unsharded causal attention of S tokens, fwd+bwd, /(2N) per query chunk... and the
    # ideal of this call: (2N-1) c x c blocks of the S^2/2 causal work
    qs = jax.random.normal(ks[0], (1, S, h, d), jnp.bfloat16)
    kss = jax.random.normal(ks[1], (1, S, hk, d), jnp.bfloat16)
    full = fwd_bwd(
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    )
    t_full = bench(full, qs, kss, kss, qs)
    ideal = t_full * (2 * n - 1) / (2 * n * n)  # (2N-1) of the S^2/2 / c^2 = 2N^2 blocks
    line = " ".join(
        f"{'fold' if f else 'gqa '}{'/static' if s else '/padded'} {t:.3f} ({t / ideal:.2f})"
        for (f, s), t in res.items()
    )
    print(f"S={S} n={n} hk={hk} c={c}: ideal {ideal:.3f} ms | {line}", flush=True)
