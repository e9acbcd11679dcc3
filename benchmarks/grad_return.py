"""grad_return and all_gather side by side: the peer transport (each workspace protocol) vs bare NCCL
vs NCCL with symmetric-memory kernels vs the reorder + collective recipe vs the ceiling, in one run.
Makes the README's "When to use it" table and the results' findings 1 and 3 (benchmarks/results/README.md).

    python benchmarks/grad_return.py                                   # every GPU of this process
    python -m jax_cpgrad.launch -n 2 benchmarks/grad_return.py         # one process per GPU
    python benchmarks/grad_return.py --cpu --sizes 64K 1M              # CPU smoke (XLA's CPU collectives)

Each point moves dK and dV together: two tensors of the given global size, [S, 8, 128] with the
sequence axis first. Transports:
  nccl        bare jax.lax.psum_scatter / all_gather (tiled) on data already in owner order
  nccl-symm   the same, compiled with xla_gpu_experimental_enable_nccl_symmetric_buffers=True (GPU only)
  xla-recipe  cpg.grad_return / cpg.all_gather without a workspace: chunk reorder + the collective
              (what TE-JAX's reduce_scatter_dkv does)
  peer-<P>    cpg.grad_return / cpg.all_gather with a Workspace(protocol=P)
On the CPU, `nccl` and `xla-recipe` run over XLA's CPU collectives, not NCCL (the JSON's `backend`).

Two timing modes:
  latency     calls straight-line in one jit, each chained after the previous one's outputs by an
              optimization barrier (so XLA neither merges nor reorders them): programs of K/4 and
              K = --calls calls, time per call = their time difference / their call difference
              (what running one executable costs drops out). Sizes <= --latency-max (all default).
  bandwidth   a fori_loop of --iters calls (a one-row bump per iteration keeps XLA from hoisting
              the call); time per call = wall time / iters. XLA's while loop costs a host round trip
              per iteration (~50 us on H200s, whatever the transport), which this mode includes:
              it is what a scan over layers sees. Sizes >= --bandwidth-min.
With several processes, a barrier before each timed run starts them together; rank 0's times
are reported.
Both report the median over --reps (and min-max), the bus bandwidth (R-1)/R * 2 * global bytes /
time (NCCL's convention, for both ops), the ratio to the faster of nccl and nccl-symm at that point
(`vs best nccl`, > 1 is faster) and the fraction of the ceiling (ceiling time / time). The ceiling
(GPUs of their own only, benchmarks/ceiling.py): every GPU pushing its bytes to every peer at
once, plus the op's local memory traffic at device-copy speed, measured here, now.

Writes the tables to stdout (one block per op and mode), --json and --png (--from-json: plot an
earlier JSON, e.g. from a machine without matplotlib).
"""

from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast (the launcher sets it too)
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave room for the workspaces

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_cpgrad as cpg  # noqa: E402
from jax_cpgrad import launch  # noqa: E402

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # run through runpy or imported
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ceiling as ceiling_lib  # noqa: E402  (benchmarks/ceiling.py, next to this script)
from sizes import human, parse_size  # noqa: E402
from workspace_options import workspace_options  # noqa: E402

