"""Per-call latency of the device protocol on real GPUs without XLA, and its launch shapes.
Makes the results' finding 2 (the device protocol's kernel alone).

Every local GPU is a rank of one process (peer access). `--calls` fused calls run back to back on
each GPU, recorded into one CUDA graph per GPU (what XLA's command buffers do) and, for
comparison, launched one by one; beside them the same chain of an empty kernel with the same
argument block (what a launch alone costs). Each row is microseconds per call (median of --reps,
the slowest GPU). What benchmarks/grad_return.py's straight-line figure adds to this is XLA's.

    python benchmarks/chain_latency.py [--sizes 64K 1M] [--json chain.json]

Launch shapes: `default` (the Workspace's: LL words for small calls, tiles otherwise), `tiles`
(the Workspace's tile shape, never LL words), `B:P` (block budget B, P of them pushing; P >= B:
every block pushes, then finishes; small calls still go as LL words, in at most B blocks) and
`tile=T` (tiles of T bytes, one push and one finishing block per tile, never LL words). The
empty kernel runs with as many blocks as the call would.
"""

from __future__ import annotations

import argparse
import datetime
import json

import jax
from sizes import parse_size  # benchmarks/sizes.py, next to this script

from jax_cpgrad.benchmarking import bench_ext, multiprocessor_count


def shape_args(shape: str, payload_bytes: int, sms: int) -> dict:
    """chain_bench keyword arguments for one launch-shape name."""
    if shape == "default":
        return {"block_budget": sms, "push_blocks": sms // 2}
    if shape == "tiles":
        return {"block_budget": sms, "push_blocks": sms // 2, "wire": "tiles"}
    if shape.startswith("tile="):
        tile = parse_size(shape[5:])
        tiles = -(-payload_bytes // tile)
        return {"shape": [tile, 2 * tiles, tiles, tiles]}
    budget, push = (int(x) for x in shape.split(":"))
    return {"block_budget": budget, "push_blocks": push}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["64K", "1M"], help="global bytes per tensor")
    p.add_argument("--ops", nargs="+", default=["grad_return", "all_gather"])
    p.add_argument(
        "--shapes", nargs="+", default=["default", "tiles", "8:4", "132:132", "tile=64K", "tile=4K"]
    )
    p.add_argument("--ranks", type=int, nargs="+", default=None, help="GPU counts (default: 1 and all)")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--json", default=None)
    opts = p.parse_args()
    if bench_ext is None:
        raise SystemExit("benchmarks/chain_latency.py needs the CUDA build of jax_cpgrad and a GPU")
    gpus = [d for d in jax.local_devices() if d.platform == "gpu"]
    if not gpus:
        raise SystemExit("benchmarks/chain_latency.py needs a GPU")
    sms = min(multiprocessor_count(d.local_hardware_id) for d in gpus)
    counts = opts.ranks or sorted({1, len(gpus)})
    if max(counts) > len(gpus) or min(counts) < 1:
        raise SystemExit(f"--ranks {counts}: this process sees {len(gpus)} GPU(s)")
    rows = []
    print(
        f"{'R':>2} {'op':>11} {'size':>5} {'shape':>9} {'launch':>6} {'kernel':>6} "
        f"{'us/call':>8} {'min-max':>13}  tile,tiles,blocks,push,finish"
    )
    for n in counts:
        devices = [d.local_hardware_id for d in gpus[:n]]
        for op in opts.ops:
            for size in opts.sizes:
                global_bytes = parse_size(size)
                payload = 2 * global_bytes // n  # two tensors, one rank's share
                for shape in opts.shapes:
                    for graph in (True, False):
                        for kernel in ("fused", "empty"):
                            if kernel == "empty" and shape != "default":
                                continue
                            r = bench_ext.chain_bench(
                                devices,
                                op,
                                global_bytes,
                                opts.calls,
                                opts.reps,
                                kernel=kernel,
                                graph=graph,
                                **shape_args(shape, payload, sms),
                            )
                            row = {
                                "n": n,
                                "op": op,
                                "global_bytes_per_tensor": global_bytes,
                                "shape_name": shape,
                                "graph": graph,
                                "kernel": kernel,
                                **r,
                            }
                            rows.append(row)
                            print(
                                f"{n:>2} {op:>11} {size:>5} {shape:>9} {'graph' if graph else 'stream':>6} "
                                f"{kernel:>6} {r['us_per_call']:>8.2f} "
                                f"{r['min_us']:>6.2f}-{r['max_us']:<6.2f}  {r['shape']}",
                                flush=True,
                            )
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(
                {
                    "benchmark": "chain_latency",
                    "date": datetime.datetime.now().isoformat(timespec="seconds"),
                    "gpus": [d.device_kind for d in gpus],
                    "calls": opts.calls,
                    "rows": rows,
                },
                f,
                indent=1,
            )
        print("wrote", opts.json)


if __name__ == "__main__":
    main()
