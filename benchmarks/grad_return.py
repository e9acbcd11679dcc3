"""grad_return side by side: the peer transport vs the XLA transport (reorder + psum_scatter, i.e.
NCCL on GPUs) vs the ceiling of the same hardware, measured in one run.

    python benchmarks/grad_return.py                      # every GPU of this process, or CPU
    python -m jax_cpgrad.launch -n 4 benchmarks/grad_return.py   # one process per rank
    python benchmarks/grad_return.py --cpu --sizes 64K 1M  # CPU smoke run (XLA transport only)

Each point moves dK and dV together (two tensors of the given global size, [S, 8, 128] with the
sequence first) and reports, for rank 0: the median time per call over --reps timed loops of
--iters back-to-back calls (after a warm-up), the spread, the bus bandwidth ((N-1)/N of the
global bytes per call over the time, NCCL's convention for reduce-scatter), the ratio to the XLA
transport, and the fraction of the ceiling. The ceiling is the best plain copy of the bytes a
rank sends (to a peer GPU, or within the GPU when ranks share one) plus a plain device copy of
the accumulation's memory traffic, both measured here, now.

Writes a table to stdout, --json and --png (bandwidth vs size, one line per transport + ceiling).
Several processes sharing one GPU are time-sliced: the figures then say nothing about NVLink.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform as platform_mod
import sys
import time


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def human(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes} B"


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["64K", "256K", "1M", "4M", "16M", "64M", "256M", "1G"],
                   help="global bytes per tensor")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--iters", type=int, default=20, help="back-to-back calls per timed loop")
    p.add_argument("--reps", type=int, default=5, help="timed loops per point")
    p.add_argument("--n", type=int, default=None, help="CP size (default: every device)")
    p.add_argument("--cpu", action="store_true", help="8 CPU devices, XLA transport only")
    p.add_argument("--json", default="grad_return.json")
    p.add_argument("--png", default="grad_return.png")
    return p.parse_args(argv)


def main(argv=None) -> int:
    opts = _parse(argv)
    import jax

    if "JAX_CPGRAD_COORDINATOR" in os.environ:
        from jax_cpgrad import launch

        launch.initialize()
    elif opts.cpu:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 8)
    rows, meta = run(opts)
    if jax.process_index() == 0:
        write_outputs(opts, rows, meta)
    sys.stdout.flush()
    if jax.process_count() > 1:
        os._exit(0)
    return 0


def _timed_loop(mesh, body, xs, iters, reps):
    """Median/min/max seconds per call of `body(dk, dv)` run `iters` times back to back in one jit."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    def loop(dk, dv):
        def one(i, carry):
            dk, dv, acc = carry
            # A one-row update per call keeps XLA from hoisting the call out of the loop.
            bump = lambda x: jax.lax.dynamic_update_index_in_dim(x, x[0] + 1, 0, 0)
            dk, dv = bump(dk), bump(dv)
            out_k, out_v = body(dk[0], dv[0])
            return dk, dv, acc + (out_k.ravel()[0] + out_v.ravel()[0]).astype(jnp.float32)
        _, _, acc = jax.lax.fori_loop(0, iters, one, (dk, dv, jnp.zeros((), jnp.float32)))
        return acc[None]

    f = jax.jit(jax.shard_map(loop, mesh=mesh, in_specs=P("cp"), out_specs=P("cp"), check_vma=False))
    f(*xs).block_until_ready()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f(*xs).block_until_ready()
        times.append((time.perf_counter() - t0) / iters)
    return float(np.median(times)), float(np.min(times)), float(np.max(times))


