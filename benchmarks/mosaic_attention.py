"""The Pallas Mosaic GPU attention kernels (jax_cpgrad/attention/mosaic_gpu/) against cuDNN, side by
side in one run, on one GPU.

    python benchmarks/mosaic_attention.py                                  # the default grid
    python benchmarks/mosaic_attention.py --head-dim 64                    # the rest of the grid
    python benchmarks/mosaic_attention.py --seq 8k 16k --kv-heads 8 --cases causal --out probe
    python benchmarks/mosaic_attention.py --smoke --out /tmp/smoke        # the CPU, in seconds

The default grid (head dim 128, KV heads 8 and 32) is about 14 points of 20-60 s each (an
estimate: compile time is not known yet on the H200). ``bash benchmarks/gpu_run_mosaic.sh`` runs
its 8-KV-head half after the GPU tests, and ``bash benchmarks/gpu_run_mosaic.sh bench_rest`` the
32-KV-head half and the head-dim-64 grid. bf16, batch 1, 32 query heads (--heads); every row is
one (case, S, KV heads, head dim) point:

- ``causal``: unsharded causal attention at S = 8k..128k (--seq), KV heads 8 and 32 (--kv-heads),
  head dim 128 (--head-dim; 64 for the rest of the grid). Ours: ``mosaic_gpu.forward`` and
  ``mosaic_gpu.backward`` under a ``jax.custom_vjp`` (the backward given the forward's out and
  lse, as the layer calls it); cuDNN: ``jax.nn.dot_product_attention(is_causal=True,
  implementation="cudnn")``. Each is read as forward + backward (``jax.grad`` of
  sum(out * ct)), forward alone, and backward alone (the VJP closure of a forward run earlier,
  applied to ct: just the backward kernels from saved residuals).
- ``window``: the same at --masked-seq (64k) with a causal sliding window of --window (4096) keys,
  the query's own included: ours with ``masks.Mask(causal=True, window=(4095, 0))``, cuDNN with
  ``local_window_size=(4095, 0)``, which jax's cuDNN path turns into
  ``sliding_window_length=4096`` (recorded in the JSON's meta).
- ``documents``: packed documents at --masked-seq, ours only, two mixes of
  ``benchmarks/document_balance.py`` (``short``: 256-4k tokens; ``long``: 8k-64k, log-uniform,
  seed 0), next to our causal call at the same size in the same rounds: the time share
  t_documents / t_causal beside the visible-area share (visible (query, key) pairs over the causal
  count), and their ratio (1.00: time in proportion to the visible work).

The Visibility a kernel call takes (``masks.visibility``) is computed once per point outside the
timed programs (cuDNN computes its masks inside its kernels).

Per row: the median time of each program (ms), ours / cuDNN per program (``ratio``; < 1: ours is
faster), model TFLOP/s (a causal forward 2 S^2 N H flops, the window's and documents' visible
pairs likewise; the backward 2.5x the forward), the compile time of each program (trace and lower,
XLA compile, and the first call less one steady call: Mosaic GPU kernels are loaded there), and
ours' max |out - out_cuDNN| as a check that both computed the same thing.

Timing: ``benchmarks/attention.py``'s steady state, its functions imported (``times_in_rounds``):
every program of one point is compiled and run once, the first (cuDNN's fwd+bwd; our causal
fwd+bwd for documents) keeps the GPU busy for --warm-s, then --rounds rounds read each program
back to back for --reading-s, each round's order rotated by one; a program's time is the median of
its rounds (the H200's power-capped clock under sustained load, as in a training run).

Figures (``--out NAME``: ``benchmarks/results/{NAME}.json`` and ``.png``; a NAME with a folder is
used as given): (1) ours / cuDNN time against S, per KV heads and head dim, for fwd+bwd, fwd and
bwd, the window's points marked; (2) model TFLOP/s of fwd+bwd, ours and cuDNN; (3) with
documents: the time share against the visible-area share of the causal time. The table is printed;
the JSON is rewritten after every point, so a run stopped by a time limit keeps what it measured.
``--budget-s`` skips the points that would not fit (listed in the JSON's ``skipped``).

``--smoke``: the CPU in seconds, for tests/test_mosaic_benchmark.py: tiny shapes, the plain-jnp
blockwise path (``jax_cpgrad/attention/blockwise.py``, the kernels' reference algorithm on the
same tile plan) in place of the kernels and XLA in place of cuDNN; the same programs and JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from attention import fwd_bwd, human_tokens, inputs, parse_tokens, times_in_rounds  # noqa: E402
from document_balance import document_lengths  # noqa: E402

from jax_cpgrad.attention import masks  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
CASES = ("causal", "window", "documents")
MIXES = ("short", "long")  # document_balance.MIXES: 256-4k and 8k-64k tokens
KINDS = ("fwd+bwd", "fwd", "bwd")
BWD_FLOPS = 2.5  # a flash backward's model flops per forward flop (5 matmuls to 2)


# -- the two sides --------------------------------------------------------------------------------


def ours_calls(opts):
    """(forward, backward) of our kernels, ``forward(q, k, v, vis, *, scale) -> (out, lse)`` and
    ``backward(q, k, v, out, lse, d_out, vis, *, scale) -> (dq, dk, dv)``: the Mosaic GPU kernels
    with --fwd-config / --bwd-config changes, or the blockwise path under --smoke."""
    if opts.smoke:
        from jax_cpgrad.attention import blockwise

        blocks = dict(block_q=opts.smoke_block, block_k=opts.smoke_block)
        return functools.partial(blockwise.forward, **blocks), functools.partial(blockwise.backward, **blocks)
    from jax_cpgrad.attention import mosaic_gpu

    # The module (the package re-exports its function under the same name).
    mb = importlib.import_module("jax_cpgrad.attention.mosaic_gpu.backward")

    def forward(q, k, v, vis, *, scale):
        config = mosaic_gpu.default_config(q.shape[-1]).replace(**opts.fwd_config)
        return mosaic_gpu.forward(q, k, v, vis, scale=scale, config=config)

    def backward(q, k, v, out, lse, d_out, vis, *, scale):
        config = mb.default_config(q.shape[-1]).replace(**opts.bwd_config)
        return mosaic_gpu.backward(q, k, v, out, lse, d_out, vis, scale=scale, config=config)

    return forward, backward


def ours_attention(forward, backward, scale: float):
    """attend(q, k, v, vis) -> out, differentiable in q, k, v: our forward, and our backward given
    the forward's out and lse (the layer's kernel contract)."""

    @jax.custom_vjp
    def attend(q, k, v, vis):
        return forward(q, k, v, vis, scale=scale)[0]

    def attend_fwd(q, k, v, vis):
        out, lse = forward(q, k, v, vis, scale=scale)
        return out, (q, k, v, out, lse, vis)

    def attend_bwd(res, d_out):
        q, k, v, out, lse, vis = res
        return (*backward(q, k, v, out, lse, d_out, vis, scale=scale), None)

    attend.defvjp(attend_fwd, attend_bwd)
    return attend


def reference_attention(opts, scale: float, window: int | None):
    """attend(q, k, v) -> out: cuDNN's (XLA's under --smoke) causal attention, windowed or not."""
    local = None if window is None else (window - 1, 0)

    def attend(q, k, v):
        return jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=True, local_window_size=local, implementation=opts.reference
        )

    return attend


def programs_of(attend, args, extra, ct):
    """{kind: (jitted function, its arguments)} of one attention: fwd+bwd, fwd, bwd."""
    q, k, v = args
    fwd = jax.jit(attend)
    # The backward alone: the VJP closure (its residuals saved by a forward run here, untimed)
    # applied to the cotangent.
    _, vjp = jax.jit(lambda q, k, v, *x: jax.vjp(lambda q, k, v: attend(q, k, v, *x), q, k, v))(
        q, k, v, *extra
    )
    return {
        "fwd+bwd": (fwd_bwd(attend), (q, k, v, ct, *extra)),
        "fwd": (fwd, (q, k, v, *extra)),
        "bwd": (jax.jit(lambda f, ct: f(ct)), (vjp, ct)),
    }


def ours_forward_program(forward, scale, args, vis):
    """Our forward alone returns (out, lse): the lse is the layer's output too."""
    return jax.jit(lambda q, k, v, vis: forward(q, k, v, vis, scale=scale)), (*args, vis)


