"""Where a CP rank's attention time goes: each kernel call of a rank (fwd + bwd) timed alone
against its ideal (the unsharded causal call's time times the call's share of the causal work),
beside the whole rank through the layer; and candidate regroupings of the remote part. The calls
are those of the layer before its paired/far layout (one remote call per query chunk); this
sweep is what showed the costs that layout removes: the backward of an entry with no key walking
every query row (rank 0), and the run-time key count's cost on the largest call.

Calls of rank r (chunks r and 2N-1-r, c tokens each; S = 2Nc gathered keys):
  local        both chunks against their own keys, causal, folded into the batch   (c^2 pairs)
  lo padded    chunk r against the gathered keys, key count r*c at run time         (r c^2)
  hi padded    chunk 2N-1-r, key count (2N-1-r)c at run time                        ((2N-1-r) c^2)
  hi static    the same with the keys sliced to (2N-1-r)c beforehand, no mask
  both padded  both chunks (2c rows, the rank's queries as they are) against the first r*c keys
  rest static  chunk 2N-1-r against keys [rc, (2N-1-r)c), sliced beforehand, no mask

    python benchmarks/sweeps/attention_rank_calls.py   # benchmarks/results/h200_attention_rank_calls.log
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from attention import fwd_bwd, inputs, seconds  # noqa: E402

from jax_cpgrad.attention import kernels, rank_without_transfer  # noqa: E402
from jax_cpgrad.attention.plan import fold  # noqa: E402

SCALE = 128**-0.5


IMPL = "cudnn" if jax.default_backend() == "gpu" else "xla"  # xla: a smoke run on the CPU


def call(causal: bool):
    """jit(q, k, v, do, kv_len) -> one forward and backward of the layer's kernels."""

    def f(q, k, v, do, kv_len):
        out, lse = kernels.forward(IMPL, q, k, v, causal=causal, scale=SCALE, kv_len=kv_len)
        return kernels.backward(IMPL, q, k, v, out, lse, do, causal=causal, scale=SCALE, kv_len=kv_len)

    return jax.jit(f)


def main():
    heads, head_dim, iters, reps = 32, 128, 5, 3
    padded, causal = call(False), call(True)
    grid = ((16384, 2, 8), (16384, 2, 32), (16384, 8, 8), (16384, 8, 32), (32768, 4, 32))
    if IMPL == "xla":
        heads, head_dim, iters, reps, grid = 4, 16, 1, 1, ((256, 2, 2), (256, 4, 4))
    for seq, n, kv_heads in grid:
        c = seq // (2 * n)
        full = inputs(seq, heads, kv_heads, head_dim)
        unsharded = fwd_bwd(
            lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=IMPL)
        )
        t_full = seconds(unsharded, full, iters, reps) * 1e3
        ideal = lambda pairs, t_full=t_full, seq=seq: t_full * pairs / (seq * seq / 2)
        print(
            f"S={seq} N={n} KV={kv_heads} c={c}: unsharded {t_full:.3f} ms, a rank's share {t_full / n:.3f}",
            flush=True,
        )
        q_full, k_glob, v_glob, _ = full
        local = inputs(2 * c, heads, kv_heads, head_dim, seed=n)
        layer = fwd_bwd(
            lambda q, k, v, rank, n=n: rank_without_transfer(q, k, v, rank, n, implementation=IMPL)
        )
        for r in sorted({0, n - 1}):
            q = q_full[:, r * c : r * c + c]
            q = jnp.concatenate([q, q_full[:, (2 * n - 1 - r) * c : (2 * n - r) * c]], axis=1)
            do = jnp.ones_like(q)
            lo, hi = q[:, :c], q[:, c:]
            kv = lambda count, c=c: jnp.full((1,), count * c, jnp.int32)
            hi_len = 2 * n - 1 - r
            rows = [("local", causal, (fold(q), fold(local[1]), fold(local[2]), fold(do), None), c * c)]
            if r:
                rows.append(("lo padded", padded, (lo, k_glob, v_glob, do[:, :c], kv(r)), r * c * c))
                rows.append(("both padded", padded, (q, k_glob, v_glob, do, kv(r)), 2 * r * c * c))
                rest = slice(r * c, hi_len * c)
                rows.append(
                    (
                        "rest static",
                        padded,
                        (hi, k_glob[:, rest], v_glob[:, rest], do[:, c:], None),
                        (hi_len - r) * c * c,
                    )
                )
            rows.append(("hi padded", padded, (hi, k_glob, v_glob, do[:, c:], kv(hi_len)), hi_len * c * c))
            pre = slice(0, hi_len * c)
            rows.append(
                ("hi static", padded, (hi, k_glob[:, pre], v_glob[:, pre], do[:, c:], None), hi_len * c * c)
            )
            t_layer = seconds(layer, (*local, jnp.int32(r)), iters, reps) * 1e3
            parts = []
            for name, f, args, pairs in rows:
                t = seconds(f, args, iters, reps) * 1e3
                parts.append((name, t))
                best = ideal(pairs)
                print(
                    f"  rank {r}: {name:12s} {t:7.3f} ms  ideal {best:7.3f}  ratio {t / best:5.2f}",
                    flush=True,
                )
            t = dict(parts)
            now = t["local"] + t.get("lo padded", 0.0) + t["hi padded"]
            print(
                f"  rank {r}: layer {t_layer:.3f} ms ({n * t_layer / t_full:.2f}); its calls alone {now:.3f}"
                f" ({n * now / t_full:.2f}); overhead {t_layer - now:.3f} ms",
                flush=True,
            )
            if r:
                regroup = t["local"] + t["both padded"] + t["rest static"]
                print(
                    f"  rank {r}: local + both padded + rest static {regroup:.3f}"
                    f" ({n * regroup / t_full:.2f})",
                    flush=True,
                )


if __name__ == "__main__":
    main()