def run(opts):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jax_cpgrad as cpg
    from jax_cpgrad._native import HAS_CUDA, ext

    devices = jax.devices()
    n = opts.n or len(devices)
    mesh = Mesh(np.array(devices[:n]), ("cp",))
    on_gpu = devices[0].platform == "gpu"
    from jax_cpgrad import launch

    shared_gpu = on_gpu and launch.ranks_share_gpu()
    transports = (["peer"] if on_gpu and HAS_CUDA else []) + ([] if shared_gpu else ["xla"])
    me = jax.process_index()
    say = (lambda *a: print(*a, flush=True)) if me == 0 else (lambda *a: None)
    if shared_gpu:
        say(f"WARNING: {n} processes share one GPU (time-sliced): these figures say nothing about NVLink, "
            "and the XLA transport (NCCL) cannot run in this mode.")
    say(f"grad_return benchmark: N={n}, {devices[0].device_kind}, transports {transports}, "
        f"iters {opts.iters} x reps {opts.reps}")
    header = (f"{'size/tensor':>11} {'dtype':>8} | {'transport':>9} {'us/call':>10} {'spread us':>15} "
              f"{'busbw GB/s':>10} | {'vs xla':>7} {'of ceiling':>10}")
    say(header)
    rows = []
    inner = 8 * 128
    for dtype in opts.dtypes:
        itemsize = np.dtype(jnp.dtype(dtype)).itemsize
        for size_text in opts.sizes:
            size = parse_size(size_text)
            seq = max(2 * n, size // (inner * itemsize) // (2 * n) * (2 * n))
            global_bytes = seq * inner * itemsize
            local_bytes = global_bytes // n
            shape = (n, seq, 8, 128)
            sharding = NamedSharding(mesh, P("cp"))
            make = lambda idx: np.ones(tuple(len(range(*s.indices(d))) for s, d in zip(idx, shape)), dtype=jnp.dtype(dtype))
            dk = jax.make_array_from_callback(shape, sharding, make)
            dv = jax.make_array_from_callback(shape, sharding, make)
            sent = 2 * (n - 1) * local_bytes  # bytes a rank pushes per call (dK and dV)
            ceiling = None
            if on_gpu and HAS_CUDA:
                src = jax.local_devices()[0].local_hardware_id
                # Ceiling link: to a peer GPU of this process, else within the GPU (shared GPU, or
                # one GPU per process where this process cannot time the other's link).
                others = [d for d in jax.local_devices() if d.local_hardware_id != src]
                peer = others[0].local_hardware_id if others and not shared_gpu else src
                copy = ext.copy_bench(src, peer, max(sent, 256), 10, 5)["median_ms"] / 1e3
                acc_traffic = 2 * (n + 1) * local_bytes
                acc = ext.copy_bench(src, src, max(acc_traffic // 2, 256), 10, 5)["median_ms"] / 1e3
                ceiling = copy + acc
            point = {"n": n, "dtype": dtype, "global_bytes_per_tensor": global_bytes, "tensors": 2,
                     "bytes_sent_per_rank": sent, "ceiling_s": ceiling}
            ws = cpg.Workspace(mesh, "cp", nbytes=2 * local_bytes, name="bench") if "peer" in transports else None
            for transport in transports:
                w = ws if transport == "peer" else None
                body = lambda k, v, w=w: cpg.grad_return((k, v), axis_name="cp", seq_axis=0, workspace=w)
                med, lo, hi = _timed_loop(mesh, body, (dk, dv), opts.iters, opts.reps)
                point[transport] = {"median_s": med, "min_s": lo, "max_s": hi,
                                    "busbw_gbps": (n - 1) / n * 2 * global_bytes / med / 1e9 if n > 1 else 0.0}
            if ws is not None:
                ws.close()
            for transport in transports:
                t = point[transport]
                vs_xla = point["xla"]["median_s"] / t["median_s"] if "xla" in point else None
                frac = ceiling / t["median_s"] if ceiling else None
                t["speedup_vs_xla"], t["fraction_of_ceiling"] = vs_xla, frac
                spread = f"{t['min_s'] * 1e6:.1f}-{t['max_s'] * 1e6:.1f}"
                say(f"{human(global_bytes):>11} {dtype:>8} | {transport:>9} {t['median_s'] * 1e6:>10.1f} {spread:>15} "
                    f"{t['busbw_gbps']:>10.1f} | {f'{vs_xla:.2f}x' if vs_xla else '-':>7} "
                    f"{f'{100 * frac:.0f}%' if frac else '-':>10}")
            if ceiling:
                say(f"{'':>11} {'':>8} | {'ceiling':>9} {ceiling * 1e6:>10.1f} {'':>15} "
                    f"{((n - 1) / n * 2 * global_bytes / ceiling / 1e9) if n > 1 else 0.0:>10.1f} |")
            rows.append(point)
    meta = {"benchmark": "grad_return", "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "host": platform_mod.node(), "device_kind": devices[0].device_kind, "n": n,
            "processes": jax.process_count(), "shared_gpu": shared_gpu, "jax": jax.__version__,
            "transports": transports, "iters": opts.iters, "reps": opts.reps}
    return rows, meta


def write_outputs(opts, rows, meta):
    with open(opts.json, "w") as f:
        json.dump({**meta, "rows": rows}, f, indent=1)
    print(f"wrote {opts.json}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install jax_cpgrad[bench])")
        return
    fig, axes = plt.subplots(1, len(opts.dtypes), figsize=(6 * len(opts.dtypes), 4), squeeze=False)
    for ax, dtype in zip(axes[0], opts.dtypes):
        pts = [r for r in rows if r["dtype"] == dtype]
        xs = [r["global_bytes_per_tensor"] for r in pts]
        for transport in meta["transports"]:
            ax.plot(xs, [r[transport]["busbw_gbps"] for r in pts], marker="o", label=transport)
        if pts and pts[0]["ceiling_s"]:
            n = meta["n"]
            ax.plot(xs, [(n - 1) / n * 2 * r["global_bytes_per_tensor"] / r["ceiling_s"] / 1e9 for r in pts],
                    linestyle="--", color="gray", label="ceiling")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("global bytes per tensor (dK and dV each)")
        ax.set_ylabel("bus bandwidth, GB/s")
        ax.set_title(f"grad_return, N={meta['n']}, {dtype}" + (" (shared GPU)" if meta["shared_gpu"] else ""))
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(opts.png, dpi=110)
    print(f"wrote {opts.png}")


if __name__ == "__main__":
    sys.exit(main())
