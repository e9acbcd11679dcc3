"""The CP attention layer's work per rank against unsharded causal cuDNN attention, on one GPU.

    python benchmarks/attention.py --seq 16k 32k --kv-heads 8 32 --n 1 2 4 8 --json a.json --png a.png

For each sequence length S and number of key/value heads: forward + backward of
``jax.nn.dot_product_attention(is_causal=True, implementation="cudnn")`` on the whole sequence
(t_unsharded), and of the layer's computation for a rank of N with its real shapes and no
transfer (``jax_cpgrad.attention.rank_without_transfer``; t_rank, the slowest of ranks 0, N/2
and N-1). t_rank includes the emulation's stand-in for the K/V gather (n local copies of K and V
concatenated, which a real rank's transfer replaces): timed alone too, and printed and kept in
the JSON (t_stand_in_gather_ms), not subtracted.
A rank does 1/N of the causal work, so N x t_rank / t_unsharded is 1.00 when nothing is wasted.
Targets: <= 1.03 at N = 1, <= 1.05 where chunks (S/2N tokens) are >= 4k, <= 1.15 at 1k-2k.
bf16, batch 1, 32 query heads of 128 (--heads, --head-dim). --window W and --documents L give
both sides a causal sliding window of W keys and packed documents of L tokens (the rank then
runs the masked kernels implementation=None picks; the unsharded call takes the documents as
jax.nn.dot_product_attention's boolean mask).

Times are read the same way for both sides: every program of one S and KV count (the unsharded
call, each rank's, the stand-in) is compiled and run once, the unsharded call then keeps the GPU
busy for --warm-s, and --rounds rounds follow in which each attention program in turn runs back to
back for --reading-s, each round's order rotated by one (the stand-in copies are read after them);
a program's time is the median over the rounds of its mean time per call. The GPU's state matters:
under sustained load an H200 reaches its 700 W cap and lowers its clock (1980 to 1710-1770 MHz),
by more for some programs than others, and a reading that follows a lighter program (or idle time)
starts at full clock. By default the readings follow each other (the power-capped steady state of
a training run); --idle-s T lets the GPU idle T seconds before each reading instead (full clock,
for short readings).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import step_profile  # noqa: E402

from jax_cpgrad.attention import rank_without_transfer  # noqa: E402
from jax_cpgrad.attention.emulation import NoTransfer  # noqa: E402


def parse_tokens(text: str) -> int:
    return int(float(text[:-1]) * 1024) if text[-1] in "kK" else int(text)


def human_tokens(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def target(n: int, chunk: int) -> float | None:
    if n == 1:
        return 1.03
    if chunk >= 4096:
        return 1.05
    if chunk >= 1024:
        return 1.15
    return None


def fwd_bwd(attend):
    """jit(q, k, v, ct, *extra) -> (dq, dk, dv) of sum(attend(q, k, v, *extra) * ct): one forward
    and backward."""

    def loss(q, k, v, ct, *extra):
        return jnp.sum(attend(q, k, v, *extra).astype(jnp.float32) * ct.astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def seconds(f, args, iters: int, reps: int) -> float:
    """The best of ``reps`` bursts of ``iters`` calls, per call: the sweeps' quick reading, in
    whatever power state the GPU is in (measure() reads in rounds instead)."""
    jax.block_until_ready(f(*args))  # compile, load, warm
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for _ in range(iters):
            out = f(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def inputs(seq: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0, dt=jnp.bfloat16):
    key = jax.random.key(seed)
    kq, kk, kv, kc = jax.random.split(key, 4)
    q = jax.random.normal(kq, (1, seq, heads, head_dim), dt)
    k = jax.random.normal(kk, (1, seq, kv_heads, head_dim), dt)
    v = jax.random.normal(kv, (1, seq, kv_heads, head_dim), dt)
    ct = jax.random.normal(kc, (1, seq, heads, head_dim), dt)
    return q, k, v, ct


def document_ids(seq: int, length: int | None):
    """int32 [1, seq] segment ids of documents of ``length`` tokens (None: no documents)."""
    return None if length is None else (jnp.arange(seq, dtype=jnp.int32) // length)[None]


def measure(seq: int, kv_heads: int, ns: list[int], opts, say) -> list[dict]:
    full = inputs(seq, opts.heads, kv_heads, opts.head_dim)
    ids = document_ids(seq, opts.documents)
    mask = None if ids is None else (ids[:, :, None] == ids[:, None, :])[:, None]
    unsharded = fwd_bwd(
        lambda q, k, v: jax.nn.dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            implementation=opts.implementation,
            mask=mask,
            local_window_size=opts.window,
        )  # fmt: skip
    )
    programs: dict = {"unsharded": (unsharded, full)}  # key -> (jitted function, its arguments)
    rank_impl = opts.implementation if ids is None and opts.window is None else None  # cuDNN takes no masks
    layouts = []  # (n, chunk, ranks measured)
    for n in ns:
        local = seq // n
        chunk = local // 2
        if chunk < opts.min_chunk or local * n != seq:
            continue
        data = inputs(local, opts.heads, kv_heads, opts.head_dim, seed=n)
        step = fwd_bwd(
            lambda q, k, v, rank, n=n, local=local: rank_without_transfer(
                q, k, v, rank, n, segment_ids=None if ids is None else ids[:, :local],
                local_window_size=opts.window,
                implementation=rank_impl,
            )
        )  # fmt: skip
        # One compiled program for every rank: the rank is a runtime value.
        ranks = sorted({0, n // 2, n - 1})
        programs |= {(n, r): (step, (*data, jnp.int32(r))) for r in ranks}
        if n > 1:
            programs[(n, "stand-in")] = (stand_in_gather(n), data[1:3])
        layouts.append((n, chunk, ranks))
    times, readings = times_in_rounds(programs, opts)
    t_full = times["unsharded"]
    say(f"S={human_tokens(seq)} KV heads {kv_heads}: unsharded {t_full * 1e3:.3f} ms")
    kernels_full = kernel_table(unsharded, full, opts, say)
    rows = []
    for n, chunk, ranks in layouts:
        per_rank = {r: times[(n, r)] for r in ranks}
        stand_in = times.get((n, "stand-in"), 0.0)
        say(
            f"  N={n}: ranks {', '.join(f'{r}: {t * 1e3:.3f} ms' for r, t in per_rank.items())}; of which "
            f"the stand-in gather (a copy the real transfer replaces) {stand_in * 1e3:.3f} ms"
        )
        kernels = dict(kernels_rank0=kernel_table(*programs[(n, 0)], opts, say))
        row = _row(seq, kv_heads, n, chunk, per_rank, stand_in, t_full, opts, say)
        mine = [key for key in programs if key == "unsharded" or key[0] == n]
        row["readings_ms"] = {_label(key): [t * 1e3 for t in readings[key]] for key in mine}
        rows.append(row | kernels | dict(kernels_unsharded=kernels_full))
    return rows


def _label(key) -> str:
    """A program's name in the JSON, from its key: "unsharded", (n, rank) or (n, "stand-in")."""
    if key == "unsharded":
        return key
    return f"rank {key[1]}" if isinstance(key[1], int) else key[1]


