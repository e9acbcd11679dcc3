"""benchmarks/mosaic_attention.py end to end on the CPU (--smoke: the blockwise path for the
kernels, XLA for cuDNN, tiny shapes): every case and program is read, and the JSON, table and PNG
have the structure a GPU run's have."""

import json

from run_python import run_python


def test_smoke_run_writes_every_case(tmp_path):
    base = tmp_path / "mosaic"
    out = run_python(
        [
            "benchmarks/mosaic_attention.py",
            "--smoke",
            "--seq",
            "128",
            "--masked-seq",
            "128",
            "--out",
            str(base),
        ],
        timeout=600,
    )
    assert "| case | S | KV | H |" in out  # the table
    data = json.loads(base.with_suffix(".json").read_text())
    meta = data["meta"]
    assert meta["smoke"] and meta["reference"] == "xla" and meta["ours"].startswith("blockwise")
    assert meta["window_calls"]["reference"].startswith("jax.nn.dot_product_attention(is_causal=True")
    assert data["skipped"] == [] and data["points"] == 3
    rows = {(r["case"], r.get("mix")): r for r in data["rows"]}
    assert sorted(rows) == [("causal", None), ("documents", "long"), ("documents", "short"), ("window", None)]
    kinds = ["bwd", "fwd", "fwd+bwd"]
    for case in ("causal", "window"):
        row = rows[(case, None)]
        assert row["errors"] == {}, row["errors"]
        assert sorted(row["t_ms"]) == ["ours", "xla"]
        for side in ("ours", "xla"):
            assert sorted(row["t_ms"][side]) == kinds and all(t > 0 for t in row["t_ms"][side].values())
            assert all(len(row["readings_ms"][f"{side} {k}"]) == 2 for k in kinds)  # --rounds 2 (smoke)
        for k in kinds:
            assert abs(row["ratio"][k] - row["t_ms"]["ours"][k] / row["t_ms"]["xla"][k]) < 1e-9
        assert set(row["compile_s"]) == {f"{s} {k}" for s in ("ours", "xla") for k in kinds}
        assert all(c["total_s"] > 0 for c in row["compile_s"].values())
        assert row["max_abs_diff_out"] < 0.05  # both computed the same attention (bf16)
    assert rows[("window", None)]["window"] == 32 and rows[("causal", None)]["window"] is None
    assert rows[("window", None)]["visible_pairs"] < rows[("causal", None)]["visible_pairs"]
    for mix in ("short", "long"):
        row = rows[("documents", mix)]
        assert sorted(row["t_ms"]) == ["ours", "ours causal"]
        assert 0 < row["visible_share"] < 1
        for k in kinds:
            share = row["t_ms"]["ours"][k] / row["t_ms"]["ours causal"][k]
            assert abs(row["time_share"][k] - share) < 1e-9
            assert abs(row["time_over_visible"][k] - share / row["visible_share"]) < 1e-9
    assert rows[("documents", "short")]["visible_share"] < rows[("documents", "long")]["visible_share"]
    assert base.with_suffix(".png").stat().st_size > 1000


def test_budget_skips_the_points_that_do_not_fit(tmp_path):
    base = tmp_path / "budget"
    run_python(
        ["benchmarks/mosaic_attention.py", "--smoke", "--seq", "128", "256", "--cases", "causal"]
        + ["--budget-s", "0", "--out", str(base)]
    )
    data = json.loads(base.with_suffix(".json").read_text())
    # The first point always runs (nothing is known yet); the second would pass a budget of 0.
    assert [r["seq"] for r in data["rows"]] == [128]
    assert [(s["case"], s["seq"]) for s in data["skipped"]] == [("causal", 256)]