AXIS = "cp"
SEQ_AXIS = 0
INNER = (8, 128)  # [S, 8, 128] per tensor
TENSORS = 2  # dK and dV
NCCL_TRANSPORTS = ("nccl", "nccl-symm")
SYMM_OPTIONS = {"xla_gpu_experimental_enable_nccl_symmetric_buffers": True}
SYNC_TIMEOUT_S = 300.0
WORKSPACE_TIMEOUT_S = 120.0  # a peer that never arrives fails the call in 2 minutes, not in 10


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--op", choices=["grad_return", "all_gather", "both"], default="both")
    p.add_argument("--modes", nargs="+", choices=["latency", "bandwidth"], default=["latency", "bandwidth"])
    p.add_argument(
        "--sizes",
        nargs="+",
        default=["64K", "256K", "1M", "4M", "16M", "64M", "256M", "1G"],
        help="global bytes per tensor",
    )
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument(
        "--protocols",
        nargs="+",
        default=None,
        help="peer workspace protocols (default: device memop with a GPU per rank, memop when "
        "ranks share one GPU); device:B:S tunes the device protocol: B SMs, a share S of them pushing; "
        "+overlap runs every call as a start/done pair on the workspace's own stream",
    )
    p.add_argument("--calls", type=int, default=20, help="straight-line calls per jit (latency mode)")
    p.add_argument(
        "--head-start",
        type=int,
        default=0,
        help="latency mode: bf16 matmuls of 4096^2 (~0.2 ms each on an H200) before each chain, so that the "
        "host has enqueued the chain before the GPU reaches it (the slope is then GPU time)",
    )
    p.add_argument("--iters", type=int, default=20, help="calls per fori_loop (bandwidth mode)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per point")
    p.add_argument("--latency-max", default="1G", help="largest size timed in latency mode")
    p.add_argument("--bandwidth-min", default="1M", help="smallest size timed in bandwidth mode")
    p.add_argument("--n", type=int, default=None, help="CP size (default: every device)")
    p.add_argument("--cpu", action="store_true", help="8 CPU devices (XLA's CPU collectives only)")
    p.add_argument("--json", default="grad_return.json")
    p.add_argument("--png", default="grad_return.png", help="'' for no plot")
    p.add_argument("--from-json", default=None, help="measure nothing: plot this earlier --json into --png")
    return p.parse_args(argv)


LATENCY_OUTPUT_BUDGET = 8 << 30  # bytes per device of a latency chain's outputs

# -- what is measured ---------------------------------------------------------------------------


def _bare_reduce_scatter(x):
    return jax.lax.psum_scatter(x, AXIS, scatter_dimension=SEQ_AXIS, tiled=True)


def _bare_all_gather(x):
    return jax.lax.all_gather(x, AXIS, axis=SEQ_AXIS, tiled=True)


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    api: object  # cpg.grad_return or cpg.all_gather
    bare: object  # one array -> the bare XLA collective
    takes_shard: bool  # each rank passes its local shard (all_gather), not the global tensor

    def input_len(self, seq: int, n: int) -> int:
        return seq // n if self.takes_shard else seq


OPS = {
    "grad_return": Op("grad_return", cpg.grad_return, _bare_reduce_scatter, takes_shard=False),
    "all_gather": Op("all_gather", cpg.all_gather, _bare_all_gather, takes_shard=True),
}


