"""benchmarks/document_balance.py's counting against a dense brute force, and both CPU benchmark
scripts of windows and documents (document_balance.py, halo_bytes.py) run on tiny arguments."""

import json
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import document_balance as db  # noqa: E402
import halo_bytes  # noqa: E402


def _dense_pairs(lengths, num_chunks):
    """Visible (query, key) pairs per chunk pair from the S x S causal + document mask."""
    s = int(np.sum(lengths))
    doc = np.repeat(np.arange(len(lengths)), lengths)
    p = np.arange(s)
    seen = (p[None, :] <= p[:, None]) & (doc[:, None] == doc[None, :])
    c = s // num_chunks
    return seen.reshape(num_chunks, c, num_chunks, c).sum(axis=(1, 3))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_chunks", [2, 4, 8, 16])
def test_chunk_pair_counts_equal_the_dense_count(seed, num_chunks):
    rng = np.random.default_rng(seed)
    s = 96 if num_chunks != 16 else 128
    cuts = np.sort(rng.choice(np.arange(1, s), size=rng.integers(0, 12), replace=False))
    lengths = np.diff(np.concatenate([[0], cuts, [s]]))
    got = db.chunk_pair_counts(db.document_starts(lengths), num_chunks)
    np.testing.assert_array_equal(got, _dense_pairs(lengths, num_chunks))
    assert got.sum() == sum(n * (n + 1) // 2 for n in lengths)


def test_rank_work_and_the_layouts_exact_causal_balance():
    s, r = 64, 4
    pairs = db.chunk_pair_counts(db.document_starts([s]), 2 * r)
    work = db.rank_work(pairs, r)
    per_chunk = pairs.sum(axis=1)
    assert work.tolist() == [per_chunk[i] + per_chunk[2 * r - 1 - i] for i in range(r)]
    assert db.imbalance(work) == 1.0 and work.sum() == s * (s + 1) // 2


@pytest.mark.parametrize("mix", list(db.MIXES))
def test_document_lengths_fill_the_sequence_from_the_mix(mix):
    s = 1 << 17
    lengths = db.document_lengths(mix, s, np.random.default_rng(0))
    assert lengths.sum() == s and (lengths > 0).all()
    short, long_, _ = db.MIXES[mix]
    body = lengths[:-1]  # the last one is cut at S
    bounds = [b for b in (short, long_) if b is not None]
    for n in body:
        assert any(lo <= n <= hi for lo, hi in bounds), n


def test_document_balance_main_on_tiny_arguments(tmp_path, capsys):
    out = tmp_path / "db.json"
    args = ["--seqs", "4K", "--ranks", "2", "4", "--seeds", "2", "--mixes", "short", "causal"]
    assert db.main([*args, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "max/mean" in text and "short" in text and "causal" in text
    data = json.loads(out.read_text())
    assert data["benchmark"] == "document_balance" and len(data["rows"]) == 2 * 2 * 2
    assert {(r["mix"], r["ranks"]) for r in data["summary"]} == {
        (m, r) for m in ("short", "causal") for r in (2, 4)
    }
    for row in data["rows"]:
        assert len(row["rank_pairs"]) == row["ranks"] and row["max_over_mean"] >= 1.0
        assert len(row["balanced_rank_pairs"]) == row["ranks"]
        assert sum(row["balanced_rank_pairs"]) == sum(row["rank_pairs"])  # the same documents, reordered
        assert 1.0 <= row["balanced_max_over_mean"] <= row["max_over_mean"]
        if row["mix"] == "causal":
            assert row["max_over_mean"] == 1.0


def test_halo_bytes_main_on_tiny_arguments(tmp_path, capsys):
    out = tmp_path / "hb.json"
    args = ["--windows", "512", "4K", "--seqs", "128K", "--ranks", "2", "16", "--json", str(out)]
    assert halo_bytes.main(args) == 0
    text = capsys.readouterr().out
    assert "xla chunks, peer the ranks in reach" in text  # 4k does not fit a 4k chunk (S = 128k, R = 16)
    rows = {(r["window"], r["ranks"]): r for r in json.loads(out.read_text())["rows"]}
    assert len(rows) == 4 and not rows[(4096, 16)]["fits"]
    wide = rows[(4096, 16)]  # two whole chunks (each chunk's left neighbour), K and V
    assert wide["path"] == "chunks" and wide["xla"] == 2 * 2 * 4096 * 8 * 128 * 2
    # the peer gather: the whole local K/V of the two ranks within a reach of 1, of the 15 others
    assert wide["peer"] == 2 * wide["all_gather"] // 15
    row = rows[(512, 16)]
    assert row["xla"] == 2 * 2 * 512 * 8 * 128 * 2  # K and V, 512 rows to each neighbour
    assert row["peer"] == 2 * row["xla"]  # all four edge pieces to each of the two neighbours
    assert row["all_gather"] == 15 * 2 * (128 << 10) // 16 * 8 * 128 * 2
