"""The CP attention layer's work per rank against unsharded causal cuDNN attention, on one GPU.

    python benchmarks/attention.py --seq 16k 32k --kv-heads 8 32 --n 1 2 4 8 --json a.json --png a.png

For each sequence length S and number of key/value heads: forward + backward of
``jax.nn.dot_product_attention(is_causal=True, implementation="cudnn")`` on the whole sequence
(t_unsharded), and of the layer's computation for a rank of N with its real shapes and no
transfer (``jax_cpgrad.attention.rank_without_transfer``; t_rank, the slowest of ranks 0, N/2
and N-1). The emulation stands in for the K/V gather with n local copies of K and V
concatenated, materialized as the transfer's buffer is (a real rank reads what its transfer
wrote and makes no such copy): the stand-in is timed alone and taken off each rank's reading, so
t_rank is what a real rank's attention takes (the readings as measured are kept in the JSON,
``t_rank_measured_by_rank_ms``, beside ``t_stand_in_gather_ms``). A window shorter than a chunk
gathers nothing of the kind (its stand-in is a copy of the halo's few rows, in t_rank): 0 there.
A rank does 1/N of the causal work, so N x t_rank / t_unsharded is 1.00 when nothing is wasted.
Targets: <= 1.03 at N = 1, <= 1.05 where chunks (S/2N tokens) are >= 4k, <= 1.15 at 1k-2k.
bf16, batch 1, 32 query heads of 128 (--heads, --head-dim). --window W and --documents L give
both sides a causal sliding window (a query sees itself and the W keys before it:
``local_window_size=W``, jax.nn's (W, W), the right side 0 by causality) and packed documents of
L tokens (segment ids ``arange(S) // L``, given to ``rank_without_transfer`` as
``sequence_segment_ids``: each rank takes its own tokens' ids, chunks r and 2N-1-r, and gathers
the whole sequence's, as a real rank does). --documents also takes a mix of
``benchmarks/document_balance.py``: ``short`` (256-4k tokens, log-uniform), ``long`` (8k-64k) or
``mixed`` (both, 5% long), drawn with seed 0, packed in the head-tail layout as they come, or
with --balanced-order in ``jax_cpgrad.balanced_document_order``'s order for each N (whole documents
reordered for even work; the R = 1 ideal keeps the drawn order: the same documents, the same work).
--bounded tells the layer the longest document's length (``max_document_length``): the same
attention, with the window it implies, so that a rank takes the halo (where the bound is under a
chunk) or the chunks the window reaches instead of every rank's K/V.

--rank-implementation {cudnn,xla,mosaic}: the rank's kernels (``implementation=`` of
``rank_without_transfer``). Default: --implementation for plain causal attention, else the
layer's implementation=None choice (the Pallas kernels on sm_90: cuDNN takes no masks).

--ideal {dense,layer}: the unsharded reference t_unsharded. ``dense`` (the default):
``jax.nn.dot_product_attention`` with --implementation, the documents as a dense boolean mask
(with a window or documents not a fair ideal: it visits every tile). ``layer``: t_ideal, the same
layer computation at one rank on the whole sequence (``rank_without_transfer(q, k, v, 0, 1, ...)``
with the rank's kernels, the window and the documents: R = 1 holds the sequence in natural order),
so the same kernels with the same block sparsity on the whole masked problem. The masks make the
ranks' shares of the work unequal, so with --ideal layer each rank's time is also set against its
share: share_r is the number of visible (query, key) pairs of rank r's queries over those of the
whole sequence (causal, the window and the documents; counted on the host per query row), and
t_rank_r / (t_ideal x share_r) is 1.00 when nothing is wasted; a row's ``ratio_to_share`` is its
largest over the measured ranks (kept in the JSON with ``share_by_rank``). Target: <= 1.10 for
masked rows (a window or documents); plain causal rows, where every share is 1/N, keep the
targets above.

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
import functools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import step_profile  # noqa: E402
from document_balance import MIXES, document_lengths  # noqa: E402

from jax_cpgrad import balanced_document_order, longest_document, permute_tokens  # noqa: E402
from jax_cpgrad.attention import rank_without_transfer  # noqa: E402
from jax_cpgrad.attention.emulation import NoTransfer  # noqa: E402
from jax_cpgrad.attention.masks import within_documents  # noqa: E402

MASKED_TARGET = 1.10  # t_rank_r / (t_ideal x share_r), --ideal layer, a window or documents


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


def documents_arg(text: str) -> int | str:
    """--documents: a length in tokens, or the name of a mix."""
    if text in MIXES and text != "causal":
        return text
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise argparse.ArgumentTypeError(f"a positive length or one of short, long, mixed; got {text!r}")


@functools.cache  # the balanced order is a search: once per (S, documents, N) for programs and shares
def document_ids(seq: int, documents: int | str | None, balanced_for: int | None = None):
    """int32 [1, seq] segment ids: documents of ``documents`` tokens, or of a mix's lengths
    (drawn with seed 0); None: no documents. ``balanced_for``: R, the documents in
    ``balanced_document_order``'s order for R ranks (None: as drawn)."""
    if documents is None:
        return None
    if isinstance(documents, str):
        lengths = document_lengths(documents, seq, np.random.default_rng(0))
        ids = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)[None]
    else:
        ids = (np.arange(seq, dtype=np.int32) // documents)[None]
    if balanced_for is not None:
        ids = permute_tokens(ids, balanced_document_order(ids, balanced_for))
    return jnp.asarray(ids)


def visible_per_query(
    seq: int, window: int | None, documents: int | str | None, balanced_for: int | None = None
):
    """int64 [seq]: how many keys each query (natural order) sees under causal attention, a
    window (``local_window_size=window``: the query and the ``window`` keys before it) and the
    documents of :func:`document_ids` (``balanced_for`` as there). Query p sees the keys
    [lo, p], lo the latest of 0, p - window and its document's first token."""
    p = np.arange(seq, dtype=np.int64)
    lo = np.zeros_like(p)
    if window is not None:
        lo = np.maximum(lo, p - window)
    if documents is not None:
        ids = np.asarray(document_ids(seq, documents, balanced_for))[0]
        starts = np.r_[True, ids[1:] != ids[:-1]]
        lo = np.maximum(lo, np.maximum.accumulate(np.where(starts, p, 0)))
    return p - lo + 1


def visible_share(
    seq: int, n: int, window: int | None, documents: int | str | None, balanced: bool = False
) -> np.ndarray:
    """float64 [n]: each rank's share of the visible (query, key) pairs of the sequence, rank r
    holding the queries of chunks r and 2n-1-r of 2n (``to_cp_layout``); the shares sum to 1.
    ``balanced``: the documents in ``balanced_document_order``'s order for n ranks."""
    visible = visible_per_query(seq, window, documents, n if balanced else None)
    per_chunk = visible.reshape(2 * n, seq // (2 * n)).sum(axis=1)
    per_rank = per_chunk[:n] + per_chunk[::-1][:n]
    return per_rank / per_chunk.sum()


def rank_attention(q, k, v, rank, n: int, *, ids, window, implementation, max_document_length=None):
    """``rank_without_transfer`` for rank ``rank`` of ``n``, the whole sequence's natural-order
    ``ids`` (numpy, or None) given as ``sequence_segment_ids``: the rank takes its own from them,
    and its gathered ids are the real ones (copies of its own would move the documents' edges)."""
    return rank_without_transfer(
        q, k, v, rank, n, sequence_segment_ids=ids, local_window_size=window, implementation=implementation,
        max_document_length=max_document_length,
    )  # fmt: skip


def rank_implementation(opts) -> str | None:
    """The rank's ``implementation=``: --rank-implementation, else --implementation for plain
    causal attention and None (the layer's choice) with a window or documents."""
    if opts.rank_implementation is not None:
        return opts.rank_implementation
    return opts.implementation if opts.documents is None and opts.window is None else None


def measure(seq: int, kv_heads: int, ns: list[int], opts, say) -> list[dict]:
    full = inputs(seq, opts.heads, kv_heads, opts.head_dim)
    ids = document_ids(seq, opts.documents)
    attend = dict(ids=None if ids is None else np.asarray(ids), window=opts.window)
    attend["implementation"] = rank_implementation(opts)
    if opts.bounded and ids is not None:
        attend["max_document_length"] = longest_document(ids)
    if opts.ideal == "layer":  # the layer at one rank: the same kernels on the whole sequence
        unsharded = fwd_bwd(lambda q, k, v: rank_attention(q, k, v, 0, 1, **attend))
        programs: dict = {"unsharded": (unsharded, full)}
    else:
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
        programs = {"unsharded": (unsharded, full)}  # key -> (jitted function, its arguments)
    layouts = []  # (n, chunk, ranks measured)
    for n in ns:
        local = seq // n
        chunk = local // 2
        if chunk < opts.min_chunk or local * n != seq:
            continue
        data = inputs(local, opts.heads, kv_heads, opts.head_dim, seed=n)
        mine = attend
        if opts.balanced_order and ids is not None:
            mine = attend | dict(ids=np.asarray(document_ids(seq, opts.documents, n)))
        # One compiled program for every rank: the rank is a run-time value.
        step = fwd_bwd(lambda q, k, v, rank, n=n, mine=mine: rank_attention(q, k, v, rank, n, **mine))
        ranks = sorted({0, n // 2, n - 1})
        programs |= {(n, r): (step, (*data, jnp.int32(r))) for r in ranks}
        if gathers(n, chunk, opts.window, attend.get("max_document_length")):
            programs[(n, "stand-in")] = (stand_in_gather(n), data[1:3])
        layouts.append((n, chunk, ranks))
    times, readings = times_in_rounds(programs, opts)
    t_full = times["unsharded"]
    what = "ideal (the layer at one rank)" if opts.ideal == "layer" else "unsharded"
    say(f"S={human_tokens(seq)} KV heads {kv_heads}: {what} {t_full * 1e3:.3f} ms")
    kernels_full = kernel_table(*programs["unsharded"], opts, say)
    rows = []
    for n, chunk, ranks in layouts:
        measured = {r: times[(n, r)] for r in ranks}
        stand_in = times.get((n, "stand-in"), 0.0)
        say(
            f"  N={n}: ranks {', '.join(f'{r}: {t * 1e3:.3f} ms' for r, t in measured.items())}; of which "
            f"the stand-in gather (a copy the real transfer replaces, taken off) {stand_in * 1e3:.3f} ms"
        )
        per_rank = {r: t - stand_in for r, t in measured.items()}
        kernels = dict(kernels_rank0=kernel_table(*programs[(n, 0)], opts, say))
        row = _row(seq, kv_heads, n, chunk, per_rank, stand_in, t_full, opts, say)
        row["t_rank_measured_by_rank_ms"] = {str(r): t * 1e3 for r, t in measured.items()}
        if opts.ideal == "layer":
            row |= _to_share(seq, n, chunk, per_rank, t_full, opts, say)
        mine = [key for key in programs if key == "unsharded" or key[0] == n]
        row["readings_ms"] = {_label(key): [t * 1e3 for t in readings[key]] for key in mine}
        rows.append(row | kernels | dict(kernels_unsharded=kernels_full))
    return rows


def _label(key) -> str:
    """A program's name in the JSON, from its key: "unsharded", (n, rank) or (n, "stand-in")."""
    if key == "unsharded":
        return key
    return f"rank {key[1]}" if isinstance(key[1], int) else key[1]


def gathers(n: int, chunk: int, window: int | None = None, max_document_length: int | None = None) -> bool:
    """Whether a rank of ``n`` gathers K/V (so its emulation stands in for the gather): not alone,
    and not with a causal window (``window`` keys to the left, or the one a bound on the documents
    implies) shorter than a chunk (the halo's rows move instead)."""
    sides = within_documents(None if window is None else (window, 0), max_document_length, causal=True)
    return n > 1 and not (sides is not None and sides[0] < chunk)


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


def masked(opts) -> bool:
    return opts.window is not None or opts.documents is not None


def _row(seq, kv_heads, n, chunk, per_rank, stand_in, t_full, opts, say) -> dict:
    t_rank = max(per_rank.values())
    ratio = n * t_rank / t_full
    # Against the layer's ideal a masked row's ranks have unequal shares: its target is on
    # ratio_to_share (_to_share) instead.
    goal = None if opts.ideal == "layer" and masked(opts) else target(n, chunk)
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


def _to_share(seq, n, chunk, per_rank, t_ideal, opts, say) -> dict:
    """--ideal layer: each measured rank's t_rank_r / (t_ideal x share_r) and their largest."""
    shares = visible_share(seq, n, opts.window, opts.documents, opts.balanced_order)
    by_rank = {r: float(t / (t_ideal * shares[r])) for r, t in per_rank.items()}
    worst = max(by_rank.values())
    goal = MASKED_TARGET if masked(opts) else target(n, chunk)
    mark = "" if goal is None else (" ok" if worst <= goal else f" MISSES {goal:.2f}")
    cells = ", ".join(f"{r}: {x:.3f} (share {shares[r]:.4f})" for r, x in by_rank.items())
    # What a step waits on: the slowest rank against the largest share (a rank with little
    # work can be far from its share and still finish first).
    slowest = max(per_rank.values()) / (t_ideal * max(shares[r] for r in per_rank))
    say(f"  N={n}: t_rank / (t_ideal x share) by rank {cells}; max {worst:.3f}{mark}; "
        f"slowest rank / (t_ideal x largest share) {slowest:.3f}")  # fmt: skip
    return dict(
        share_by_rank={str(r): float(shares[r]) for r in per_rank},
        ratio_to_share_by_rank={str(r): x for r, x in by_rank.items()},
        ratio_to_share=worst, target_to_share=goal, ratio_slowest_to_largest_share=slowest,
        meets_target_to_share=None if goal is None else worst <= goal,
    )  # fmt: skip


def table(rows: list[dict]) -> str:
    """The ratios by S, KV heads and N; with --ideal layer each cell is "ratio (to share
    ratio_to_share)"."""
    seqs = sorted({r["seq"] for r in rows})
    kvs = sorted({r["kv_heads"] for r in rows})
    ns = sorted({r["n"] for r in rows})
    lines = ["| S | KV heads | " + " | ".join(f"N={n}" for n in ns) + " |", "|---|---|" + "---|" * len(ns)]
    for s in seqs:
        for kv in kvs:
            cells = []
            for n in ns:
                hit = [r for r in rows if (r["seq"], r["kv_heads"], r["n"]) == (s, kv, n)]
                cells.append(_cell(hit[0]) if hit else "")
            if any(cells):
                lines.append(f"| {human_tokens(s)} | {kv} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(row: dict) -> str:
    if "ratio_to_share" not in row:
        return f"{row['ratio']:.2f}"
    return f"{row['ratio']:.2f} (to share {row['ratio_to_share']:.2f})"


def write_png(path: str, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = "ratio_to_share" if all("ratio_to_share" in r for r in rows) else "ratio"
    fig, ax = plt.subplots(figsize=(7, 4))
    for kv in sorted({r["kv_heads"] for r in rows}):
        for n in sorted({r["n"] for r in rows}):
            pts = sorted((r["seq"], r[key]) for r in rows if r["kv_heads"] == kv and r["n"] == n)
            if pts:
                ax.plot([p[0] / 1024 for p in pts], [p[1] for p in pts], marker="o", label=f"N={n}, KV {kv}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("global sequence (k tokens)")
    if key == "ratio":
        ax.set_ylabel("N x t_rank / t_unsharded (ideal 1.00)")
    else:
        ax.set_ylabel("max over ranks of t_rank / (t_ideal x share) (ideal 1.00)", fontsize=8)
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
    p.add_argument(
        "--rank-implementation",
        choices=["cudnn", "xla", "mosaic"],
        help="the rank's kernels; default: --implementation for plain causal, else the layer's choice",
    )
    p.add_argument(
        "--ideal",
        choices=["dense", "layer"],
        default="dense",
        help="the reference: jax.nn's attention with a dense mask, or the layer at one rank (see above)",
    )
    p.add_argument("--window", type=int, help="a causal sliding window of this many keys to the left")
    p.add_argument(
        "--documents",
        type=documents_arg,
        help="packed documents of this many tokens each, or a mix: short, long, mixed",
    )
    p.add_argument(
        "--balanced-order",
        action="store_true",
        help="--documents reordered by jax_cpgrad.balanced_document_order for each N",
    )
    p.add_argument(
        "--bounded",
        action="store_true",
        help="--documents with max_document_length, their longest (the window it implies)",
    )
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
    shares = ""
    if opts.ideal == "layer":
        shares = " (to share: max over ranks of t_rank / (t_ideal x share), ideal 1.00)"
    say(f"N x t_rank / t_unsharded (ideal 1.00){shares}:\n{table(rows)}")
    meta = dict(
        date=datetime.date.today().isoformat(), device=str(jax.devices()[0].device_kind), jax=jax.__version__,
        implementation=opts.implementation, window=opts.window, documents=opts.documents,
        balanced_order=opts.balanced_order, bounded=opts.bounded,
        rank_implementation=rank_implementation(opts), ideal=opts.ideal,
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