# -- one point -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Program:
    side: str  # "ours", "cudnn" (or "xla" under --smoke), "ours causal", "ours short", ...
    kind: str  # fwd+bwd, fwd, bwd
    build: object  # () -> (f, args)
    f: object = None
    args: tuple = ()
    compile: dict = dataclasses.field(default_factory=dict)
    first: object = None  # the first call's output (kept for the fwd check, then dropped)


def compile_program(p: Program) -> None:
    """Build, lower, compile and run ``p`` once; its compile times in ``p.compile`` (seconds)."""
    t0 = time.perf_counter()
    jitted, args = p.build()
    lowered = jitted.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    p.first = jax.block_until_ready(compiled(*args))
    t3 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    t4 = time.perf_counter()
    p.f, p.args = compiled, args
    first = max(0.0, (t3 - t2) - (t4 - t3))  # the first call less a steady one: loading
    p.compile = dict(
        lower_s=t1 - t0,
        xla_compile_s=t2 - t1,
        first_call_extra_s=first,
        total_s=(t1 - t0) + (t2 - t1) + first,
    )


def visible_pairs(seq: int, window: int | None = None, lengths=None) -> int:
    """Visible (query, key) pairs of causal attention over ``seq`` tokens, with a window of
    ``window`` keys (own included) or packed documents of ``lengths``."""
    if lengths is not None:
        n = np.asarray(lengths, np.int64)
        return int((n * (n + 1) // 2).sum())
    p = np.arange(seq, dtype=np.int64)
    return int(np.minimum(p + 1, seq if window is None else window).sum())


def model_tflops(pairs: int, heads: int, head_dim: int, kind: str, seconds: float) -> float:
    fwd = 4.0 * pairs * heads * head_dim
    flops = {"fwd": fwd, "bwd": BWD_FLOPS * fwd, "fwd+bwd": (1 + BWD_FLOPS) * fwd}[kind]
    return flops / seconds / 1e12


def point_programs(case: str, seq: int, kv: int, hd: int, opts) -> tuple[list[Program], dict]:
    """The programs of one point and what its rows need to know (mask, visible pairs)."""
    scale = hd**-0.5
    q, k, v, ct = inputs(seq, opts.heads, kv, hd, seed=seq + kv + hd)
    forward, backward = ours_calls(opts)
    attend = ours_attention(forward, backward, scale)
    pos = jnp.arange(seq, dtype=jnp.int32)
    causal = masks.Mask(causal=True)
    progs: list[Program] = []

    def add(side, attend_fn, extra, vis=None):
        built = {}

        def build(kind):
            if not built:  # the three programs of one side share their residuals' forward run
                built.update(programs_of(attend_fn, (q, k, v), extra, ct))
            if kind == "fwd" and vis is not None:
                return ours_forward_program(forward, scale, (q, k, v), vis)
            return built[kind]

        progs.extend(Program(side, kind, functools.partial(build, kind)) for kind in KINDS)

    info: dict = {}
    if case in ("causal", "window"):
        window = opts.window if case == "window" else None
        mask = causal if window is None else masks.Mask(causal=True, window=(window - 1, 0))
        vis = masks.visibility(mask, pos, pos)
        add(opts.reference, reference_attention(opts, scale, window), ())  # first: the warm-up program
        add("ours", attend, (vis,), vis)
        info.update(window=window, pairs=visible_pairs(seq, window))
    else:
        vis = masks.visibility(causal, pos, pos)
        add("ours causal", attend, (vis,), vis)
        info["pairs"] = visible_pairs(seq)
        info["mixes"] = {}
        for mix in MIXES:
            lengths = document_lengths(mix, seq, np.random.default_rng(0), scale=opts.doc_scale)
            ids = jnp.asarray(np.repeat(np.arange(len(lengths)), lengths)[None], jnp.int32)
            runs = masks.run_ids(ids)
            vis_docs = masks.visibility(causal, pos, pos, runs, runs)
            add(f"ours {mix}", attend, (vis_docs,), vis_docs)
            info["mixes"][mix] = dict(
                documents=len(lengths), min_len=int(lengths.min()), max_len=int(lengths.max()),
                pairs=visible_pairs(seq, lengths=lengths),
            )  # fmt: skip
    return progs, info


def measure_point(case: str, seq: int, kv: int, hd: int, opts, say) -> list[dict]:
    progs, info = point_programs(case, seq, kv, hd, opts)
    errors = {}
    for p in progs:
        try:
            compile_program(p)
        except Exception as err:  # a program that does not build or run: recorded, the rest go on
            errors[f"{p.side} {p.kind}"] = f"{type(err).__name__}: {err}"[:2000]
            say(f"  {p.side} {p.kind}: FAILED {errors[f'{p.side} {p.kind}'][:300]}")
            traceback.print_exc(limit=3)
    ok = [p for p in progs if p.f is not None]
    diff = _out_difference(ok)
    for p in ok:
        p.first = None
    if not ok:
        return [_row_base(case, seq, kv, hd, opts, info) | dict(errors=errors)]
    # times_in_rounds reads key "unsharded" first (the warm-up) and labels others by key[1].
    keys = {("unsharded" if i == 0 else (p.side, f"{p.side} {p.kind}")): p for i, p in enumerate(ok)}
    times, readings = times_in_rounds({key: (p.f, p.args) for key, p in keys.items()}, opts)
    t = {}
    for key, p in keys.items():
        t.setdefault(p.side, {})[p.kind] = times[key] * 1e3
    read = {f"{p.side} {p.kind}": [x * 1e3 for x in readings[key]] for key, p in keys.items()}
    compile_s = {f"{p.side} {p.kind}": p.compile for p in ok}
    base = _row_base(case, seq, kv, hd, opts, info) | dict(
        errors=errors, compile_s=compile_s, readings_ms=read
    )
    if case in ("causal", "window"):
        ref = opts.reference
        row = base | dict(
            t_ms=t,
            ratio={k: _div(t.get("ours", {}).get(k), t.get(ref, {}).get(k)) for k in KINDS},
            tflops={
                side: {k: model_tflops(info["pairs"], opts.heads, hd, k, ms / 1e3) for k, ms in kinds.items()}
                for side, kinds in t.items()
            },
            max_abs_diff_out=diff,
        )
        say(_line(row))
        return [row]
    rows = []
    heads = opts.heads
    causal_t = t.get("ours causal", {})
    for mix, m in info["mixes"].items():
        mine = t.get(f"ours {mix}", {})
        share = m["pairs"] / info["pairs"]
        time_share = {k: _div(mine.get(k), causal_t.get(k)) for k in KINDS}
        row = base | dict(
            mix=mix, mix_info=m, t_ms={"ours": mine, "ours causal": causal_t}, visible_share=share,
            time_share=time_share,
            time_over_visible={k: _div(v, share) for k, v in time_share.items()},
            tflops={"ours": {k: model_tflops(m["pairs"], heads, hd, k, x / 1e3) for k, x in mine.items()}},
        )  # fmt: skip
        say(_line(row))
        rows.append(row)
    return rows


def _out_difference(progs: list[Program]) -> float | None:
    """max |out_ours - out_reference| of the two fwd programs' first calls (None without both)."""
    outs = {}
    for p in progs:
        if p.kind == "fwd" and p.first is not None:
            outs[p.side] = p.first[0] if isinstance(p.first, tuple) else p.first
    if "ours" not in outs or len(outs) < 2:
        return None
    ref = next(v for side, v in outs.items() if side != "ours")
    return float(jnp.max(jnp.abs(outs["ours"].astype(jnp.float32) - ref.astype(jnp.float32))))


def _div(a, b):
    return None if a is None or b is None or b == 0 else a / b


def _row_base(case, seq, kv, hd, opts, info) -> dict:
    return dict(
        case=case, seq=seq, kv_heads=kv, heads=opts.heads, head_dim=hd, dtype="bfloat16",
        window=info.get("window"), visible_pairs=info.get("pairs"),
    )  # fmt: skip


def _fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def _line(row: dict) -> str:
    where = f"{row['case']:9s} S={human_tokens(row['seq']):>5s} KV {row['kv_heads']:2d} H {row['head_dim']}"
    t = row.get("t_ms", {})
    if row["case"] == "documents":
        ts = row["time_share"]
        return (
            f"{where} {row['mix']:5s}: ours fwd+bwd {_fmt(t['ours'].get('fwd+bwd'))} ms (causal "
            f"{_fmt(t['ours causal'].get('fwd+bwd'))}); time share fwd+bwd {_fmt(ts['fwd+bwd'])} "
            f"fwd {_fmt(ts['fwd'])} bwd {_fmt(ts['bwd'])} vs visible share {row['visible_share']:.3f}"
        )
    ours = t.get("ours", {})
    ref = next((v for k, v in t.items() if k != "ours"), {})
    r = row["ratio"]
    return (
        f"{where}: ours {_fmt(ours.get('fwd+bwd'))} ms, ref {_fmt(ref.get('fwd+bwd'))} ms; ours/ref "
        f"fwd+bwd {_fmt(r['fwd+bwd'])} fwd {_fmt(r['fwd'])} bwd {_fmt(r['bwd'])}; "
        f"max|out diff| {_fmt(row.get('max_abs_diff_out'), '.2e')}"
    )


def table(rows: list[dict]) -> str:
    lines = [
        "| case | S | KV | H | ours fwd+bwd ms | ref fwd+bwd ms | ours/ref fwd+bwd | fwd | bwd "
        "| ours TFLOP/s | ours compile s (fwd, bwd) | time / visible share |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        t = row.get("t_ms", {})
        ours = t.get("ours", {})
        ref = {} if row["case"] == "documents" else next((v for k, v in t.items() if k != "ours"), {})
        r = row.get("ratio", {})
        comp = row.get("compile_s", {})
        side = "ours" if row["case"] != "documents" else f"ours {row['mix']}"
        c = [comp.get(f"{side} {k}", {}).get("total_s") for k in ("fwd", "bwd")]
        share = row.get("time_over_visible", {}).get("fwd+bwd")
        case = row["case"] + (f" {row['mix']}" if row["case"] == "documents" else "")
        case += f" {human_tokens(row['window'])}" if row.get("window") else ""
        lines.append(
            f"| {case} | {human_tokens(row['seq'])} | {row['kv_heads']} | {row['head_dim']} "
            f"| {_fmt(ours.get('fwd+bwd'))} | {_fmt(ref.get('fwd+bwd'))} | {_fmt(r.get('fwd+bwd'))} "
            f"| {_fmt(r.get('fwd'))} | {_fmt(r.get('bwd'))} "
            f"| {_fmt(row.get('tflops', {}).get('ours', {}).get('fwd+bwd'), '.0f')} "
            f"| {_fmt(c[0], '.1f')}, {_fmt(c[1], '.1f')} | {_fmt(share)} |"
        )
    return "\n".join(lines)


def write_png(path: str, rows: list[dict], reference: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    docs = [r for r in rows if r["case"] == "documents" and r.get("time_share")]
    fig, axes = plt.subplots(1, 3 if docs else 2, figsize=(15 if docs else 11, 4.2))
    styles = {"fwd+bwd": "-", "fwd": "--", "bwd": ":"}
    shown = [r for r in rows if r["case"] in ("causal", "window") and r.get("ratio")]
    for kv, hd in sorted({(r["kv_heads"], r["head_dim"]) for r in shown}):
        mine = [r for r in shown if (r["kv_heads"], r["head_dim"]) == (kv, hd)]
        color = None
        for kind, style in styles.items():
            pts = sorted(
                (r["seq"], r["ratio"][kind]) for r in mine if r["case"] == "causal" and r["ratio"][kind]
            )
            if pts:
                (line,) = axes[0].plot(
                    [p[0] / 1024 for p in pts], [p[1] for p in pts], style, marker="o", color=color,
                    label=f"{kind}, KV {kv}, H {hd}",
                )  # fmt: skip
                color = line.get_color()
            win = [(r["seq"], r["ratio"][kind]) for r in mine if r["case"] == "window" and r["ratio"][kind]]
            for s, x in win:
                axes[0].plot([s / 1024], [x], marker="*", ms=11, color=color, ls="none")
        fb = sorted((r["seq"], r["tflops"]) for r in mine if r["case"] == "causal")
        for side, style in (("ours", "-"), (reference, "--")):
            pts = [(s, tf[side]["fwd+bwd"]) for s, tf in fb if tf.get(side, {}).get("fwd+bwd")]
            if pts:
                axes[1].plot(
                    [p[0] / 1024 for p in pts], [p[1] for p in pts], style, marker="o", color=color,
                    label=f"{side}, KV {kv}, H {hd}",
                )  # fmt: skip
    axes[0].axhline(1.0, color="k", lw=0.8)
    axes[0].set_title(f"ours / {reference} time (< 1: ours faster); * window")
    axes[0].set_ylabel("time ratio")
    axes[1].set_title("causal fwd+bwd, model TFLOP/s")
    axes[1].set_ylabel("TFLOP/s")
    for ax in axes[:2]:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence (k tokens)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, ncol=2)
    if docs:
        ax = axes[2]
        labels = [f"{r['mix']} KV{r['kv_heads']} H{r['head_dim']}" for r in docs]
        x = np.arange(len(docs))
        ax.bar(x - 0.2, [r["visible_share"] for r in docs], 0.4, label="visible share")
        ax.bar(x + 0.2, [r["time_share"]["fwd+bwd"] or 0 for r in docs], 0.4, label="time share (fwd+bwd)")
        ax.set_xticks(x, labels, fontsize=7, rotation=20)
        ax.set_title(f"documents at {human_tokens(docs[0]['seq'])}: share of the causal call")
        ax.legend(fontsize=7)
    fig.suptitle(f"Mosaic GPU attention vs {reference}, bf16, {rows[0]['heads']} query heads, batch 1")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the grid ------------------------------------------------------------------------------------


def grid(opts) -> list[tuple[str, int, int, int]]:
    """(case, S, KV heads, head dim) in the order run: per head dim and KV count, causal up to
    --masked-seq by S, the window and the documents, then the longer causal ones (the slowest
    last, where --budget-s cuts)."""
    points = []
    for hd in opts.head_dim:
        for kv in opts.kv_heads:
            causal = [s for s in opts.seq if "causal" in opts.cases]
            points += [("causal", s, kv, hd) for s in causal if s <= opts.masked_seq]
            points += [(c, opts.masked_seq, kv, hd) for c in ("window", "documents") if c in opts.cases]
            points += [("causal", s, kv, hd) for s in causal if s > opts.masked_seq]
    return points


def config_changes(items: list[str]) -> dict:
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        out[name] = {"true": True, "false": False}.get(value.lower(), None)
        if out[name] is None:
            out[name] = int(value)
    return out


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", nargs="+", help="causal sequence lengths (default 8k 16k 32k 64k 128k)")
    p.add_argument("--kv-heads", nargs="+", type=int, help="default 8 32")
    p.add_argument("--head-dim", nargs="+", type=int, help="default 128")
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    p.add_argument("--heads", type=int, help="query heads (default 32)")
    p.add_argument("--masked-seq", help="the window's and the documents' length (default 64k)")
    p.add_argument("--window", type=int, help="the window's keys, the query's own included (default 4096)")
    p.add_argument("--rounds", type=int, help="interleaved readings of every program (default 4)")
    p.add_argument("--reading-s", type=float, help="seconds of back-to-back calls per reading (default 0.5)")
    p.add_argument("--warm-s", type=float, help="the first program's seconds first (default 2)")
    p.add_argument("--idle-s", type=float, default=0.0, help="the GPU's idle seconds before each reading")
    p.add_argument("--budget-s", type=float, help="skip the points that would end past this many seconds")
    p.add_argument("--fwd-config", nargs="*", default=[], help="forward Config changes, e.g. num_stages=3")
    p.add_argument("--bwd-config", nargs="*", default=[], help="BackwardConfig changes, e.g. block_k=128")
    p.add_argument(
        "--smoke", action="store_true", help="the CPU in seconds: blockwise for ours, XLA for cuDNN"
    )
    p.add_argument("--out", default="h200_mosaic_attention", help="benchmarks/results/{NAME}.json and .png")
    opts = p.parse_args(argv)
    small = opts.smoke
    default_seq = ["128", "256"] if small else ["8k", "16k", "32k", "64k", "128k"]
    opts.seq = [parse_tokens(s) for s in (opts.seq or default_seq)]
    opts.kv_heads = opts.kv_heads or ([2] if small else [8, 32])
    opts.head_dim = opts.head_dim or ([16] if small else [128])
    opts.heads = opts.heads or (4 if small else 32)
    opts.masked_seq = parse_tokens(opts.masked_seq or ("256" if small else "64k"))
    opts.window = opts.window or (32 if small else 4096)
    opts.doc_scale = 256 if small else 1  # document_lengths' bounds divided: 1-16 and 32-256 tokens
    opts.smoke_block = 32
    for name, full, smoke in (("rounds", 4, 2), ("reading_s", 0.5, 0.0), ("warm_s", 2.0, 0.0)):
        if getattr(opts, name) is None:
            setattr(opts, name, smoke if small else full)
    opts.reference = "xla" if small else "cudnn"
    opts.fwd_config, opts.bwd_config = config_changes(opts.fwd_config), config_changes(opts.bwd_config)
    if not small and jax.default_backend() != "gpu":
        p.error("the kernels need an sm_90 GPU; --smoke runs on the CPU")
    return opts


def out_paths(out: str) -> tuple[str, str]:
    base = out if os.path.dirname(out) else os.path.join(RESULTS, out)
    base = base[:-5] if base.endswith(".json") else base
    return base + ".json", base + ".png"


def main(argv=None) -> int:
    opts = parse(argv)
    say = lambda *a: print(*a, flush=True)
    js, png = out_paths(opts.out)
    os.makedirs(os.path.dirname(js) or ".", exist_ok=True)
    ours = "blockwise (plain jnp)" if opts.smoke else "mosaic_gpu"
    left = f"({opts.window - 1}, 0)"
    reference_window = (
        f"jax.nn.dot_product_attention(is_causal=True, local_window_size={left}, "
        f"implementation={opts.reference!r})"
    )
    if opts.reference == "cudnn":
        reference_window += f": jax's cuDNN path passes sliding_window_length={opts.window}"
    meta = dict(
        date=datetime.date.today().isoformat(), device=str(jax.devices()[0].device_kind), jax=jax.__version__,
        reference=opts.reference, smoke=opts.smoke, ours=ours, fwd_config=opts.fwd_config,
        bwd_config=opts.bwd_config, heads=opts.heads, batch=1, dtype="bfloat16", window_keys=opts.window,
        window_calls=dict(ours=f"masks.Mask(causal=True, window={left})", reference=reference_window),
        documents=dict(mixes=list(MIXES), seed=0, source="benchmarks/document_balance.py document_lengths"),
        timing=dict(rounds=opts.rounds, reading_s=opts.reading_s, warm_s=opts.warm_s, idle_s=opts.idle_s),
        visibility="computed once per point, outside the timed programs",
        command=" ".join(sys.argv),
    )  # fmt: skip
    rows: list[dict] = []
    skipped: list[dict] = []
    started = time.perf_counter()
    longest = 0.0
    points = grid(opts)

    def save():
        with open(js, "w") as f:
            json.dump({"meta": meta, "rows": rows, "skipped": skipped, "points": len(points)}, f, indent=1)

    say(f"{len(points)} points; ours {meta['ours']}, reference {opts.reference}; JSON {js}")
    for case, seq, kv, hd in points:
        elapsed = time.perf_counter() - started
        # The longest point so far, scaled by length for the longer ones: a rough guess that errs long.
        guess = longest * max(1.0, seq / max(1, rows[-1]["seq"])) if rows else 0.0
        if opts.budget_s is not None and rows and elapsed + guess > opts.budget_s:  # the first runs
            skipped.append(
                dict(case=case, seq=seq, kv_heads=kv, head_dim=hd, why=f"budget at {elapsed:.0f}s")
            )
            say(f"skip {case} S={human_tokens(seq)} KV {kv} H {hd}: {elapsed:.0f}s + ~{guess:.0f}s > budget")
            save()
            continue
        t0 = time.perf_counter()
        new = measure_point(case, seq, kv, hd, opts, say)
        for row in new:
            row["seconds"] = time.perf_counter() - t0
        rows += new
        longest = max(longest, time.perf_counter() - t0)
        save()
    say(f"\n{table(rows)}")
    if skipped:
        say(
            f"skipped {len(skipped)} points (budget): "
            + ", ".join(
                f"{s['case']} {human_tokens(s['seq'])} KV {s['kv_heads']} H {s['head_dim']}" for s in skipped
            )
        )
    if rows:
        write_png(png, rows, opts.reference)
        say(f"wrote {js} and {png} in {time.perf_counter() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