def _local_stand_in(op: Op, x):
    """An XLA op with the collective's input and output shapes and no communication."""
    n = jax.lax.axis_size(AXIS)
    if op.takes_shard:
        return jnp.concatenate([x] * n, axis=SEQ_AXIS) * 2
    return jax.lax.slice_in_dim(x, 0, x.shape[SEQ_AXIS] // n, axis=SEQ_AXIS) * 2


@dataclasses.dataclass(frozen=True)
class Transport:
    name: str
    kind: str  # "bare", "recipe", "peer" or "local"
    description: str
    protocol: str | None = None
    compiler_options: tuple = ()  # (key, value) pairs for Lowered.compile

    def body(self, op: Op, ws):
        """The per-rank function (k, v) -> tuple of outputs for this transport and op."""
        if self.kind == "bare":
            return lambda k, v: (op.bare(k), op.bare(v))
        if self.kind == "local":
            return lambda k, v: (_local_stand_in(op, k), _local_stand_in(op, v))
        workspace = ws if self.kind == "peer" else None
        return lambda k, v: tuple(op.api((k, v), axis_name=AXIS, seq_axis=SEQ_AXIS, workspace=workspace))


def plan_transports(backend: str, shared_gpu: bool, peer_ok: bool, protocols) -> list[Transport]:
    """The transports this run can measure, in table order."""
    coll = "NCCL" if backend == "gpu" else f"XLA's {backend.upper()} collectives, not NCCL"
    out = [
        Transport(
            "local",
            "local",
            "no communication: one local XLA op of the same shapes (the harness and XLA per call)",
        )
    ]
    if not shared_gpu:  # NCCL refuses several ranks on one GPU
        out.append(Transport("nccl", "bare", f"bare psum_scatter / all_gather, tiled, owner order ({coll})"))
        if backend == "gpu":
            out.append(
                Transport(
                    "nccl-symm",
                    "bare",
                    "bare psum_scatter / all_gather with NCCL's "
                    "symmetric-memory kernels (xla_gpu_experimental_enable_nccl_symmetric_"
                    "buffers=True)",
                    compiler_options=tuple(SYMM_OPTIONS.items()),
                )
            )
        out.append(Transport("xla-recipe", "recipe", f"chunk reorder + psum_scatter / all_gather ({coll})"))
    if peer_ok:
        out += [
            Transport(f"peer-{p}", "peer", f"jax_cpgrad peer transport, Workspace(protocol={p!r})", p)
            for p in protocols
        ]
    return out


# -- building and timing one jitted function --------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Point:
    dtype: str
    size: int  # requested global bytes per tensor
    seq: int
    global_bytes: int  # actual global bytes per tensor
    local_bytes: int  # global_bytes / R


def make_point(size: int, dtype: str, n: int) -> Point:
    row = math.prod(INNER) * jnp.dtype(dtype).itemsize
    seq = max(2 * n, size // row // (2 * n) * (2 * n))  # S divisible by 2R (the CP chunks)
    return Point(dtype, size, seq, seq * row, seq * row // n)


@functools.lru_cache(maxsize=16)
def _filler(mesh, shape, dtype, count):
    """A jitted function that creates `count` distinct arrays of `shape`, sharded over the mesh."""
    sharding = NamedSharding(mesh, P(AXIS))
    return jax.jit(lambda: [jnp.full(shape, i + 1, dtype) for i in range(count)], out_shardings=sharding)


def make_pairs(mesh, op: Op, n: int, point: Point, count: int):
    """`count` distinct (dK, dV) pairs; each rank's block is the op's input, [L, 8, 128]."""
    shape = (n * op.input_len(point.seq, n), *INNER)
    arrays = _filler(mesh, shape, point.dtype, TENSORS * count)()
    return [tuple(arrays[TENSORS * i : TENSORS * (i + 1)]) for i in range(count)]


HEAD_START_DIM = 4096  # one head-start matmul: 4096^3 bf16 multiply-adds, ~0.2 ms on an H200


def _head_start(pair, matmuls: int):
    """`matmuls` dependent bf16 matmuls that the chain waits for: while the GPU works through them
    the host enqueues the whole chain, so the chain's slope is GPU time, not host dispatch.
    Returns the pair (now after the matmuls) and one element of the product, which the caller
    must use: an unused product would be compiled away."""
    m = jnp.full((HEAD_START_DIM, HEAD_START_DIM), 1e-3, jnp.bfloat16) + pair[0].ravel()[0].astype(
        jnp.bfloat16
    )
    for _ in range(matmuls):
        m = m @ m
    pair, m = jax.lax.optimization_barrier((pair, m))
    return pair, m[0, 0].astype(jnp.float32)


def latency_fn(body, calls: int, head_start: int = 0):
    """`calls` straight-line calls on one input pair, each tied to the previous call's outputs by
    an optimization barrier: XLA can neither merge them (NCCL's combiners, CSE of calls without
    side effects) nor reorder them. One element of every call's outputs goes into the one scalar
    returned, so that no call is dead code (a device-protocol call has no side effects: XLA would
    drop it) while the program has one output whatever its length (returning every output cost
    the runtime several microseconds per output). head_start: matmuls the chain waits for (see
    _head_start)."""

    def run(pair):
        head = jnp.zeros((), jnp.float32)
        if head_start:
            pair, head = _head_start(pair, head_start)
        outs, prev = [], None
        for _ in range(calls):
            if prev is not None:
                pair, prev = jax.lax.optimization_barrier((pair, prev))
            prev = body(*pair)
            outs.append(prev)
        return (head + _first_elements_sum(o for call in outs for o in call))[None]

    return run


def _first_elements_sum(arrays):
    return sum(a[(0,) * a.ndim].astype(jnp.float32) for a in arrays)


def bandwidth_fn(body, iters: int):
    """A fori_loop of `iters` calls; a one-row bump per call keeps XLA from hoisting the call."""

    def run(pair):
        def step(_, carry):
            pair, acc = carry
            pair = tuple(x.at[0].add(1) for x in pair)
            outs = body(*pair)
            return pair, acc + _first_elements_sum(outs)

        _, acc = jax.lax.fori_loop(0, iters, step, (pair, jnp.zeros((), jnp.float32)))
        return acc[None]

    return run


def jitted(mesh, fn):
    """jit(shard_map(fn)) over the CP axis: fn takes one pytree of per-rank blocks."""
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(AXIS),), out_specs=P(AXIS), check_vma=False))


