"""Is the layer's overlap window long enough, and would pipelining by head groups pay?

Backs the layer's ``head_groups`` option and its default of 1 (experiments/README.md; results:
"The overlap window and head-group pipelining"). Live: rerun it, with a measured transfer, once
several GPUs are available.

The layer hides its K/V gather behind the local part's forward (each rank's diagonal blocks) and
its dK/dV return behind the local part's backward. On one GPU the transfer cannot be timed, so
this sweep times the windows and projects the transfer from its bytes and a measured peer
bandwidth (--gbps; default 358 GB/s out of each GPU: 2 H200s on NVLink, a 1 GiB dK + dV
return at R = 2 in 2995 us, README). Per rank of R: the gather receives and the return sends
(R-1)/R of the keys and values, 2 x S x K x H x 2 bytes.

Pipelining by G head groups would expose about a G-th of the transfer instead (the first group's,
less the window; each later group's hides behind the previous group's remote part, which is
longer) but splits every remote kernel call G ways. This times that cost too: the rank's whole
attention (``rank_without_transfer``) with ``head_groups`` 1 and G (the layer's pipeline, the
transfers replaced by local copies). Exposed now = max(0, transfer - window), per pass; with G
groups = max(0, transfer/G - window) + the pipeline's extra compute. (The transfer's share of
the SMs while it overlaps, and a measured multi-GPU transfer, are not in this projection.)

    python experiments/attention_overlap_window.py   # one H200: a few minutes
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# benchmarks/attention.py's readings and inputs, so that both read a rank the same way
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from attention import fwd_bwd, human_tokens, inputs, parse_tokens, seconds  # noqa: E402

from jax_cpgrad.attention import kernels, rank_without_transfer  # noqa: E402
from jax_cpgrad.attention.plan import fold  # noqa: E402

IMPL = "cudnn" if jax.default_backend() == "gpu" else "xla"  # xla: a smoke run on the CPU


def local_part_seconds(q, k, v, opts) -> tuple[float, float]:
    """(forward, backward) of the causal local part alone: the two diagonal blocks, folded."""
    scale = q.shape[-1] ** -0.5
    operands = tuple(fold(x) for x in (q, k, v))
    forward = jax.jit(lambda q, k, v: kernels.forward(IMPL, q, k, v, causal=True, scale=scale))
    out, lse = forward(*operands)

    def backward(q, k, v, out, lse, do):
        return kernels.backward(IMPL, q, k, v, out, lse, do, causal=True, scale=scale)

    t_fwd = seconds(forward, operands, opts.iters, opts.reps)
    t_bwd = seconds(jax.jit(backward), (*operands, out, lse, out), opts.iters, opts.reps)
    return t_fwd, t_bwd


def in_head_groups(groups: int, ranks: int):
    """fwd+bwd of the rank's attention with the transfer pipelined over ``groups`` head groups (the
    layer's ``head_groups``: every remote kernel call split that many ways)."""
    return fwd_bwd(
        lambda q, k, v, rank: rank_without_transfer(
            q, k, v, rank, ranks, implementation=IMPL, head_groups=groups
        )
    )


def measure(seq: int, kv_heads: int, n: int, opts) -> dict:
    c = seq // (2 * n)
    q, k, v, ct = inputs(seq // n, opts.heads, kv_heads, opts.head_dim, seed=n)
    window_fwd, window_bwd = local_part_seconds(q, k, v, opts)
    rank = jnp.int32(n - 1)
    t_groups = {
        g: seconds(in_head_groups(g, n), (q, k, v, ct, rank), opts.iters, opts.reps)
        for g in opts.groups
        if kv_heads % g == 0
    }
    nbytes = (n - 1) / n * 2 * seq * kv_heads * opts.head_dim * 2
    transfer = nbytes / (opts.gbps * 1e9)
    exposed = max(0.0, transfer - window_fwd) + max(0.0, transfer - window_bwd)
    ms = lambda t: round(t * 1e3, 4)
    row = dict(
        seq=seq, kv_heads=kv_heads, n=n, chunk=c, window_fwd_ms=ms(window_fwd), window_bwd_ms=ms(window_bwd),
        transfer_ms=ms(transfer), exposed_ms=ms(exposed), groups={},
        rank_ms={str(g): ms(t) for g, t in t_groups.items()},
    )  # fmt: skip
    for g, t in t_groups.items():
        if g == 1:
            continue
        split_cost = t - t_groups[1]
        hidden_less = max(0.0, transfer / g - window_fwd) + max(0.0, transfer / g - window_bwd)
        row["groups"][str(g)] = dict(split_cost_ms=ms(split_cost), exposed_ms=ms(hidden_less))
    cells = ", ".join(
        f"G={g}: split {d['split_cost_ms']:+.3f} exposed {d['exposed_ms']:.3f} "
        f"net {d['split_cost_ms'] + d['exposed_ms']:.3f}"
        for g, d in row["groups"].items()
    )
    print(
        f"S={human_tokens(seq)} K={kv_heads} R={n} (chunk {human_tokens(c)}): "
        f"rank {t_groups[1] * 1e3:.3f} ms, window fwd {window_fwd * 1e3:.3f} bwd {window_bwd * 1e3:.3f}, "
        f"transfer {transfer * 1e3:.3f} each way, "
        f"exposed now {exposed * 1e3:.3f} ({exposed / t_groups[1] * 100:.1f}% of the rank); {cells}",
        flush=True,
    )
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", nargs="+", default=["16k", "32k", "64k"])
    p.add_argument("--kv-heads", nargs="+", type=int, default=[8, 32])
    p.add_argument("--n", nargs="+", type=int, default=[2, 4, 8], help="R, the CP sizes")
    p.add_argument("--groups", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--gbps", type=float, default=358.0, help="peer bandwidth out of one GPU, GB/s")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json")
    opts = p.parse_args()
    if 1 not in opts.groups:
        opts.groups = [1, *opts.groups]
    rows = [
        measure(seq, kv, n, opts)
        for seq in map(parse_tokens, opts.seq)
        for kv in opts.kv_heads
        for n in opts.n
    ]
    if opts.json:
        meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, gbps=opts.gbps, impl=IMPL)
        with open(opts.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