def stand_in_gather(n: int):
    """The K/V gather's stand-in in ``rank_without_transfer``: n local copies of K and V
    concatenated, a copy that a real rank does not make (its transfer writes the gathered keys)."""
    return jax.jit(lambda k, v: NoTransfer(n).gather((k, v), lambda: None)[0])


def times_in_rounds(programs: dict, opts) -> tuple[dict, dict]:
    """({key: seconds per call}, {key: [each round's reading]}) of ``programs`` ({key: (f, args)}),
    read the same way: see the module docstring."""
    for f, args in programs.values():
        jax.block_until_ready(f(*args))  # compile and load
    first, first_args = programs["unsharded"]
    started = time.perf_counter()
    while time.perf_counter() - started < opts.warm_s:
        jax.block_until_ready(first(*first_args))
    readings: dict = {key: [] for key in programs}
    # The attention programs in rounds, each round's order rotated by one (the one read after a
    # lighter program reads fast while the GPU's power settles); the stand-in copies after them.
    light = [key for key in programs if _label(key) == "stand-in"]
    heavy = [key for key in programs if key not in light]
    for i in range(opts.rounds):
        for key in heavy[i % len(heavy) :] + heavy[: i % len(heavy)]:
            _read(programs, key, readings, opts)
    for _ in range(opts.rounds):
        for key in light:
            _read(programs, key, readings, opts)
    return {key: statistics.median(xs) for key, xs in readings.items()}, readings


def _read(programs: dict, key, readings: dict, opts) -> None:
    time.sleep(opts.idle_s)
    readings[key].append(back_to_back(*programs[key], opts.reading_s))


def back_to_back(f, args, min_seconds: float) -> float:
    """The mean time per call of f(*args) called back to back for at least ``min_seconds`` (at
    least one call), one call queued behind the running one so the GPU never waits for the host."""
    started = time.perf_counter()
    calls, running = 0, None
    while True:
        queued = f(*args)
        calls += 1
        if running is not None:
            jax.block_until_ready(running)
        running = queued
        if time.perf_counter() - started >= min_seconds:
            break
    jax.block_until_ready(running)
    return (time.perf_counter() - started) / calls