def compile_fn(mesh, fn, args, compiler_options=()):
    return jitted(mesh, fn).lower(*args).compile(compiler_options=dict(compiler_options) or None)


def time_per_call(compiled, args, calls_per_run: int, reps: int, sync) -> dict:
    """Median/min/max seconds per call over `reps` runs, after two warm-up runs."""
    for _ in range(2):
        jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append((time.perf_counter() - t0) / calls_per_run)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def time_per_call_slope(short, long, args, calls: tuple[int, int], reps: int, sync) -> dict:
    """Seconds per call from two straight-line programs of calls[0] and calls[1] calls: the
    difference of their times over the difference of their call counts, so the fixed cost of
    running one executable (dispatch, argument handling) drops out. Runs alternate; the spread is
    that of the per-repetition slopes."""
    for _ in range(2):
        jax.block_until_ready(short(*args))
        jax.block_until_ready(long(*args))
    slopes = []
    for _ in range(reps):
        times = []
        for compiled in (short, long):
            sync()
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times.append(time.perf_counter() - t0)
        slopes.append((times[1] - times[0]) / (calls[1] - calls[0]))
    return {"median_s": statistics.median(slopes), "min_s": min(slopes), "max_s": max(slopes)}


# -- arithmetic of the report -------------------------------------------------------------------


def busbw_gbps(n: int, global_bytes: int, tensors: int, seconds: float) -> float:
    """NCCL's bus bandwidth for reduce-scatter and all-gather: (N-1)/N of the global bytes / time."""
    if n <= 1 or not seconds:
        return 0.0
    return (n - 1) / n * tensors * global_bytes / seconds / 1e9


def _point_key(row: dict) -> tuple:
    return row["op"], row["dtype"], row["global_bytes_per_tensor"]


def annotate(rows: list[dict], ceiling_s: dict) -> None:
    """Add busbw, `vs best nccl` and `of ceiling` to each row. ceiling_s: (op, dtype, global bytes)
    -> seconds per call, or None. The NCCL reference is the faster of nccl and nccl-symm in the
    same mode at the same point."""
    best = {}
    for r in rows:
        if r["transport"] in NCCL_TRANSPORTS:
            key = (r["mode"], *_point_key(r))
            best[key] = min(best.get(key, math.inf), r["median_s"])
    for r in rows:
        if r["transport"] == "local":  # moves nothing between GPUs: no bandwidth, ratio or ceiling
            r.update(busbw_gbps=None, vs_best_nccl=None, ceiling_s=None, of_ceiling=None)
            continue
        r["busbw_gbps"] = busbw_gbps(r["n"], r["global_bytes_per_tensor"], r["tensors"], r["median_s"])
        ref = best.get((r["mode"], *_point_key(r)))
        r["vs_best_nccl"] = ref / r["median_s"] if ref else None
        c = ceiling_s.get(_point_key(r))
        r["ceiling_s"] = c
        r["of_ceiling"] = c / r["median_s"] if c else None


# -- the run ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Bench:
    opts: argparse.Namespace
    mesh: Mesh
    n: int
    backend: str
    shared_gpu: bool
    ops: list
    transports: list
    rank0: bool
    notes: list = dataclasses.field(default_factory=list)
    skipped: dict = dataclasses.field(default_factory=dict)
    peer_protocols: dict = dataclasses.field(default_factory=dict)
    ceiling_off: str | None = None  # why there is no ceiling, once known
    _sync_ids: itertools.count = dataclasses.field(default_factory=itertools.count)

    def say(self, *args) -> None:
        if self.rank0:
            print(*args, flush=True)

    def note(self, text: str, every_rank: bool = False) -> None:
        """A remark for stdout (an error on every rank: it may concern only one) and the JSON."""
        if every_rank or self.rank0:
            print(f"NOTE: {text}", flush=True)
        if text not in self.notes:
            self.notes.append(text)

    def sync(self) -> None:
        """All processes start a timed run together (no-op in one process)."""
        if jax.process_count() > 1:
            from jax_cpgrad import benchmarking

            benchmarking.barrier(f"jax_cpgrad_bench/rep/{next(self._sync_ids)}", SYNC_TIMEOUT_S)


