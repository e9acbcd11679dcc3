"""Bytes a CP rank moves for a sliding window: the halo exchange vs the all-gather of all K/V.

    python benchmarks/halo_bytes.py                  # the full table, instantly (arithmetic only)
    python benchmarks/halo_bytes.py --windows 512 --seqs 128K --ranks 2 4

From :func:`jax_cpgrad.attention.halo.halo_transfer_nbytes`: bytes one rank sends per direction
(the forward pass's K and V; the backward's dK and dV are the same again), B = 1, K = 8 key/value
heads of H = 128, bfloat16, a causal window of ``w`` keys back (left = w, right = 0; a two-sided
window (w, w) doubles the halo). Transports:

- ``xla``: ``ppermute`` of the halo rows to the two neighbours: ``2 x 2w x K x H x 2`` bytes,
  whatever S and R;
- ``peer``: the rank's edge rows to its two neighbours alone (an all-gather with a reach of 1):
  2x the XLA figure (each neighbour gets all four edge pieces, and needs two), whatever R;
- ``all-gather``: what the layer does without a halo, ``(R-1)/R x 2 x S x K x H x 2``.

Where the window is not shorter than the chunk S/(2R) there is no halo: the XLA transport moves
the whole chunks the window reaches (``jax_cpgrad.attention.window_chunks``; the busiest rank's
count), the peer transport gathers the K/V of the ranks within the window's reach,
``ceil(w / c)`` each side (``RankPlan.window_reach``; the busiest rank's count; ``path`` says
which).

The figure this makes: **the bytes as a fraction of the all-gather's**, per window (512, 1k,
4k), S (128k-1M) and R (2-16), for both transports. Prints the table and writes ``--json``
(default ``benchmarks/results/halo_bytes.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from jax_cpgrad.attention import plan, window_chunks
from jax_cpgrad.attention.halo import halo_transfer_nbytes

DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "halo_bytes.json")
SHAPE = dict(batch=1, kv_heads=8, head_dim=128, itemsize=2)  # bf16


def parse_tokens(text: str) -> int:
    """ "128K" -> 131072, "1M" -> 1048576, "512" -> 512."""
    units = {"K": 1 << 10, "M": 1 << 20}
    unit = text[-1].upper()
    return int(float(text[:-1]) * units[unit]) if unit in units else int(text)


def tokens(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10}k" if n >= 1024 else str(n)


def human(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{nbytes} B"


def table(windows, seqs, ranks):
    rows = []
    for w in windows:
        for s in seqs:
            for r in ranks:
                chunk = s // (2 * r)
                row = dict(window=w, left=w, right=0, seq=s, ranks=r, chunk=chunk, **SHAPE)
                if w >= chunk:
                    rows.append(dict(row, **_wider_than_a_chunk(w, s, r, chunk)))
                    continue
                xla, peer = (halo_transfer_nbytes(seq=s, num_ranks=r, left=w, right=0, transport=t, **SHAPE)
                             for t in ("xla", "peer"))  # fmt: skip
                rows.append(
                    dict(
                        row, fits=True, path="halo", xla=xla.halo, peer=peer.halo, all_gather=xla.all_gather,
                        xla_fraction=xla.halo / xla.all_gather, peer_fraction=peer.halo / peer.all_gather,
                    )
                )  # fmt: skip
    return rows


def _peers_in_reach(w: int, r: int, chunk: int) -> int:
    """The most other ranks any rank's peer gather takes K/V from for a causal window of w."""
    reach = plan.RankPlan(r, True, window=(w, 0)).window_reach(chunk)
    if reach == 0:
        return r - 1
    return max(min(rank + reach, r - 1) - max(rank - reach, 0) for rank in range(r))


def _wider_than_a_chunk(w: int, s: int, r: int, chunk: int) -> dict:
    """The XLA transport's whole chunks (or the all-gather where they are all needed), the peer
    transport's gather from the ranks within the window's reach."""
    row_nbytes = SHAPE["batch"] * SHAPE["kv_heads"] * SHAPE["head_dim"] * SHAPE["itemsize"]
    all_gather = (r - 1) * 2 * (s // r) * row_nbytes
    lay = window_chunks.layout(r, chunk, w, 0)
    xla = all_gather if lay is None else 2 * window_chunks.transfer_nbytes(lay, row_nbytes)  # K and V
    peer = _peers_in_reach(w, r, chunk) * 2 * (s // r) * row_nbytes
    return dict(
        fits=False, path="all-gather" if lay is None else "chunks", xla=xla, peer=peer,
        all_gather=all_gather, xla_fraction=xla / all_gather, peer_fraction=peer / all_gather,
    )  # fmt: skip


def print_table(rows, out=None):
    out = out or sys.stdout
    print("bytes per rank per direction (K+V; dK+dV the same again), B=1, K=8, H=128, bf16, causal", file=out)
    print(
        f"{'window':>6} {'S':>5} {'R':>3} {'chunk':>6}  {'xla':>10} {'peer':>10} "
        f"{'all-gather':>10}  {'xla/ag':>8} {'peer/ag':>8}",
        file=out,
    )
    for row in rows:
        head = f"{tokens(row['window']):>6} {tokens(row['seq']):>5} {row['ranks']:>3} "
        head += f"{tokens(row['chunk']):>6}  "
        note = "" if row["fits"] else f"  window >= chunk: xla {row['path']}, peer the ranks in reach"
        print(
            head + f"{human(row['xla']):>10} {human(row['peer']):>10} {human(row['all_gather']):>10}  "
            f"{row['xla_fraction']:>8.2%} {row['peer_fraction']:>8.2%}{note}",
            file=out,
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--windows", nargs="+", default=["512", "1K", "4K"], help="left window w (causal)")
    p.add_argument("--seqs", nargs="+", default=["128K", "256K", "512K", "1M"])
    p.add_argument("--ranks", nargs="+", type=int, default=[2, 4, 8, 16])
    p.add_argument("--json", default=DEFAULT_JSON, help="'' for none")
    opts = p.parse_args(argv)
    windows, seqs = [parse_tokens(w) for w in opts.windows], [parse_tokens(s) for s in opts.seqs]
    for s in seqs:
        for r in opts.ranks:
            if r < 1 or s % (2 * r):
                p.error(f"S = {s} must be a positive multiple of 2R = {2 * r}")
    rows = table(windows, seqs, opts.ranks)
    print_table(rows)
    if opts.json:
        os.makedirs(os.path.dirname(os.path.abspath(opts.json)), exist_ok=True)
        meta = dict(
            benchmark="halo_bytes", command=[os.path.basename(__file__), *(argv or sys.argv[1:])],
            units="bytes per rank per direction (K and V together)", mask="causal window (left=w, right=0)",
        )  # fmt: skip
        with open(opts.json, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)
        print(f"wrote {opts.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