def kernel_table(f, args, opts, say) -> list:
    """--kernels K: the K longest-running GPU kernels of one run of f (microseconds, launches),
    from a profiler trace; printed, and kept in the JSON."""
    if not opts.kernels:
        return []
    top = step_profile.top_kernels(f, args, steps=3, count=opts.kernels)
    for name, us, launches in top:
        say(f"      {us:9.1f} us  x{launches:<3d} {name[:100]}")
    return [dict(name=name, us=us, launches=launches) for name, us, launches in top]


def _row(seq, kv_heads, n, chunk, per_rank, stand_in, t_full, opts, say) -> dict:
    t_rank = max(per_rank.values())
    ratio = n * t_rank / t_full
    goal = target(n, chunk)
    mark = "" if goal is None else (" ok" if ratio <= goal else f" MISSES {goal:.2f}")
    where = f"N={n} chunk {human_tokens(chunk)}"
    say(f"  {where}: rank {t_rank * 1e3:.3f} ms  N x t_rank / t_unsharded = {ratio:.3f}{mark}")
    return dict(
        seq=seq, kv_heads=kv_heads, heads=opts.heads, head_dim=opts.head_dim, n=n, chunk=chunk,
        t_unsharded_ms=t_full * 1e3, t_rank_ms=t_rank * 1e3,
        t_rank_by_rank_ms={str(r): t * 1e3 for r, t in per_rank.items()},
        t_stand_in_gather_ms=stand_in * 1e3,
        ratio=ratio, target=goal, meets_target=None if goal is None else ratio <= goal,
    )  # fmt: skip


def table(rows: list[dict]) -> str:
    seqs = sorted({r["seq"] for r in rows})
    kvs = sorted({r["kv_heads"] for r in rows})
    ns = sorted({r["n"] for r in rows})
    lines = ["| S | KV heads | " + " | ".join(f"N={n}" for n in ns) + " |", "|---|---|" + "---|" * len(ns)]
    for s in seqs:
        for kv in kvs:
            cells = []
            for n in ns:
                hit = [r for r in rows if (r["seq"], r["kv_heads"], r["n"]) == (s, kv, n)]
                cells.append(f"{hit[0]['ratio']:.2f}" if hit else "")
            if any(cells):
                lines.append(f"| {human_tokens(s)} | {kv} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_png(path: str, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for kv in sorted({r["kv_heads"] for r in rows}):
        for n in sorted({r["n"] for r in rows}):
            pts = sorted((r["seq"], r["ratio"]) for r in rows if r["kv_heads"] == kv and r["n"] == n)
            if pts:
                ax.plot([p[0] / 1024 for p in pts], [p[1] for p in pts], marker="o", label=f"N={n}, KV {kv}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("global sequence (k tokens)")
    ax.set_ylabel("N x t_rank / t_unsharded (ideal 1.00)")
    ax.set_title("CP attention per-rank work, fwd+bwd, bf16, 32x128 heads")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", nargs="+", default=["16k", "32k"])
    p.add_argument("--kv-heads", nargs="+", type=int, default=[8, 32])
    p.add_argument("--n", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--min-chunk", type=int, default=512)
    p.add_argument("--kernels", type=int, default=0, help="list the K longest GPU kernels of each row")
    p.add_argument("--rounds", type=int, default=4, help="interleaved readings of every program")
    p.add_argument("--reading-s", type=float, default=0.5, help="seconds of back-to-back calls per reading")
    p.add_argument("--warm-s", type=float, default=2.0, help="the unsharded call's seconds first")
    p.add_argument("--idle-s", type=float, default=0.0, help="the GPU's idle seconds before each reading")
    p.add_argument(
        "--implementation",
        choices=["cudnn", "xla"],
        help="default: cudnn on a GPU, xla elsewhere (a smoke run)",
    )
    p.add_argument("--window", type=int, help="a causal sliding window of this many keys to the left")
    p.add_argument("--documents", type=int, help="packed documents of this many tokens each")
    p.add_argument("--json")
    p.add_argument("--png")
    opts = p.parse_args(argv)
    if opts.implementation is None:
        opts.implementation = "cudnn" if jax.default_backend() == "gpu" else "xla"
    say = lambda *a: print(*a, flush=True)
    rows = []
    for seq in map(parse_tokens, opts.seq):
        for kv in opts.kv_heads:
            rows += measure(seq, kv, opts.n, opts, say)
    say(f"N x t_rank / t_unsharded (ideal 1.00):\n{table(rows)}")
    meta = dict(
        date=datetime.date.today().isoformat(), device=str(jax.devices()[0].device_kind), jax=jax.__version__,
        implementation=opts.implementation, window=opts.window, documents=opts.documents,
        command=" ".join(sys.argv),
    )  # fmt: skip
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if opts.png:
        write_png(opts.png, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
