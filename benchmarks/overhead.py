"""Fixed per-call cost of the peer transport for tiny messages, and its breakdown.
Makes the results' finding 8 (the fixed per-call cost).

One rank's call with R writers emulated on this GPU and every wait already satisfied, so what
is left is what the host pays to enqueue it and what the GPU spends per call. Stream-memop
protocol: the scatter launch, one cuStreamBatchMemOp with the 2(R-1)+2 stream memory
operations, the accumulation launch. Device protocol: one fused kernel (`fused_call`).

    python benchmarks/overhead.py [--n 1 2 4 8] [--bytes 4096] [--json overhead.json]
"""

from __future__ import annotations

import argparse
import datetime
import json

from jax_cpgrad.benchmarking import bench_ext

PARTS = ["call", "scatter_launch", "publish_and_wait", "accumulate_launch", "fused_call"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--bytes", type=int, default=4096, help="global bytes per tensor (dK and dV)")
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--json", default=None)
    opts = p.parse_args()
    if bench_ext is None:
        raise SystemExit("benchmarks/overhead.py needs the CUDA build of jax_cpgrad and a GPU")
    rows = []
    print(f"{'R':>2} {'API calls':>9} {'mem ops':>7} | " + " | ".join(f"{part:>22}" for part in PARTS))
    print(f"{'':>2} {'':>9} {'':>7} | " + " | ".join(f"{'host us':>10} {'GPU us':>11}" for _ in PARTS))
    for n in opts.n:
        r = bench_ext.call_overhead_bench(n, opts.bytes, opts.iters)
        rows.append(r)
        cells = []
        for part in PARTS:
            cells.append(
                f"{r[part]['host_us']:>10.2f} {r[part]['gpu_us']:>11.2f}"
                if part in r
                else f"{'-':>10} {'-':>11}"
            )
        print(
            f"{n:>2} {r['api_calls_per_call']:>9} {r['stream_mem_ops_per_call']:>7} | " + " | ".join(cells),
            flush=True,
        )
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(
                {
                    "benchmark": "overhead",
                    "date": datetime.datetime.now().isoformat(timespec="seconds"),
                    "bytes_per_tensor": opts.bytes,
                    "rows": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
