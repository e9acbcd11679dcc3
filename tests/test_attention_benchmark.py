"""benchmarks/attention.py on the CPU (XLA kernels, tiny shapes): it reads the unsharded
attention and a rank of each CP size R, and writes the ratio table, its JSON and its plot."""

import json

from run_python import run_python


def test_cpu_smoke_run_writes_the_per_rank_ratios(tmp_path):
    js, png = tmp_path / "a.json", tmp_path / "a.png"
    args = ["--seq", "512", "--kv-heads", "2", "--heads", "4", "--head-dim", "16", "--n", "1", "2", "4"]
    out = run_python(
        [
            "benchmarks/attention.py",
            *args,
            "--min-chunk",
            "32",
            "--rounds",
            "2",
            "--reading-s",
            "0",
            "--warm-s",
            "0",
            "--idle-s",
            "0.01",
            "--kernels",
            "3",
        ]
        + ["--json", str(js), "--png", str(png)]
    )
    assert "x t_rank / t_unsharded" in out  # R x ... (N x ... before the rename)
    data = json.loads(js.read_text())
    assert data["meta"]["implementation"] == "xla"
    rows = {r["n"]: r for r in data["rows"]}
    assert sorted(rows) == [1, 2, 4]
    for n, row in rows.items():
        assert row["chunk"] == 512 // (2 * n) and row["t_rank_ms"] > 0 and row["t_unsharded_ms"] > 0
        assert abs(row["ratio"] - n * row["t_rank_ms"] / row["t_unsharded_ms"]) < 1e-9
    assert sorted(rows[4]["t_rank_by_rank_ms"]) == ["0", "2", "3"]  # the first, a middle and the last rank
    # every program read in each round; a rank's time is the median of its readings
    assert sorted(rows[4]["readings_ms"]) == ["rank 0", "rank 2", "rank 3", "stand-in", "unsharded"]
    assert all(len(xs) == 2 for xs in rows[4]["readings_ms"].values())
    assert abs(rows[4]["t_rank_by_rank_ms"]["2"] - sum(rows[4]["readings_ms"]["rank 2"]) / 2) < 1e-9
    assert all(row["kernels_rank0"] == [] for row in rows.values())  # no GPU kernels on the CPU
    assert png.stat().st_size > 1000
