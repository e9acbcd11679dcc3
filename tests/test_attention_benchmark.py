"""benchmarks/attention.py on the CPU (XLA kernels, tiny shapes): it reads the unsharded
attention and a rank of each CP size R, and writes the ratio table, its JSON and its plot."""

import importlib.util
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_cpgrad import to_cp_layout
from jax_cpgrad.attention import emulation, layer
from run_python import run_python, script


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
    measured = rows[4]["t_rank_measured_by_rank_ms"]
    assert abs(measured["2"] - sum(rows[4]["readings_ms"]["rank 2"]) / 2) < 1e-9
    # a rank's time is its reading less the stand-in gather's (a copy a real rank does not make)
    stand_in = sum(rows[4]["readings_ms"]["stand-in"]) / 2
    assert rows[4]["t_stand_in_gather_ms"] > 0 and abs(rows[4]["t_stand_in_gather_ms"] - stand_in) < 1e-9
    for r, t in rows[4]["t_rank_by_rank_ms"].items():
        assert abs(t - (measured[r] - stand_in)) < 1e-9
    assert all(row["kernels_rank0"] == [] for row in rows.values())  # no GPU kernels on the CPU
    assert png.stat().st_size > 1000


def _benchmark():
    """benchmarks/attention.py as a module (its directory on the path, as the script has it)."""
    spec = importlib.util.spec_from_file_location("attention_benchmark", script("benchmarks/attention.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


bench = _benchmark()


def test_the_stand_in_gather_is_a_copy_of_its_own():
    """The emulated rank's gathered K/V go through a barrier, as a transfer's buffer would: XLA
    cannot fuse them into what reads them (a copy of the other ranks' chunks would then read the
    local arrays, cheaper than a real rank's, while a call reading them in place pays the whole
    copy), so every form of the layer pays the same stand-in, which the benchmark takes off."""
    k = jnp.ones((1, 8, 2, 4), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda k, v: emulation.NoTransfer(4).gather((k, v), lambda: None)[0])(k, k)
    (barrier,) = [e for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"]
    made = {str(v): e.primitive.name for e in jaxpr.eqns for v in e.outvars}
    assert [made.get(str(v)) for v in barrier.invars] == ["concatenate", "concatenate"]
    assert [v.aval.shape for v in barrier.outvars] == [(1, 32, 2, 4)] * 2


MASKS = [(None, None), (5, None), (None, 12), (7, 12), (40, 12), (0, None), (None, 64)]  # (window, documents)


def _dense_visible(seq, window, documents):
    """bool [seq, seq]: query p sees key j (causal, jax.nn's window (window, window), same id)."""
    p, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
    seen = j <= p
    if window is not None:
        seen &= p - j <= window
    if documents is not None:
        ids = np.asarray(bench.document_ids(seq, documents))[0]
        seen &= ids[:, None] == ids[None, :]
    return seen


@pytest.mark.parametrize("mix", ["short", "mixed"])
def test_a_mix_of_documents_counts_as_its_dense_mask(mix):
    """--documents short|mixed: document_balance's lengths (seed 0); the shares from the same ids."""
    seq = 16 * 1024
    ids = np.asarray(bench.document_ids(seq, mix))[0]
    assert ids.shape == (seq,) and len(np.unique(ids)) > 4 and (np.diff(ids) >= 0).all()
    sub = 2048  # the dense check on a prefix: the documents' starts are the same there
    same = ids[:sub, None] == ids[None, :sub]
    dense = same & _dense_visible(sub, 300, None)
    assert (bench.visible_per_query(seq, 300, mix)[:sub] == dense.sum(axis=1)).all()
    with pytest.raises(SystemExit):
        bench.main(["--documents", "medium", "--seq", "512"])


def test_balanced_order_reorders_whole_documents_and_evens_the_shares():
    """--balanced-order: the same documents, each contiguous, in balanced_document_order's order
    for N; the shares follow the reordered ids, and the short mix's busiest rank gets less."""
    seq, n = 16 * 1024, 4
    drawn = np.asarray(bench.document_ids(seq, "short"))[0]
    ids = np.asarray(bench.document_ids(seq, "short", balanced_for=n))[0]
    runs = lambda x: sorted(np.diff(np.flatnonzero(np.r_[True, x[1:] != x[:-1], True])))
    assert runs(ids) == runs(drawn) and not (ids == drawn).all()
    assert len(np.unique(ids)) == len(runs(ids))  # no document split in two
    p = np.arange(seq)
    starts = np.maximum.accumulate(np.where(np.r_[True, ids[1:] != ids[:-1]], p, 0))
    np.testing.assert_array_equal(bench.visible_per_query(seq, None, "short", balanced_for=n), p - starts + 1)
    natural = bench.visible_share(seq, n, None, "short")
    balanced = bench.visible_share(seq, n, None, "short", balanced=True)
    assert abs(balanced.sum() - 1) < 1e-12 and balanced.max() < natural.max()


@pytest.mark.parametrize("window, documents", MASKS)
def test_visible_share_is_the_dense_count_of_each_ranks_queries(window, documents):
    seq = 64
    dense = _dense_visible(seq, window, documents)
    assert (bench.visible_per_query(seq, window, documents) == dense.sum(axis=1)).all()
    for n in (1, 2, 4):
        rows = np.asarray(to_cp_layout(np.arange(seq), n, seq_axis=0)).reshape(
            n, -1
        )  # rank r's query positions
        expected = np.array([dense[rows[r]].sum() for r in range(n)]) / dense.sum()
        share = bench.visible_share(seq, n, window, documents)
        assert share.shape == (n,)
        np.testing.assert_allclose(share, expected, rtol=0, atol=1e-12)
        assert abs(share.sum() - 1) < 1e-12


def test_visible_share_is_even_for_plain_causal_and_uneven_with_a_window():
    np.testing.assert_allclose(bench.visible_share(128 * 1024, 8, None, None), np.full(8, 1 / 8), atol=1e-15)
    share = bench.visible_share(64, 4, 5, None)  # rank 0's chunk 0 starts the sequence: fewer keys
    assert share[0] < share[1] and abs(share[1] - share[3]) < 1e-12


def _plan_visible_pairs(seq, n, rank, window, documents, transfer):
    """The visible (query, key) pairs of rank ``rank``'s kernel calls (local and remote) as the
    layer plans them with ``transfer``'s gathered ids."""
    q = jnp.zeros((1, seq // n, 1, 16), jnp.float32)
    local = seq // n
    ids = to_cp_layout(bench.document_ids(seq, documents), n)[:, rank * local : (rank + 1) * local]
    options, words = layer.prepare(
        q, q, q, scale=None, is_causal=True, segment_ids=ids, local_window_size=window,
        implementation="xla", head_groups=1,
    )  # fmt: skip
    cfg = layer.schedule_config(options, n, transfer, transfer_when_alone=False)
    if words is not None and cfg.plan.gathers_ids:
        words = transfer.gather_ids(words)
    calls = cfg.plan.calls(q, jnp.int32(rank), words)
    return sum(int((c.vis.row_hi - c.vis.row_lo).sum()) for c in calls.local + calls.remote)


@pytest.mark.parametrize("window, documents", [(None, 12), (7, 12), (40, 12), (None, 64)])
def test_the_ranks_calls_see_what_its_share_counts(window, documents):
    """With the whole sequence's ids gathered (rank_without_transfer's stand-in given
    sequence_segment_ids), each rank's calls see exactly the pairs its share counts: the timed
    work is the rank's real masked work; the stand-in repeating the rank's own ids does not."""
    seq = 64
    total = _dense_visible(seq, window, documents).sum()
    wrong = 0
    for n in (2, 4):
        for rank in range(n):
            ids = np.asarray(bench.document_ids(seq, documents))
            transfer = emulation.NoTransfer.with_sequence_ids(n, ids)
            pairs = _plan_visible_pairs(seq, n, rank, window, documents, transfer)
            share = bench.visible_share(seq, n, window, documents)[rank]
            assert pairs == round(share * total), (n, rank)
            repeated = _plan_visible_pairs(seq, n, rank, window, documents, emulation.NoTransfer(n))
            wrong += repeated != pairs
    # One document (documents = seq): copies of the rank's own ids are right too.
    assert wrong or documents >= seq, "copies of the rank's own ids planned the same work: the check is blind"


@pytest.mark.parametrize("balanced", [False, True], ids=["drawn", "balanced_order"])
def test_cpu_smoke_run_against_the_layer_at_one_rank(tmp_path, balanced):
    js = tmp_path / "a.json"
    args = ["--seq", "512", "--kv-heads", "2", "--heads", "4", "--head-dim", "16", "--n", "1", "2", "4"]
    timing = ["--min-chunk", "32", "--rounds", "1", "--reading-s", "0", "--warm-s", "0"]
    masks = ["--window", "40", "--documents", "96", "--ideal", "layer", "--rank-implementation", "xla"]
    masks += ["--balanced-order"] if balanced else []
    out = run_python(["benchmarks/attention.py", *args, *timing, *masks, "--json", str(js)])
    assert "t_rank / (t_ideal x share)" in out and "(to share " in out
    data = json.loads(js.read_text())
    assert data["meta"]["ideal"] == "layer" and data["meta"]["rank_implementation"] == "xla"
    assert data["meta"]["balanced_order"] is balanced
    rows = {r["n"]: r for r in data["rows"]}
    assert sorted(rows) == [1, 2, 4]
    for n, row in rows.items():
        shares = bench.visible_share(512, n, 40, 96, balanced=balanced)
        assert sorted(row["share_by_rank"]) == sorted(row["t_rank_by_rank_ms"])
        by_rank = {}
        for r, t in row["t_rank_by_rank_ms"].items():
            assert abs(row["share_by_rank"][r] - shares[int(r)]) < 1e-12
            by_rank[r] = t / (row["t_unsharded_ms"] * shares[int(r)])
        assert abs(row["ratio_to_share"] - max(by_rank.values())) < 1e-9
        largest = max(row["share_by_rank"].values())
        slowest = row["t_rank_ms"] / (row["t_unsharded_ms"] * largest)
        assert abs(row["ratio_slowest_to_largest_share"] - slowest) < 1e-9
        assert row["target_to_share"] == 1.10 and row["target"] is None
        assert row["meets_target_to_share"] == (row["ratio_to_share"] <= 1.10)
        # a window under a chunk moves the halo's rows, not a gather of all K/V: no such stand-in
        assert row["t_stand_in_gather_ms"] == 0 and "stand-in" not in row["readings_ms"]
    assert abs(sum(bench.visible_share(512, 4, 40, 96)) - 1) < 1e-12
    assert sorted(rows[4]["share_by_rank"]) == ["0", "2", "3"]


def test_cpu_smoke_run_with_the_documents_bound(tmp_path):
    """--bounded: the layer told the longest document (24 tokens, under the 64-128-token chunks),
    so a rank moves the halo of the window it implies and gathers nothing: no stand-in gather."""
    js = tmp_path / "a.json"
    args = ["--seq", "512", "--kv-heads", "2", "--heads", "4", "--head-dim", "16", "--n", "2", "4"]
    timing = ["--min-chunk", "32", "--rounds", "1", "--reading-s", "0", "--warm-s", "0"]
    masks = ["--documents", "24", "--bounded", "--ideal", "layer", "--rank-implementation", "xla"]
    run_python(["benchmarks/attention.py", *args, *timing, *masks, "--json", str(js)])
    data = json.loads(js.read_text())
    assert data["meta"]["bounded"] is True and data["meta"]["documents"] == 24
    for row in data["rows"]:
        assert row["t_stand_in_gather_ms"] == 0 and "stand-in" not in row["readings_ms"]
        assert row["t_rank_by_rank_ms"] == row["t_rank_measured_by_rank_ms"]