def setup(opts) -> Bench:
    devices = jax.devices()
    n = opts.n or len(devices)
    mesh = Mesh(np.array(devices[:n]), (AXIS,))
    backend = "gpu" if devices[0].platform in ("gpu", "cuda") else devices[0].platform
    shared_gpu = backend == "gpu" and launch.ranks_share_gpu()
    protocols = opts.protocols or (["memop"] if shared_gpu else ["device", "memop"])
    peer_ok = backend == "gpu" and cpg.HAS_CUDA
    ops = list(OPS.values()) if opts.op == "both" else [OPS[opts.op]]
    bench = Bench(
        opts,
        mesh,
        n,
        backend,
        shared_gpu,
        ops,
        plan_transports(backend, shared_gpu, peer_ok, protocols),
        rank0=jax.process_index() == 0,
    )
    if backend == "gpu" and not cpg.HAS_CUDA:
        bench.note("jax_cpgrad was built without CUDA: no peer transport")
    if shared_gpu:
        bench.note(
            f"{n} processes share one GPU (time-sliced): these figures say nothing about NVLink; "
            "NCCL cannot run in this mode and there is no cross-GPU ceiling"
        )
        bench.ceiling_off = "ranks share one GPU (time-sliced): no cross-GPU ceiling"
    elif backend != "gpu":
        bench.ceiling_off = f"no ceiling on the {backend}"
    return bench


def modes_for(bench: Bench, point: Point) -> list[str]:
    opts = bench.opts
    keep = {
        "latency": point.size <= parse_size(opts.latency_max),
        "bandwidth": point.size >= parse_size(opts.bandwidth_min),
    }
    return [m for m in opts.modes if keep[m]]


