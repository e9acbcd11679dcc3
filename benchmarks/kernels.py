"""Kernel efficiency on one GPU: scatter, ordered accumulation and gather vs a plain device copy.
Makes the results' finding 8 (kernel efficiency on one GPU).

R writers are emulated by R regions on this one GPU, so this measures how close each kernel
gets to the HBM bandwidth a cudaMemcpy of the same bytes reaches, not NVLink.

    python benchmarks/kernels.py [--n 2 4 8] [--mib 1 4 16 64 256 1024] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform

from jax_cpgrad.benchmarking import bench_ext

STEPS = [
    ("scatter", "copy_scatter_size", "scatter_traffic"),
    ("accumulate", "copy_accumulate_size", "accumulate_traffic"),
    ("gather", "copy_gather_size", "gather_traffic"),
]


def measure(n: int, mib: int, dtype: str, tensors: int = 2, iters: int = 20, reps: int = 7) -> dict:
    raw = bench_ext.kernel_bench(n, tensors, mib << 20, dtype, iters, reps)
    row = {"n": n, "mib_per_tensor": mib, "dtype": dtype, "tensors": tensors}
    for step, copy, traffic in STEPS:
        ours, ceiling = raw[step], raw[copy]
        row[step] = {
            "median_ms": ours["median_ms"],
            "min_ms": ours["min_ms"],
            "max_ms": ours["max_ms"],
            "traffic_bytes": raw[traffic],
            "gbps": raw[traffic] / ours["median_ms"] / 1e6,
            "copy_gbps": raw[traffic] / ceiling["median_ms"] / 1e6,
        }
        row[step]["fraction_of_copy"] = row[step]["gbps"] / row[step]["copy_gbps"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--mib", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--json", default=None)
    opts = parser.parse_args()
    if bench_ext is None:
        raise SystemExit("benchmarks/kernels.py needs the CUDA build of jax_cpgrad and a GPU")
    rows = []
    print(
        f"{'R':>2} {'MiB/t':>6} {'dtype':>8} | {'scatter GB/s':>12} {'%copy':>6} | "
        f"{'accum GB/s':>10} {'%copy':>6} | {'gather GB/s':>11} {'%copy':>6}"
    )
    for n in opts.n:
        for mib in opts.mib:
            for dtype in opts.dtypes:
                r = measure(n, mib, dtype)
                rows.append(r)
                cells = [
                    f"{r[s]['gbps']:>{w}.0f} {100 * r[s]['fraction_of_copy']:>5.1f}%"
                    for s, w in (("scatter", 12), ("accumulate", 10), ("gather", 11))
                ]
                print(
                    f"{n:>2} {mib:>6} {dtype:>8} | " + " | ".join(cells),
                    flush=True,
                )
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(
                {
                    "benchmark": "kernels",
                    "date": datetime.datetime.now().isoformat(timespec="seconds"),
                    "host": platform.node(),
                    "rows": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
