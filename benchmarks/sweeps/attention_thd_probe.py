"""Probe: a rank's remote attention as two packed (THD) segments of one cuDNN call, through jax's
private binds: the query row is the rank's two chunks, the keys are [one spare row, chunk r's
prefix, chunk 2N-1-r's prefix] (half the rows of the stacked call), q/kv offsets and lengths at
run time. Checks the output, which layout the softmax stats come in, and the backward. On an H200
with jax 0.11.2 and cuDNN 9.19 every shape tried faulted (CUDA_ERROR_ILLEGAL_ADDRESS,
benchmarks/results/h200_attention_thd_probe.log), so the layer does not use it.

    python benchmarks/sweeps/attention_thd_probe.py B N C R H HK   # one shape; each in its own process
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.cudnn import fused_attention_stablehlo as fas

from jax_cpgrad.attention import kernels

F32 = jnp.float32
print("jax", jax.__version__, jax.devices()[0].device_kind, "cudnn", fas.check_cudnn_version(), flush=True)
_, extra = kernels.cudnn_binds()


def params(mask):
    return kernels.cudnn_params(fas, mask, 0.125)


def packed_ops(q, k, q_off, q_len, kv_off, kv_len):
    unused = jnp.zeros((0,), q.dtype)
    qs, ks, qo, ko = fas._fix_seqlen_offsets(q_len, kv_len, q_off, kv_off, q, k)
    return (unused, qs, ks, qo, ko, unused, unused)


def fwd(q, k, v, *seg, mask=fas.MaskType.PADDING):
    ops = packed_ops(q, k, *seg)
    return fas._dot_product_attention_fwd_p_wrapper.bind(
        q, k, v, *ops, is_training=True, **params(mask), **extra
    )


def bwd(q, k, v, o, lse, do, *seg, mask=fas.MaskType.PADDING):
    ops = packed_ops(q, k, *seg)
    return fas._dot_product_attention_bwd_p_wrapper.bind(q, k, v, *ops, lse, o, do, **params(mask), **extra)


def segments(b, n, c, r):
    """q row = [chunk r, chunk 2n-1-r]; packed K = [one spare row, short prefix (r chunks), long
    prefix]; at r = 0 the empty segment reads the spare row."""
    q_off = jnp.tile(jnp.array([[0, c, -1]], jnp.int32), (b, 1))
    q_len = jnp.tile(jnp.array([[c, c]], jnp.int32), (b, 1))
    short, long_ = r * c, (2 * n - 1 - r) * c
    kv_off = jnp.tile(jnp.array([[0 if r == 0 else 1, 1 + short, -1]], jnp.int32), (b, 1))
    kv_len = jnp.tile(jnp.array([[max(short, 1), long_]], jnp.int32), (b, 1))
    return q_off, q_len, kv_off, kv_len


def reference(q, kp, vp, b, n, c, r):
    """f32 (out [B,2c,H,D], lse [B,H,2c]) and a vjp fn; the empty segment clamped to its 1 key."""
    short, long_ = r * c, (2 * n - 1 - r) * c
    pieces = [(q[:, :c], (0 if r == 0 else 1), max(short, 1)), (q[:, c:], 1 + short, long_)]

    def f(q, kp, vp):
        outs, lses = [], []
        for i, (_, off, ln) in enumerate(pieces):
            qq = q[:, i * c : (i + 1) * c]
            o, lse = kernels._xla_forward(
                qq.astype(F32),
                kp[:, off : off + ln].astype(F32),
                vp[:, off : off + ln].astype(F32),
                causal=False,
                scale=0.125,
            )
            outs.append(o)
            lses.append(lse)
        return jnp.concatenate(outs, 1), jnp.concatenate(lses, -1)

    return f


def err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))


def check(b, n, c, r, h, hk, d=128):
    ks = jax.random.split(jax.random.key(r), 4)
    q = jax.random.normal(ks[0], (b, 2 * c, h, d), jnp.bfloat16)
    L = (2 * n - 1) * c + 1
    kp = jax.random.normal(ks[1], (b, L, hk, d), jnp.bfloat16)
    vp = jax.random.normal(ks[2], (b, L, hk, d), jnp.bfloat16)
    do = jax.random.normal(ks[3], (b, 2 * c, h, d), jnp.bfloat16)
    seg = segments(b, n, c, r)
    out, stats = jax.jit(fwd)(q, kp, vp, *seg)
    ref = reference(q, kp, vp, b, n, c, r)
    (o_ref, l_ref), vjp = jax.vjp(ref, q.astype(F32), kp.astype(F32), vp.astype(F32))
    print(
        f"b={b} n={n} c={c} r={r} h={h}/{hk}: stats shape {stats.shape} out err {err(out, o_ref):.2e}",
        flush=True,
    )
    st = np.asarray(stats).reshape(b, 2, h, 2 * c)
    lr = np.asarray(l_ref).reshape(b, h, 2 * c)
    rel = np.concatenate([st[:, 0, :, :c], st[:, 1, :, :c]], -1)  # segment m at rows 0..c of its slot
    ab = np.concatenate([st[:, 0, :, :c], st[:, 1, :, c:]], -1)  # segment m at its absolute rows
    print(
        f"  stats relative err {np.max(np.abs(rel - lr)):.3e}  absolute err {np.max(np.abs(ab - lr)):.3e}",
        flush=True,
    )
    for name, cand in (("relative", rel), ("absolute", ab)):
        if np.max(np.abs(cand - lr)) > 1e-2:
            continue
        grads_ref = vjp((do.astype(F32), jnp.zeros_like(l_ref)))
        dq, dk, dv = jax.jit(bwd)(q, kp, vp, out, stats, do, *seg)
        # the spare row (first) is garbage: compare the real rows
        pairs = zip((dk, dv), grads_ref[1:], strict=True)
        errs = [err(dq, grads_ref[0])] + [err(g[:, 1:], r[:, 1:]) for g, r in pairs]
        print(f"  bwd with the {name} stats: dq {errs[0]:.2e} dk {errs[1]:.2e} dv {errs[2]:.2e}", flush=True)


if __name__ == "__main__":
    b, n, c, r, h, hk = map(int, sys.argv[1:7])
    check(b, n, c, r, h, hk)


# speed: stacked (today's remote call) vs packed, fwd+bwd, one rank r of n at S