def measure(bench: Bench, op: Op, mode: str, transport: Transport, ws, point: Point) -> dict | None:
    """One row: time per call of `transport` doing `op` at `point` in `mode`."""
    n, opts = bench.n, bench.opts
    pair = make_pairs(bench.mesh, op, n, point, 1)[0]
    if mode == "latency":
        # Every call's outputs may stay alive to the end (see latency_fn): at most
        # LATENCY_OUTPUT_BUDGET of them.
        per_call = TENSORS * (point.local_bytes if op.name == "grad_return" else point.global_bytes)
        most = min(opts.calls, max(8, LATENCY_OUTPUT_BUDGET // per_call))
        calls = (max(1, most // 4), most)
        short, long = (
            compile_fn(
                bench.mesh,
                latency_fn(transport.body(op, ws), k, opts.head_start),
                (pair,),
                transport.compiler_options,
            )
            for k in calls
        )
        timing = time_per_call_slope(short, long, (pair,), calls, opts.reps, bench.sync)
        per_run = calls[1]
    else:
        fn, per_run = bandwidth_fn(transport.body(op, ws), opts.iters), opts.iters
        compiled = compile_fn(bench.mesh, fn, (pair,), transport.compiler_options)
        timing = time_per_call(compiled, (pair,), per_run, opts.reps, bench.sync)
    row = {
        "op": op.name,
        "mode": mode,
        "transport": transport.name,
        "backend": bench.backend,
        "dtype": point.dtype,
        "n": n,
        "global_bytes_per_tensor": point.global_bytes,
        "tensors": TENSORS,
        "calls_per_run": per_run,
        **timing,
    }
    bench.say(
        f"  {op.name:<11} {mode:<9} {human(point.global_bytes):>9} {point.dtype:<8} "
        f"{transport.name:<12} {timing['median_s'] * 1e6:12.1f} us/call"
    )
    return row


def open_workspace(bench: Bench, transport: Transport, point: Point):
    """The workspace of a peer transport for this point, or None (noted) when it cannot be created."""
    try:
        ws = cpg.Workspace(
            bench.mesh,
            AXIS,
            nbytes=TENSORS * point.local_bytes,
            name=f"bench-{transport.protocol}",
            timeout_s=WORKSPACE_TIMEOUT_S,
            **workspace_options(transport.protocol),
        )
    except Exception as err:  # an unknown protocol, an older Workspace, out of memory, ...
        bench.skipped[transport.name] = (
            f"at {human(point.global_bytes)} {point.dtype}: {type(err).__name__}: {err}"
        )
        bench.note(
            f"{transport.name} skipped from here on: Workspace(protocol={transport.protocol!r}) "
            f"raised {type(err).__name__}: {err}",
            every_rank=True,
        )
        return None
    bench.peer_protocols[transport.name] = getattr(ws, "protocol", transport.protocol)
    return ws


def measure_ceiling(bench: Bench, ws, point: Point) -> list[dict]:
    """The ceiling of each op at this point, on the GPUs of `ws` (collective)."""
    opts = bench.opts
    try:
        per_op = ceiling_lib.ceilings(
            ws,
            [op.name for op in bench.ops],
            bench.n,
            point.local_bytes,
            TENSORS,
            max(opts.iters, 10),
            opts.reps,
        )
    except Exception as err:
        bench.ceiling_off = f"{type(err).__name__}: {err}"
        bench.note(f"no ceiling from here on: {bench.ceiling_off}", every_rank=True)
        return []
    out = []
    for op_name, c in per_op.items():
        rec = {
            "op": op_name,
            "dtype": point.dtype,
            "n": bench.n,
            "global_bytes_per_tensor": point.global_bytes,
            "tensors": TENSORS,
            **c,
            "busbw_gbps": busbw_gbps(bench.n, point.global_bytes, TENSORS, c["total_s"]),
            "push_busbw_gbps": busbw_gbps(bench.n, point.global_bytes, TENSORS, c["push_s"]),
        }
        bench.say(
            f"  {op_name:<11} {'ceiling':<9} {human(point.global_bytes):>9} {point.dtype:<8} "
            f"{'(' + c['push']['engine'] + ')':<12} {c['total_s'] * 1e6:12.1f} us/call "
            f"(push {c['push_s'] * 1e6:.1f})"
        )
        out.append(rec)
    return out


def run_transport(bench: Bench, transport: Transport, point: Point, modes, want_ceiling: bool):
    """Every op and mode of one transport at one point: (rows, ceiling records)."""
    ws = open_workspace(bench, transport, point) if transport.kind == "peer" else None
    if transport.kind == "peer" and ws is None:
        return [], []
    rows, ceilings, ok = [], [], False
    try:
        for op in bench.ops:
            for mode in modes:
                row = measure(bench, op, mode, transport, ws, point)
                if row is not None:
                    rows.append(row)
        ok = True
    except Exception as err:  # e.g. an XLA option this jaxlib lacks, out of memory
        bench.skipped[transport.name] = (
            f"at {human(point.global_bytes)} {point.dtype}: {type(err).__name__}: {err}"
        )
        bench.note(
            f"{transport.name} skipped from here on: {type(err).__name__}: {str(err)[:500]}", every_rank=True
        )
    if ws is not None:
        if want_ceiling and ok:  # after the transport's own calls: the slots are idle now
            ceilings = measure_ceiling(bench, ws, point)
        ws.close()
    return rows, ceilings


def run(bench: Bench):
    """Every point: (rows, ceiling records)."""
    rows, ceilings = [], []
    for size_text in bench.opts.sizes:
        for dtype in bench.opts.dtypes:
            point = make_point(parse_size(size_text), dtype, bench.n)
            modes = modes_for(bench, point)
            if not modes:
                continue
            ceiling_done = False
            for transport in bench.transports:
                if transport.name in bench.skipped:
                    continue
                want_ceiling = transport.kind == "peer" and not ceiling_done and bench.ceiling_off is None
                got, ceils = run_transport(bench, transport, point, modes, want_ceiling)
                rows += got
                ceilings += ceils
                ceiling_done = ceiling_done or bool(ceils)
    if not ceilings and bench.ceiling_off is None:
        bench.ceiling_off = "no peer workspace could be opened to push through"
    annotate(rows, {_point_key(c): c["total_s"] for c in ceilings})
    return rows, ceilings


# -- output -------------------------------------------------------------------------------------


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


HEADER = (
    f"{'size/tensor':>11} {'dtype':>8}  {'transport':<12} {'us/call':>10} {'spread us':>17} "
    f"{'busbw GB/s':>10} {'vs best nccl':>12} {'of ceiling':>10}"
)


def format_row(r: dict) -> str:
    spread = f"{r['min_s'] * 1e6:.1f}-{r['max_s'] * 1e6:.1f}"
    of_ceiling = None if r["of_ceiling"] is None else 100 * r["of_ceiling"]
    return (
        f"{human(r['global_bytes_per_tensor']):>11} {r['dtype']:>8}  {r['transport']:<12} "
        f"{r['median_s'] * 1e6:>10.1f} {spread:>17} {_fmt(r['busbw_gbps'], '.1f', ''):>10} "
        f"{_fmt(r['vs_best_nccl'], '.2f', 'x'):>12} {_fmt(of_ceiling, '.0f', '%'):>10}"
    )


def format_ceiling(c: dict) -> str:
    label = f"ceiling({c['push']['engine']})"
    return (
        f"{human(c['global_bytes_per_tensor']):>11} {c['dtype']:>8}  {label:<12} {c['total_s'] * 1e6:>10.1f} "
        f"{'push ' + format(c['push_s'] * 1e6, '.1f'):>17} {c['busbw_gbps']:>10.1f}"
    )


def print_legend(bench: Bench) -> None:
    print(f"\nTransports ({bench.backend}):")
    for t in bench.transports:
        skipped = f" -- SKIPPED {bench.skipped[t.name]}" if t.name in bench.skipped else ""
        print(f"  {t.name:<12} {t.description}{skipped}")
    how = "all GPUs pushing to every peer at once + the local traffic as a device copy"
    print(f"  {'ceiling':<12} {f'none: {bench.ceiling_off}' if bench.ceiling_off else how}")


def print_block(bench: Bench, op: str, mode: str, rows, ceilings) -> None:
    """One table: every transport (and the ceiling) of one op in one mode, by dtype and size."""
    opts = bench.opts
    block = [r for r in rows if (r["op"], r["mode"]) == (op, mode)]
    if not block:
        return
    how = (
        f"straight-line calls, slope of {max(1, opts.calls // 4)} and {opts.calls} per jit"
        if mode == "latency"
        else f"fori_loop of {opts.iters} calls"
    )
    print(f"\n== {op}, {mode} mode ({how}; R={bench.n}, {bench.backend}, median of {opts.reps}) ==")
    print(HEADER)
    for dtype in opts.dtypes:
        for size in sorted({r["global_bytes_per_tensor"] for r in block if r["dtype"] == dtype}):
            for r in block:
                if (r["dtype"], r["global_bytes_per_tensor"]) == (dtype, size):
                    print(format_row(r))
            for c in ceilings:
                if (c["op"], c["dtype"], c["global_bytes_per_tensor"]) == (op, dtype, size):
                    print(format_ceiling(c))


def print_tables(bench: Bench, rows, ceilings) -> None:
    print_legend(bench)
    for op in bench.ops:
        for mode in bench.opts.modes:
            print_block(bench, op.name, mode, rows, ceilings)
    sys.stdout.flush()


def metadata(bench: Bench) -> dict:
    opts, devices = bench.opts, jax.devices()
    return {
        "benchmark": "grad_return",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        "device_kind": devices[0].device_kind,
        "backend": bench.backend,
        "n": bench.n,
        "processes": jax.process_count(),
        "shared_gpu": bench.shared_gpu,
        "jax": jax.__version__,
        "ops": [op.name for op in bench.ops],
        "modes": opts.modes,
        "transports": {t.name: t.description for t in bench.transports},
        "peer_protocols": bench.peer_protocols,
        "skipped": bench.skipped,
        "ceiling": bench.ceiling_off or "measured",
        "calls": opts.calls,
        "head_start": opts.head_start,
        "iters": opts.iters,
        "reps": opts.reps,
        "env": {
            k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_FLAGS")
        },
        "notes": bench.notes,
        "command": sys.argv,
    }


def write_json(path: str, meta: dict, rows, ceilings) -> None:
    with open(path, "w") as f:
        json.dump({**meta, "rows": rows, "ceilings": ceilings}, f, indent=1)
    print(f"wrote {path}")


def write_png(path: str, meta: dict, rows, ceilings) -> bool:
    """One row of panels per op: busbw vs size (bandwidth mode) and us/call vs size (latency mode),
    per dtype; one line per transport, the ceiling dashed. False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipped the plot (pip install jax_cpgrad[bench])")
        return False
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows)) or ["-"]
    panels = [(mode, dtype) for mode in ("bandwidth", "latency") if mode in meta["modes"] for dtype in dtypes]
    fig, axes = plt.subplots(
        len(meta["ops"]),
        max(1, len(panels)),
        figsize=(5.5 * max(1, len(panels)), 4 * len(meta["ops"])),
        squeeze=False,
    )
    for ax_row, op in zip(axes, meta["ops"], strict=True):
        for ax, (mode, dtype) in zip(ax_row, panels, strict=False):
            _plot_panel(ax, meta, op, mode, dtype, rows, ceilings)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
    return True


def _plot_panel(ax, meta, op, mode, dtype, rows, ceilings) -> None:
    value = (lambda r: r["busbw_gbps"]) if mode == "bandwidth" else (lambda r: r["median_s"] * 1e6)
    pts = [r for r in rows if (r["op"], r["mode"], r["dtype"]) == (op, mode, dtype)]
    for transport in meta["transports"]:
        if transport == "local" and mode == "bandwidth":
            continue  # it moves nothing between GPUs: no bus bandwidth
        line = sorted((r["global_bytes_per_tensor"], value(r)) for r in pts if r["transport"] == transport)
        if line:
            ax.plot(*zip(*line, strict=True), marker="o", label=transport)
    sizes = {r["global_bytes_per_tensor"] for r in pts}
    ceil = sorted(
        (c["global_bytes_per_tensor"], c["busbw_gbps"] if mode == "bandwidth" else c["total_s"] * 1e6)
        for c in ceilings
        if (c["op"], c["dtype"]) == (op, dtype) and c["global_bytes_per_tensor"] in sizes
    )
    if ceil:
        ax.plot(*zip(*ceil, strict=True), linestyle="--", marker="x", color="gray", label="ceiling")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(lambda x, _: human(int(x)))
    if mode == "latency":
        ax.set_yscale("log")
    ax.set_xlabel("global bytes per tensor (dK and dV each)")
    ax.set_ylabel("bus bandwidth, GB/s" if mode == "bandwidth" else "us per call")
    shared = " (shared GPU)" if meta["shared_gpu"] else ""
    ax.set_title(f"{op} {mode}, R={meta['n']}, {dtype}, {meta['backend']}{shared}", fontsize=9)
    ax.grid(True, alpha=0.3)
    if pts:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.from_json:  # e.g. plot here what a GPU machine without matplotlib measured
        with open(opts.from_json) as f:
            data = json.load(f)
        write_png(opts.png, data, data["rows"], data["ceilings"])
        return 0
    if "JAX_CPGRAD_COORDINATOR" in os.environ:
        launch.initialize()
    elif opts.cpu:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 8)
    bench = setup(opts)
    bench.say(
        f"{__file__}: R={bench.n}, {jax.devices()[0].device_kind} ({bench.backend}), "
        f"{jax.process_count()} process(es), transports {[t.name for t in bench.transports]}, "
        f"modes {opts.modes}, calls {opts.calls}, iters {opts.iters}, reps {opts.reps}"
    )
    rows, ceilings = run(bench)
    if bench.rank0:
        print_tables(bench, rows, ceilings)
        meta = metadata(bench)
        write_json(opts.json, meta, rows, ceilings)
        if opts.png:
            write_png(opts.png, meta, rows, ceilings)
    sys.stdout.flush()
    if jax.process_count() > 1:
        launch.finish()  # rank 0 hosts the coordination service: it must not leave first
    return 0


if __name__ == "__main__":
    sys.exit(main())
