"""Markdown tables from benchmarks/grad_return.py JSON: per op, dtype and timing mode, each size's
best NCCL time, every peer protocol's time, its ratio to that NCCL time (> 1: faster) and two
fractions: of the ceiling (push + local traffic at copy speed: above 100% where the transport
overlaps the two) and of the push alone (every GPU pushing to every peer at once). What the
README's result tables are made from.

    python benchmarks/summarize.py benchmarks/results/x2_collectives_1proc.json [--sizes 64K 1M 64M 1G]
"""

from __future__ import annotations

import argparse
import json

from sizes import human, parse_size  # benchmarks/sizes.py, next to this script

NCCL = ("nccl", "nccl-symm")


def tables(data: dict, sizes: list[int] | None = None) -> str:
    """One markdown table per (op, mode, dtype) present in `data`."""
    rows = data["rows"]
    peers = [t for t in data["transports"] if t.startswith("peer-")]
    push_s = {
        (c["op"], c["dtype"], c["global_bytes_per_tensor"]): c["push_s"] for c in data.get("ceilings", [])
    }
    out = []
    for op in data["ops"]:
        for mode in data["modes"]:
            for dtype in sorted({r["dtype"] for r in rows}):
                block = [r for r in rows if (r["op"], r["mode"], r["dtype"]) == (op, mode, dtype)]
                if not block:
                    continue
                header = ["size/tensor", "best NCCL us"] + [
                    f"{p} us (x NCCL; of ceiling, of push)" for p in peers
                ]
                lines = [
                    f"**{op}, {mode}, {dtype}, R={data['n']}, {data['processes']} process(es)**",
                    "",
                    "| " + " | ".join(header) + " |",
                    "|" + " --- |" * len(header),
                ]
                for size in sorted({r["global_bytes_per_tensor"] for r in block}):
                    if sizes and not any(abs(size - s) <= s // 64 for s in sizes):
                        continue
                    at = {r["transport"]: r for r in block if r["global_bytes_per_tensor"] == size}
                    nccl = [at[t] for t in NCCL if t in at]
                    if not nccl:
                        continue
                    best = min(nccl, key=lambda r: r["median_s"])
                    cells = [human(size), f"{best['median_s'] * 1e6:.1f} ({best['transport']})"]
                    for p in peers:
                        r = at.get(p)
                        if r is None:
                            cells.append("-")
                            continue
                        of = f"; {100 * r['of_ceiling']:.0f}%" if r.get("of_ceiling") else ""
                        push = push_s.get((op, dtype, size))
                        of += f", {100 * push / r['median_s']:.0f}%" if push else ""
                        cells.append(
                            f"{r['median_s'] * 1e6:.1f} ({best['median_s'] / r['median_s']:.2f}x{of})"
                        )
                    lines.append("| " + " | ".join(cells) + " |")
                out.append("\n".join(lines))
    return "\n\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="+")
    p.add_argument("--sizes", nargs="+", default=None, help="only these sizes (e.g. 64K 1M 64M 1G)")
    opts = p.parse_args(argv)
    sizes = [parse_size(s) for s in opts.sizes] if opts.sizes else None
    for path in opts.json:
        with open(path) as f:
            print(tables(json.load(f), sizes), end="\n\n")


if __name__ == "__main__":
    main()
