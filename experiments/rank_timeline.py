"""Where a small rank's time goes: its kernels by name and kind, and the GPU's idle share.

Backs the question of what keeps a rank's masked attention above its share at small chunks
(benchmarks/results/README.md, finding 12: "small chunks pay fixed costs"): is it the attention
kernels themselves (a short grid fills the GPU less well), the masks' small XLA ops, or the gaps
between launches? One H200; the rank's fwd + bwd (``rank_without_transfer``, as
benchmarks/attention.py reads it; documents of 4096 with the whole sequence's ids), for each case:

- the time per call, back to back, and less the emulation's stand-in for the K/V gather (a copy
  of its own, timed alone: the benchmark's reading);
- from a profiler trace of a few calls: every kernel by name (time and launches per call), their
  summed time by kind (the Pallas kernels, cuDNN's, sorts, copies, XLA's other fusions), and the
  attention kernels of one call in launch order, ours each named from the compiled HLO
  (``rank_thunks.attention_calls``: the forward, dQ or dK/dV, and the keys it reads, which tells
  the local call from the remote one: in the trace they share names); the busy time against the
  call's time is the GPU's idle share, and the last call's idle gaps on the GPU say whether the
  idle time is spread over the launches (the host) or not;
- with ``--bwd-config name=value ...``, our backward kernels' ``BackwardConfig`` changed in every
  call the layer makes (e.g. ``narrow_small_grids=false``: the same case with and without it);
- with ``--hlo DIR``, the optimized HLO of each case, whose fusion names and source lines (its
  ``stack_frame_id`` tables) say what each XLA kernel is.

    python experiments/rank_timeline.py --seq 32k --n 1 8 --cases window512 causal \
        --implementations mosaic cudnn --json out.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import step_profile  # noqa: E402
from attention import (  # noqa: E402
    back_to_back,
    fwd_bwd,
    gathers,
    human_tokens,
    inputs,
    parse_tokens,
    rank_attention,
    stand_in_gather,
)
from mosaic_attention import config_changes  # noqa: E402
from rank_thunks import CASES, attention_calls, case_options  # noqa: E402  (shared by both probes: this folder is on the path)

# the module (the package re-exports its function under the same name)
mosaic_backward = importlib.import_module("jax_cpgrad.attention.mosaic_gpu.backward")


def kind(name: str) -> str:
    if "mosaic_gpu" in name:
        return "pallas"
    if "cudnn" in name or "sm90" in name or "fmha" in name.lower():
        return "cudnn"
    if name.startswith("sort"):
        return "sort"
    if "memcpy" in name or "memset" in name:
        return "copy"
    return "xla"


def timeline(f, args, steps: int) -> dict:
    """Every kernel of ``steps`` calls of f, by name: microseconds and launches per call; and the
    summed time by kind. (The calls are not told apart in the trace: totals over steps.)"""
    planes = step_profile.gpu_kernels(f, args, steps)
    if "error" in planes:
        return dict(error=planes["error"])
    events = step_profile.all_events(planes)
    by_name = step_profile.per_kernel(events, steps)
    by_kind: dict[str, float] = {}
    for name, (us, _) in by_name.items():
        by_kind[kind(name)] = by_kind.get(kind(name), 0.0) + us
    kernels = sorted(((n[:90], us, count / steps) for n, (us, count) in by_name.items()), key=lambda x: -x[1])
    # the attention kernels of the last call, in launch order (each call launches the same ones)
    attention = [e for e in events if kind(e[0]) in ("pallas", "cudnn")]
    pallas = sorted((start, (end - start) / 1e3) for _, start, end in attention)
    per_call = len(pallas) // steps
    in_order = [round(us, 1) for _, us in pallas[len(pallas) - per_call :]]
    return dict(
        launches=len(events) / steps, busy_us=sum(by_kind.values()), by_kind_us=by_kind, kernels=kernels,
        attention_kernels_in_order_us=in_order, **idle_of_last_call(events, steps),
    )  # fmt: skip


def idle_of_last_call(events, steps: int, listed: int = 6) -> dict:
    """The last call's span on the GPU (first kernel's start to last kernel's end), the time no
    kernel ran inside it, and its longest idle gaps with the kernel each followed: spread over
    every launch, the GPU waits on the host's launches; in a few places, on something else."""
    ordered = sorted(events, key=lambda e: e[1])
    call = ordered[len(ordered) - len(ordered) // steps :]
    gaps, end, last = [], call[0][2], call[0][0]  # last: the kernel that ended at ``end``
    for name, start, stop in call[1:]:
        if start > end:
            gaps.append(((start - end) / 1e3, last[:60]))
        if stop > end:
            end, last = stop, name
    gaps.sort(key=lambda g: -g[0])
    return dict(
        call_span_us=(end - call[0][1]) / 1e3, call_idle_us=sum(us for us, _ in gaps),
        call_gaps=len(gaps), longest_gaps_us=[(round(us, 1), name) for us, name in gaps[:listed]],
    )  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=parse_tokens, default=32 * 1024)
    p.add_argument("--n", type=int, nargs="+", default=[1, 8])
    p.add_argument("--cases", nargs="+", default=["window512", "causal"], choices=sorted(CASES))
    p.add_argument("--implementations", nargs="+", default=["mosaic"])
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--reading-s", type=float, default=1.0)
    p.add_argument("--list", type=int, default=60, help="kernels listed per case")
    p.add_argument("--hlo", help="a folder: each case's optimized HLO (to tell what a fusion is)")
    p.add_argument("--bwd-config", nargs="*", default=[], help="BackwardConfig changes, e.g. consumers=1")
    p.add_argument("--json")
    opts = p.parse_args(argv)
    changes = config_changes(opts.bwd_config)
    if changes:  # the layer's calls take the default config: change it where they read it
        default = mosaic_backward.default_config
        mosaic_backward.default_config = lambda *a, **kw: default(*a, **kw).replace(**changes)
    rows = []
    for case in opts.cases:
        for impl in opts.implementations:
            for n in opts.n:
                local = opts.seq // n
                data = inputs(local, 32, opts.kv_heads, 128, seed=n)
                options = case_options(case, opts.seq)
                f = fwd_bwd(
                    lambda q, k, v, rank, n=n, i=impl, options=options: rank_attention(
                        q, k, v, rank, n, implementation=i, **options
                    )
                )
                args = (*data, jnp.int32(n - 1))
                started = time.perf_counter()  # the first call: trace, compile, run
                jax.block_until_ready(f(*args))
                first_call_s = time.perf_counter() - started
                t = back_to_back(f, args, opts.reading_s)
                # the emulation's stand-in for the K/V gather, a copy of its own in every call
                # (two kernels in the lists below) that a real rank does not make
                stand_in = 0.0
                if gathers(n, local // 2, options["window"], options["max_document_length"]):
                    stand_in = back_to_back(stand_in_gather(n), data[1:3], opts.reading_s)
                row = dict(
                    case=case,
                    implementation=impl,
                    n=n,
                    seq=opts.seq,
                    ms=t * 1e3,
                    stand_in_ms=stand_in * 1e3,
                    bwd_config=changes,
                    first_call_s=first_call_s,
                )
                row |= timeline(f, args, steps=3)
                hlo = f.lower(*args).compile().as_text()
                row["attention_calls"] = attention_calls(hlo)  # what each kernel in launch order is
                if opts.hlo:
                    os.makedirs(opts.hlo, exist_ok=True)
                    with open(os.path.join(opts.hlo, f"{case}_{impl}_n{n}.hlo.txt"), "w") as fh:
                        fh.write(hlo)
                rows.append(row)
                kinds = ", ".join(f"{k} {v:.0f}" for k, v in sorted(row.get("by_kind_us", {}).items()))
                print(
                    f"{case} {impl} {changes or ''} S={human_tokens(opts.seq)} R={n} rank {n - 1}: "
                    f"{t * 1e3:.3f} ms a call, {(t - stand_in) * 1e3:.3f} less the stand-in gather "
                    f"(the first {first_call_s:.1f} s); "
                    f"{row.get('launches', 0):.0f} launches, busy {row.get('busy_us', 0):.0f} us; {kinds}",
                    flush=True,
                )
                print(
                    f"      the last call on the GPU: {row.get('call_span_us', 0):.0f} us, idle "
                    f"{row.get('call_idle_us', 0):.0f} us in {row.get('call_gaps', 0)} gaps; the longest "
                    f"(us, after): {row.get('longest_gaps_us')}"
                )
                order = row.get("attention_kernels_in_order_us") or []
                names = row["attention_calls"]
                if len(names) == len(order):  # our kernels alone (cuDNN's are not named)
                    order = [f"{name} {us}" for name, us in zip(names, order, strict=True)]
                print(f"      attention kernels in launch order (us): {order}")
                for name, us, count in row.get("kernels", [])[: opts.list]:
                    print(f"      {us:8.1f} us  x{count:<4.0f} {name}")
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
