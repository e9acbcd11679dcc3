"""Where a step's communication sits on each GPU, from a JAX profiler trace.
The exposed-time columns of cp_step.py's tables (the results' findings 4 and 5); not run alone.

Runs a compiled step a few times under ``jax.profiler`` and reads the trace back (ProfileData,
no viewer): per GPU, the kernels of each stream, split into the peer transport's, NCCL's for the
CP collectives, NCCL's for the parameter gradients, and the rest (compute). Reported per step:
how long each kind ran, how much of that no compute kernel ran beside (exposed), the streams
each kind used, and how long no kernel ran at all (idle). Kernels that XLA launched inside a CUDA
graph are reported on the stream the graph was launched on.
"""

from __future__ import annotations

import glob
import os
import tempfile

import jax

# Event names (substrings) by kind, first match wins; everything else on a GPU stream is compute.
# peer: the device protocol's kernels (ll_*: its small calls as LL words) and the memop protocol's.
# The parameter gradients' all-reduce is NCCL's in every transport (cp_step.py), so it is counted
# apart; so are NCCL's other kernels, and memory copies and sets (neither compute nor ours).
KINDS = {
    "peer": (
        "fused_grad_return",
        "fused_all_gather",
        "ll_grad_return",
        "ll_all_gather",
        "copy_rows",
        "accumulate_rows",
    ),
    "nccl_cp": ("ncclDevKernel_AllGather", "ncclDevKernel_ReduceScatter"),
    "nccl_params": ("ncclDevKernel_AllReduce",),
    "nccl_other": ("nccl",),
    "copies": ("Memcpy", "Memset", "memcpy", "memset"),
}


def kind_of(event: str) -> str:
    for kind, names in KINDS.items():
        if any(n in event for n in names):
            return kind
    return "compute"


def _union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _length(intervals) -> int:
    return sum(end - start for start, end in intervals)


def _minus(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of union a not covered by union b (both sorted and disjoint)."""
    out, j = [], 0
    for start, end in a:
        cur = start
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


def summarize_gpu(streams: dict[str, list[tuple[str, int, int]]], steps: int) -> dict:
    """streams: {stream name: [(kernel name, start ns, end ns)]} of one GPU -> per-step figures
    (ms): per kind, its kernels' time, the part of it that no compute kernel ran beside
    (exposed) and its streams; and the time no event at all ran between the trace's first and
    last (idle; it includes the host's gap between the traced steps, and a memop wait)."""
    by_kind: dict[str, list] = {kind: [] for kind in (*KINDS, "compute")}
    streams_of: dict[str, set] = {kind: set() for kind in by_kind}
    for stream, events in streams.items():
        for name, start, end in events:
            kind = kind_of(name)
            by_kind[kind].append((start, end))
            streams_of[kind].add(stream)
    compute = _union(by_kind["compute"])
    everything = _union([iv for ivs in by_kind.values() for iv in ivs])
    ms = lambda ns: ns / 1e6 / steps
    out: dict = {
        "compute_ms": ms(_length(compute)),
        "idle_ms": ms(everything[-1][1] - everything[0][0] - _length(everything)) if everything else 0.0,
        "compute_streams": sorted(streams_of["compute"]),
    }
    for kind in KINDS:
        spans = _union(by_kind[kind])
        out[kind] = {
            "ms": ms(_length(spans)),
            "exposed_ms": ms(_length(_minus(spans, compute))),
            "kernels_per_step": len(by_kind[kind]) / steps,
            "streams": sorted(streams_of[kind]),
        }
    return out


def profile_step(compiled, args, steps: int = 2) -> dict:
    """{GPU plane name: summarize_gpu(...)} over `steps` runs of `compiled` (already warm), or
    {"error": why} when there is no trace to read."""
    try:
        return _profile(compiled, args, steps)
    except Exception as err:  # the profile is an extra: it must not cost the row its timing
        return {"error": f"{type(err).__name__}: {err}"[:500]}


def _profile(compiled, args, steps: int) -> dict:
    planes = gpu_kernels(compiled, args, steps)
    if "error" in planes:
        return planes
    return {plane: summarize_gpu(streams, steps) for plane, streams in planes.items()}


def top_kernels(f, args, steps: int = 3, count: int = 12) -> list[tuple[str, float, int]]:
    """The `count` kernels that ran longest over `steps` runs of f(*args) (already warm), on all
    GPUs: (name, microseconds per run, launches per run); [] when there is no GPU trace."""
    planes = gpu_kernels(f, args, steps)
    if "error" in planes:
        return []
    ranked = sorted(per_kernel(all_events(planes), steps).items(), key=lambda kv: -kv[1][0])[:count]
    return [(name, us, launches // steps) for name, (us, launches) in ranked]


def all_events(planes: dict) -> list[tuple[str, int, int]]:
    """Every kernel event of :func:`gpu_kernels`' planes, every GPU's and stream's together."""
    return [e for streams in planes.values() for events in streams.values() for e in events]


def per_kernel(events, steps: int) -> dict[str, tuple[float, int]]:
    """{kernel name: (microseconds per run, launches over all runs)} of (name, start ns, end ns)
    events recorded over `steps` runs."""
    totals: dict[str, tuple[float, int]] = {}
    for name, start, end in events:
        us, launches = totals.get(name, (0.0, 0))
        totals[name] = (us + (end - start) / 1e3 / steps, launches + 1)
    return totals


def gpu_kernels(compiled, args, steps: int) -> dict:
    """{GPU plane name: {stream name: [(kernel name, start ns, end ns)]}} over `steps` runs of
    `compiled`, or {"error": why}."""
    with tempfile.TemporaryDirectory() as log_dir:
        jax.profiler.start_trace(log_dir)
        try:
            for _ in range(steps):
                jax.block_until_ready(compiled(*args))
        finally:
            jax.profiler.stop_trace()
        paths = glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True)
        if not paths:
            return {"error": "the profiler wrote no trace"}
        data = jax.profiler.ProfileData.from_file(max(paths, key=os.path.getmtime))
    out = {}
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU:"):
            continue
        out[plane.name] = {
            line.name: [(e.name, e.start_ns, e.end_ns) for e in line.events]
            for line in plane.lines
            if line.name.startswith("Stream")  # the other lines re-list the same kernels by op
        }
    return out or {"error": "the trace has no GPU plane (is CUPTI available?)"}
