"""Documents (segment_ids) and sliding windows (local_window_size) in the CP attention layer, on CPU
devices, against unsharded dense-mask jax.nn.dot_product_attention on the natural-order arrays:
values and q/k/v gradients for R = 1, 2, 4, 8 ranks, causal and full, MHA, GQA and MQA, float32
within 2e-5 and bfloat16 within twice the kernel's own error; windows shorter than, as long as
and longer than a chunk, of 0, symmetric and not; documents of every shape; both together; under
jit, grad, jax.checkpoint and vmap, and with the head-group pipeline; the bad inputs refused
before anything runs. Chunks are 8 tokens (S = 16 R) unless said otherwise."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_check as ac
import jax_cpgrad as cpg
from jax_cpgrad.attention import emulation, halo, kernels, masks, plan
from spmd import cp_mesh
from workspace_stub import peer_calls_on_xla, workspace_spec

F32_TOLERANCE = 2e-5
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}
CHUNK = 8


def _check(ranks, *, causal=True, heads="gqa", window=None, documents=None, dtype=jnp.float32, batch=1,
           chunk=CHUNK, ids_dtype=np.int32, reference_causal=None, **kw):  # fmt: skip
    """The layer against the reference; returns the errors. ``reference_causal`` (default
    ``causal``) and documents=None on the reference side make the "must equal plain" checks."""
    h, hk = HEADS[heads]
    seq = 2 * ranks * chunk
    inputs = ac.random_inputs(seq, batch=batch, heads=h, kv_heads=hk, dtype=dtype, seed=ranks + 3 * batch)
    ids = (
        None
        if documents is None
        else ac.documents(documents, seq, batch, chunk=chunk, seed=ranks).astype(ids_dtype)
    )
    mask = dict(causal=causal, segment_ids=ids, local_window_size=window)
    ref_mask = mask if reference_causal is None else dict(causal=reference_causal)
    ref = ac.reference(*inputs, scale=kw.get("scale"), **ref_mask)
    got = ac.relative_errors(ac.cp_layer(cp_mesh(ranks), inputs, dtype=dtype, **mask, **kw), ref)
    if dtype == jnp.float32:
        tolerance = F32_TOLERANCE
    else:  # the kernel's own error: the layer at R = 1 is one call of it on the whole sequence
        own = ac.relative_errors(ac.cp_layer(cp_mesh(1), inputs, dtype=dtype, **mask), ref)
        tolerance = 2 * max(own.values())
    assert max(got.values()) <= tolerance, (got, tolerance)
    return got


# -- windows -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ranks,causal,heads,window",
    [
        (1, True, "mha", 5),  # R = 1: one call
        (2, True, "gqa", CHUNK),  # left = chunk
        (4, True, "mqa", 20),  # left > chunk
        (8, True, "gqa", 3),  # left < chunk
        (4, True, "gqa", 0),  # only itself: no remote part
        (2, True, "mha", (5, 100)),  # causal: the right side is 0 in effect
        (2, False, "mha", 6),  # symmetric
        (4, False, "gqa", (3, 11)),  # asymmetric: left < chunk < right
        (8, False, "mqa", (17, 0)),
        (4, False, "gqa", (0, 5)),  # only later keys: the remote part is needed
        (1, False, "gqa", (2, 40)),
        (4, False, "mha", 0),  # only itself, full
    ],
    ids=str,
)
def test_windows_match_unsharded_attention(ranks, causal, heads, window):
    _check(ranks, causal=causal, heads=heads, window=window)


# -- windows within a chunk: only the halo travels ----------------------------------------------


@pytest.mark.parametrize(
    "ranks,causal,heads,window,documents",
    [
        (2, True, "gqa", 7, None),  # left = c - 1
        (4, False, "mha", (2, 5), None),  # asymmetric
        (8, True, "mqa", (7, 0), None),
        (8, False, "gqa", (6, 1), None),
        (4, True, "gqa", 5, "crossing"),  # documents and a halo window
        (2, False, "mha", (7, 7), "one_token"),  # tail and head overlap: left + right > c
        (8, False, "gqa", (1, 7), "short"),
    ],
    ids=str,
)
def test_halo_windows_match_unsharded_attention(ranks, causal, heads, window, documents):
    batch = 1 if documents is None else 2
    _check(ranks, causal=causal, heads=heads, window=window, documents=documents, batch=batch)


def test_causal_halo_window_with_a_batch_sharing_one_mask():
    """The folded halo call (each chunk's edge against its slot) with B = 2 and no documents:
    one mask for the batch, tiled to the folded call's 2B entries."""
    _check(4, causal=True, heads="gqa", window=5, batch=2)


def test_halo_windows_with_the_head_groups_pipeline():
    _check(4, causal=False, heads="mha", window=(3, 5), documents="crossing", head_groups=2)


@pytest.mark.parametrize(
    "ranks,causal,window,documents", [(4, True, 5, None), (8, False, (6, 7), "crossing")]
)
def test_halo_windows_on_the_peer_transport_need_only_the_neighbours(
    monkeypatch, ranks, causal, window, documents
):
    """The peer transport's halo gathers with a reach of 1 (the others' rows zeros, emulated on
    XLA's collectives): the layer still equals the dense reference, values and gradients."""
    peer_calls_on_xla(monkeypatch)
    _check(ranks, causal=causal, window=window, documents=documents, batch=2, workspace=workspace_spec(ranks))


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("causal,window", [(True, (5, 0)), (False, (3, 6)), (False, (7, 7))], ids=str)
def test_halo_visibility_is_exact(ranks, causal, window):
    """The halo call's mask, mapped to global key positions, is exactly the window's (and the
    documents') over every key of the other ranks; no query sees a padding row."""
    c, seq = CHUNK, 2 * ranks * CHUNK
    ids = ac.documents("short", seq, 2, chunk=c, seed=ranks)
    words = plan.id_words(jnp.asarray(ids))
    rank_plan = plan.RankPlan(num_ranks=ranks, causal=causal, window=window, documents=True)
    assert rank_plan.halo_window(c) == (window[0], 0 if causal else window[1])
    runs = ac.document_mask(ids)  # [B, S, S]: same run
    mask = masks.Mask(causal=causal, window=window)
    for r in range(ranks):
        (call,) = rank_plan.calls(jnp.zeros((2, 2 * c, 1, 1)), r, words).remote
        edges = plan.edge_rows(c, *rank_plan.halo_window(c))
        # a causal window's call folds each chunk's edge and its halo slot into the batch
        rows_kind, keys_kind = ("chunk_heads", "moved_fold") if causal else ("edges", "moved")
        assert call.keys == ("moved" if edges == ((0, 2 * c),) else keys_kind)
        assert (call.rows, call.edges) == (("all", ()) if edges == ((0, 2 * c),) else (rows_kind, edges))
        pos, valid = halo.halo_positions(r, ranks, c, *rank_plan.halo_window(c))
        by_row = np.asarray(call.vis.dense())
        lo, hi = np.asarray(call.vis.col_lo), np.asarray(call.vis.col_hi)
        by_column = np.asarray(masks.interval_mask(jnp.asarray(lo), jnp.asarray(hi), by_row.shape[1]))
        if call.rows == "chunk_heads":  # [2B, e, left] -> the two blocks on the diagonal
            assert by_row.shape[0] == 2 * ids.shape[0]
            by_row, by_column = _unfolded(by_row), _unfolded(by_column)
        compact = by_row  # [B, E, L]: the edge rows alone
        np.testing.assert_array_equal(compact, np.swapaxes(by_column, 1, 2))
        rows = np.concatenate([np.arange(a, b) for a, b in edges])
        dense = np.zeros((compact.shape[0], 2 * c, compact.shape[2]), bool)  # [B, 2c, L]
        dense[:, rows] = compact  # the other rows see no halo key: compared with the window's below
        assert not dense[:, :, ~valid].any()
        q_pos = np.concatenate(
            [np.arange(r * c, (r + 1) * c), np.arange((2 * ranks - 1 - r) * c, (2 * ranks - r) * c)]
        )
        others = np.setdiff1d(np.arange(seq), q_pos)
        want = np.asarray(masks.visible(mask, q_pos, others))[0] & runs[:, q_pos][:, :, others]
        got = np.zeros_like(want)
        column = {p: i for i, p in enumerate(others)}
        for j in np.flatnonzero(valid):
            got[:, :, column[pos[j]]] = dense[:, :, j]
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize(
    "kind, window",
    [("short", None), ("crossing", None), ("one", None), ("one_token", None), ("repeated", None),
     (None, (CHUNK, 0)), (None, (2 * CHUNK + 3, 0)), ("crossing", (CHUNK + 5, 0))],
    ids=str,
)  # fmt: skip
def test_causal_masks_split_at_the_chunks_exactly(ranks, kind, window):
    """Causal documents, or a causal window of a chunk or more (which gathers K/V): the local call
    (own keys) and the remote one (the gathered keys, in place) together see exactly the mask
    over the whole sequence, and no pair twice: the local call its own chunk's keys alone, the
    remote one every key before the query's chunk; each call's row and column intervals describe
    the same pairs."""
    c, seq = CHUNK, 2 * ranks * CHUNK
    ids = None if kind is None else ac.documents(kind, seq, 2, chunk=c, seed=ranks)
    words = None if ids is None else plan.id_words(jnp.asarray(ids))
    rank_plan = plan.RankPlan(num_ranks=ranks, causal=True, window=window, documents=ids is not None)
    assert rank_plan.split_at_chunks and rank_plan.halo_window(c) is None
    mask = masks.Mask(causal=True, window=window)
    want_all = np.asarray(masks.visible(mask, np.arange(seq), np.arange(seq)))[0]
    if ids is not None:
        want_all = want_all & ac.document_mask(ids)  # [B, S, S]
    for r in range(ranks):
        calls = rank_plan.calls(jnp.zeros((2, 2 * c, 1, 1)), r, words)
        (local,), (remote,) = calls.local, calls.remote
        assert (local.keys, remote.keys, remote.rows) == ("own", "gathered", "all")
        for call in (local, remote):
            by_row = np.asarray(call.vis.dense())
            lo, hi = (jnp.asarray(x) for x in (call.vis.col_lo, call.vis.col_hi))
            by_column = np.asarray(masks.interval_mask(lo, hi, by_row.shape[1]))
            np.testing.assert_array_equal(by_row, np.swapaxes(by_column, 1, 2))
        q_pos = np.concatenate(
            [np.arange(r * c, (r + 1) * c), np.arange((2 * ranks - 1 - r) * c, (2 * ranks - r) * c)]
        )
        seen_locally = np.zeros((2, 2 * c, seq), bool)
        seen_locally[:, :, q_pos] = np.asarray(local.vis.dense())
        seen_remotely = np.broadcast_to(np.asarray(remote.vis.dense()), seen_locally.shape)
        assert not (seen_locally & seen_remotely).any()
        want = np.broadcast_to(want_all, (2, seq, seq))[:, q_pos]
        np.testing.assert_array_equal(seen_locally | seen_remotely, want)
        chunk_of = lambda p: p // c
        same_chunk = chunk_of(q_pos)[:, None] == chunk_of(np.arange(seq))[None, :]
        assert not (seen_remotely & same_chunk).any() and not (seen_locally & ~same_chunk).any()


def _unfolded(blocks):
    """[2B, m, n] (b-major pairs of blocks) -> [B, 2m, 2n] with each pair on the diagonal."""
    two_b, m, n = blocks.shape
    out = np.zeros((two_b // 2, 2 * m, 2 * n), bool)
    out[:, :m, :n], out[:, m:, n:] = blocks[0::2], blocks[1::2]
    return out


@pytest.mark.parametrize("left,right", [(5, 0), (0, 3), (2, 3), (3, 5), (7, 7), (1, 1)], ids=str)
def test_edge_rows_are_the_rows_a_window_lets_out_of_their_chunk(left, right):
    """Brute force over the 2c rows: a row is in an edge segment exactly when its window
    reaches a key outside its own chunk; segments sorted, disjoint and not touching."""
    c = CHUNK
    edges = plan.edge_rows(c, left, right)
    marked = np.zeros(2 * c, bool)
    for a, b in edges:
        marked[a:b] = True
    i = np.arange(2 * c) % c  # a row's index in its chunk
    np.testing.assert_array_equal(marked, (i - left < 0) | (i + right >= c))
    assert all(b0 < a1 for (_, b0), (a1, _) in zip(edges[:-1], edges[1:], strict=True))


@pytest.mark.parametrize(
    "segments,axis",
    [(((0, 5), (8, 13)), 1), (((3, 8), (11, 16)), -1), (((0, 2), (6, 10), (14, 16)), 1), (((0, 16),), 1)],
    ids=["heads", "tails_lse_axis", "uneven", "all"],
)
def test_update_segments_replaces_those_rows_alone(segments, axis):
    """``plan.update_segments`` against numpy: the segments' rows (and the given rows of another
    array) reach ``fn`` in one form, and what it returns lands on those rows alone; the rest is
    the array's own. Where the segments are a span at the same offset in each chunk (the first
    two cases) the rows arrive as the chunks' view ``[.., 2, span, ..]`` and each array is
    written by one dynamic update; otherwise they arrive joined."""
    rng = np.random.default_rng(0)
    full = np.float32(rng.normal(size=(2, 16, 3) if axis == 1 else (2, 3, 16)))
    ax = axis % full.ndim
    rows = np.concatenate([np.take(full, np.arange(a, b), axis=ax) for a, b in segments], axis=ax)
    other = np.float32(rng.normal(size=rows.shape))
    span = plan._same_in_each_chunk(segments, 16)
    seen = {}

    def fn(r, o):
        seen["shape"] = r.shape
        return (r * 2.0 + o,)

    others = [(jnp.asarray(other), axis)]
    (out,) = plan.update_segments((jnp.asarray(full),), fn, segments, (axis,), others=others)
    expected = full.copy()
    at = 0
    for a, b in segments:
        index = [slice(None)] * full.ndim
        index[ax] = slice(a, b)
        piece = [slice(None)] * full.ndim
        piece[ax] = slice(at, at + b - a)
        expected[tuple(index)] = 2.0 * rows[tuple(piece)] + other[tuple(piece)]
        at += b - a
    np.testing.assert_allclose(np.asarray(out), expected, rtol=0, atol=1e-6)
    if span is not None:
        assert seen["shape"] == full.shape[:ax] + (2, span[1] - span[0]) + full.shape[ax + 1 :]
        plus_one = lambda x: plan.update_segments((x,), lambda r: (r + 1,), segments, (axis,))
        jaxpr = str(jax.make_jaxpr(plus_one)(full))
        assert jaxpr.count("dynamic_update_slice") == 1
    else:
        assert seen["shape"] == rows.shape
    assert (span is not None) == (len(segments) == 2 and segments != ((0, 2), (6, 10)))
    taken = plan.take_segments(jnp.asarray(full, jnp.float32), segments, axis)
    np.testing.assert_array_equal(np.asarray(taken), rows.astype(np.float32))


def _lowered_without_ids(ranks: int, **kw) -> str:
    """The lowered text of the layer's forward and backward on the XLA transport, no documents,
    chunks of 8 (S = 16 R)."""
    spec = jax.sharding.PartitionSpec(None, "cp")

    def body(q, k, v):
        attend = lambda q, k, v: cpg.dot_product_attention(q, k, v, axis_name="cp", **kw)
        out, vjp = jax.vjp(attend, q, k, v)
        return vjp(out)

    step = jax.jit(jax.shard_map(body, mesh=cp_mesh(ranks), in_specs=spec, out_specs=spec))
    q = jax.ShapeDtypeStruct((1, 16 * ranks, 4, 16), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, 16 * ranks, 2, 16), jnp.float32)
    return step.trace(q, kv, kv).lower().as_text()


@pytest.mark.parametrize("causal,window", [(True, 3), (False, (2, 7))], ids=str)
def test_a_window_within_a_chunk_moves_only_the_halo(causal, window):
    """collective-permutes of the halo rows (K and V to each neighbour, dK and dV back), no
    all-gather and no reduce-scatter; a window that reaches every chunk gathers K/V (the
    control; tests/test_window_chunks.py has the windows between)."""
    left, right = (window, window) if isinstance(window, int) else window
    right = 0 if causal else right
    text = _lowered_without_ids(4, local_window_size=window, is_causal=causal)
    permutes = re.findall(r"stablehlo.collective_permute.*?-> tensor<([\dx]+)xf32>", text)
    assert permutes and all(p == f"1x{left + right}x2x16" for p in permutes), permutes
    assert len(permutes) == 8  # K, V x two neighbours x (forward, backward)
    assert "all_gather" not in text and "reduce_scatter" not in text
    wide = _lowered_without_ids(4, local_window_size=4 * CHUNK, is_causal=False)
    assert "all_gather" in wide and "reduce_scatter" in wide and "collective_permute" not in wide


def test_rank_without_transfer_with_a_halo_window():
    """The emulated rank takes the halo path with the real shapes: values and gradients run."""
    q, k, v, _ = (jnp.asarray(x) for x in ac.random_inputs(16, heads=4, kv_heads=2, seed=5))
    ids = jnp.asarray(ac.documents("short", 16, 1, chunk=4, seed=0))
    fn = lambda q, k, v: emulation.rank_without_transfer(
        q, k, v, 1, 4, is_causal=False, local_window_size=(2, 3), segment_ids=ids, head_groups=2
    )
    out, vjp = jax.vjp(jax.jit(fn), q, k, v)
    grads = vjp(out)
    assert out.shape == q.shape and [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert all(np.isfinite(np.asarray(x)).all() for x in (out, *grads))


def test_rank_without_transfer_takes_the_whole_sequences_ids():
    """sequence_segment_ids: the rank's own ids sliced at a traced rank, the same result as
    passing them as segment_ids when the sequence is one document (where copies of the rank's
    own ids are the real gathered ids); bad ones refused before tracing."""
    q, k, v, _ = (jnp.asarray(x) for x in ac.random_inputs(16, heads=4, kv_heads=2, seed=6))
    n, seq = 4, 64
    one_doc = np.zeros((1, seq), np.int32)
    given = jax.jit(
        lambda q, k, v, r: emulation.rank_without_transfer(q, k, v, r, n, sequence_segment_ids=one_doc)
    )
    own_ids = jax.jit(lambda q, k, v, r, ids: emulation.rank_without_transfer(q, k, v, r, n, segment_ids=ids))
    laid = np.asarray(cpg.to_cp_layout(one_doc, n))
    for rank in (0, 3):
        want = own_ids(q, k, v, jnp.int32(rank), jnp.asarray(laid[:, rank * 16 : (rank + 1) * 16]))
        np.testing.assert_array_equal(np.asarray(given(q, k, v, jnp.int32(rank))), np.asarray(want))
    with pytest.raises(ValueError, match="not both"):
        emulation.rank_without_transfer(
            q, k, v, 0, n, segment_ids=one_doc[:, :16], sequence_segment_ids=one_doc
        )
    with pytest.raises(ValueError, match=r"integer \[B, S\] = \[1, 64\]"):
        emulation.rank_without_transfer(q, k, v, 0, n, sequence_segment_ids=one_doc[:, :32])


# -- documents ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ranks,causal,heads,documents,window",
    [
        (1, True, "gqa", "short", None),
        (2, False, "mha", "crossing", None),
        (4, True, "gqa", "crossing", None),
        (8, True, "mqa", "short", None),
        (4, False, "gqa", "one_token", None),
        (2, True, "mha", "one_token", 4),  # documents and a window together
        (8, False, "gqa", "crossing", (6, 2)),
        (4, True, "mqa", "short", 20),
        (4, True, "gqa", "repeated", None),
        (2, False, "gqa", "nan_bits", None),
        (4, True, "gqa", "crossing", 0),  # the ids travel, K/V do not
    ],
    ids=str,
)
def test_documents_match_unsharded_attention(ranks, causal, heads, documents, window):
    _check(ranks, causal=causal, heads=heads, documents=documents, window=window, batch=2)


# -- documents with a bound on their length: the window they imply ----------------------------


@pytest.mark.parametrize(
    "ranks,causal,heads,documents,window,transport",
    [
        (4, True, "gqa", "short", None, "xla"),  # longest 8: a window of 7, the halo (11: wider)
        (8, False, "mqa", "short", None, "xla"),  # longest 13: windows over a chunk
        (2, True, "mha", "crossing", None, "xla"),  # longest 12
        (4, False, "gqa", "crossing", None, "xla"),
        (4, True, "gqa", "short", 2, "xla"),  # and a window of the caller's, narrower
        (8, False, "gqa", "short", (1, 30), "xla"),  # narrower on one side, wider on the other
        (4, True, "gqa", "short", None, "peer"),
        (8, False, "mha", "crossing", None, "peer"),
    ],
    ids=str,
)
def test_a_bound_on_the_documents_changes_nothing_when_it_holds(
    monkeypatch, ranks, causal, heads, documents, window, transport
):
    """``max_document_length`` at the longest document (and above it): the same attention as the
    documents' dense mask without it, values and gradients, on both transports."""
    ids = ac.documents(documents, 2 * ranks * CHUNK, 2, chunk=CHUNK, seed=ranks)
    longest = cpg.longest_document(ids)
    assert longest < 2 * ranks * CHUNK  # a real bound, not the whole sequence
    peer = {}
    if transport == "peer":
        peer_calls_on_xla(monkeypatch)
        peer = dict(workspace=workspace_spec(ranks))
    for bound in (longest, longest + 3):
        _check(ranks, causal=causal, heads=heads, window=window, documents=documents, batch=2,
               max_document_length=bound, **peer)  # fmt: skip


def test_a_bound_below_the_longest_document_is_a_window():
    """A bound that does not hold is not detected: the layer attends as with the window it
    implies (documents of 12 tokens under a bound of 5: a window of 4 on each side), which
    differs from the documents alone."""
    ranks, ids = 4, ac.documents("crossing", 8 * CHUNK, 2, chunk=CHUNK, seed=4)
    inputs = ac.random_inputs(8 * CHUNK, batch=2, heads=4, kv_heads=2, seed=11)
    got = ac.cp_layer(
        cp_mesh(ranks), inputs, dtype=jnp.float32, causal=False, segment_ids=ids, max_document_length=5
    )
    as_window = ac.reference(*inputs, causal=False, segment_ids=ids, local_window_size=4)
    assert max(ac.relative_errors(got, as_window).values()) <= F32_TOLERANCE
    documents_alone = ac.reference(*inputs, causal=False, segment_ids=ids)
    assert max(ac.relative_errors(got, documents_alone).values()) > 0.01


def test_a_padding_run_longer_than_the_bound_changes_only_the_padding_rows():
    """Short documents, then a padding run of 40 tokens (one id) under a bound of 9 that every
    document keeps: the rows before the padding equal the documents' attention, and with a
    cotangent of zero on the padding rows (a loss that ignores padding) so do all of q/k/v's
    gradients; the padding rows' outputs do not (they see 8 keys of their run, not all)."""
    ranks, seq, pad = 4, 8 * CHUNK, 40
    ids = ac.documents("short", seq, 1, chunk=CHUNK, seed=3)
    ids[:, seq - pad :] = ids[0, seq - pad - 1] + 1  # the padding: one run
    assert cpg.longest_document(ids[:, : seq - pad]) <= 9 < cpg.longest_document(ids)
    q, k, v, ct = ac.random_inputs(seq, batch=1, heads=4, kv_heads=2, seed=12)
    inputs = (q, k, v, np.where(np.arange(seq)[None, :, None, None] < seq - pad, ct, 0))
    got = ac.cp_layer(
        cp_mesh(ranks), inputs, dtype=jnp.float32, causal=True, segment_ids=ids, max_document_length=9
    )
    ref = ac.reference(*inputs, causal=True, segment_ids=ids)
    errors = ac.relative_errors(got, ref)
    assert max(errors[name] for name in ("dq", "dk", "dv")) <= F32_TOLERANCE, errors
    out = np.asarray(cpg.from_cp_layout(np.concatenate([got["out"][r] for r in range(ranks)], axis=1), ranks))
    np.testing.assert_allclose(out[:, : seq - pad], ref["out"][:, : seq - pad], atol=F32_TOLERANCE)
    assert np.max(np.abs(out[:, seq - pad :] - ref["out"][:, seq - pad :])) > 0.01


@pytest.mark.parametrize("causal", [True, False])
def test_a_bound_under_a_chunk_moves_only_the_halo(causal):
    """4 ranks of 8 tokens (4-token chunks), bounds of 2 and 4 tokens: K/V move as the halo of
    the window the bound implies (collective-permutes of its rows), with no gather of them and no
    reduce-scatter of their gradients; only the ids (one word a token) are gathered. Without the
    bound K/V are gathered (the control)."""
    gathers = lambda text: re.findall(r"all_gather.*?-> tensor<([\dx]+)xf32>", text)
    permutes = lambda text: set(re.findall(r"collective_permute.*?-> tensor<([\dx]+)xf32>", text))
    for bound in (2, 4):
        text = _lowered(4, max_document_length=bound, is_causal=causal)
        assert gathers(text) == ["1x32x1"] and "reduce_scatter" not in text
        reach = bound - 1
        assert permutes(text) == {f"1x{reach if causal else 2 * reach}x2x16"}
    unbounded = _lowered(4, is_causal=causal)
    assert gathers(unbounded) == ["1x32x1", "1x32x2x16", "1x32x2x16"] and "reduce_scatter" in unbounded


@pytest.mark.parametrize("ranks,causal", [(1, True), (4, True), (8, False)], ids=str)
def test_one_document_is_plain_attention(ranks, causal):
    _check(ranks, causal=causal, documents="one", reference_causal=causal)


def test_small_integer_ids_and_batch_rows():
    """uint8 ids (cast to int32 words), batch rows with different documents."""
    _check(4, documents="crossing", batch=3, ids_dtype=np.uint8, window=(9, 1), causal=False)


@pytest.mark.parametrize(
    "ranks,causal,window,documents",
    [(4, True, 12, "crossing"), (8, False, (20, 5), "short"), (2, True, None, "one_token")],
    ids=str,
)
def test_bfloat16_within_twice_the_kernels_own_error(ranks, causal, window, documents):
    _check(ranks, causal=causal, window=window, documents=documents, dtype=jnp.bfloat16, chunk=16)


@pytest.mark.parametrize(
    "ranks,heads,groups,causal,window,documents",
    [
        (4, "mha", 2, True, 10, "crossing"),
        (8, "gqa", 2, False, (3, 9), None),
        (2, "mha", 4, True, None, "short"),
    ],
    ids=str,
)
def test_head_groups_pipeline_with_masks(ranks, heads, groups, causal, window, documents):
    _check(ranks, causal=causal, heads=heads, window=window, documents=documents, head_groups=groups)


def test_masks_under_jax_checkpoint_and_a_custom_scale():
    _check(4, window=11, documents="crossing", remat=True, scale=0.3)


def test_masks_under_jax_checkpoint_with_the_policy_that_keeps_them():
    """``masks_checkpoint_policy`` (the masks saved, the rest recomputed): the reference's results,
    and the same bits as the plain checkpoint's and as no checkpoint's. (That it keeps the masks:
    test_mosaic_layer.py counts the backward's tile plans.)"""
    policy = cpg.masks_checkpoint_policy()
    _check(4, window=11, documents="crossing", remat=True, remat_policy=policy)
    seq = 2 * 4 * CHUNK
    inputs = ac.random_inputs(seq, seed=5)
    ids = ac.documents("crossing", seq, 1, chunk=CHUNK, seed=4)
    run = lambda **kw: ac.cp_layer(
        cp_mesh(4), inputs, dtype=jnp.float32, segment_ids=ids, local_window_size=11, **kw
    )
    kept = run(remat=True, remat_policy=policy)
    for other in (run(remat=True), run()):
        for name, by_rank in kept.items():
            for rank, rows in by_rank.items():
                np.testing.assert_array_equal(rows, other[name][rank], err_msg=f"{name} rank {rank}")


def test_masks_ignore_transfer_when_alone():
    """At R = 1 a masked call has no remote part, with or without the transport's test path."""
    _check(1, window=3, documents="short", transfer_when_alone=True)


def test_grad_of_a_loss_through_the_masked_layer():
    """jax.grad of a scalar loss under jit, with documents and a window."""
    ranks, seq = 4, 64
    q, k, v, _ = ac.random_inputs(seq, seed=3)
    ids = ac.documents("crossing", seq, 1, chunk=CHUNK, seed=0)
    mesh = cp_mesh(ranks)
    spec = jax.sharding.PartitionSpec(None, "cp")

    def loss(q, k, v, ids):
        out = cpg.dot_product_attention(q, k, v, axis_name="cp", segment_ids=ids, local_window_size=(9, 0))
        return jax.lax.psum(jnp.sum(jnp.sin(out)), "cp")

    grad = jax.jit(jax.shard_map(jax.grad(loss, argnums=(0, 1, 2)), mesh=mesh, in_specs=spec, out_specs=spec))
    laid = [cpg.to_cp_layout(x, ranks, seq_axis=1) for x in (q, k, v, ids)]
    got = [np.asarray(cpg.from_cp_layout(g, ranks, seq_axis=1)) for g in grad(*laid)]
    mask = ac.document_mask(ids)[:, None]
    attend = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, mask=mask, local_window_size=(9, 0)
    )
    ref = jax.grad(lambda q, k, v: jnp.sum(jnp.sin(attend(q, k, v))), (0, 1, 2))(q, k, v)
    for g, r in zip(got, ref, strict=True):
        np.testing.assert_allclose(g, r, atol=F32_TOLERANCE * np.abs(r).max())


@pytest.mark.parametrize("head_groups", [1, 2])
def test_masks_under_vmap(head_groups):
    """jax.vmap over a leading axis of q, k, v and the segment ids inside shard_map: each slice
    equals the unsharded attention of that slice, values and gradients."""
    ranks, seq, slices = 4, 64, 2
    per_slice = [ac.random_inputs(seq, heads=4, kv_heads=2, seed=40 + i) for i in range(slices)]
    stacked = [np.stack(xs) for xs in zip(*per_slice, strict=True)]
    ids = np.stack(
        [ac.documents(kind, seq, 1, chunk=CHUNK, seed=i) for i, kind in enumerate(("crossing", "short"))]
    )
    mesh = cp_mesh(ranks)
    spec = jax.sharding.PartitionSpec(None, None, "cp")

    def one(q, k, v, ct, ids):
        layer_fn = lambda q, k, v: cpg.dot_product_attention(
            q, k, v, axis_name="cp", segment_ids=ids, local_window_size=(13, 2), is_causal=False,
            head_groups=head_groups,
        )  # fmt: skip
        out, vjp = jax.vjp(layer_fn, q, k, v)
        return (out, *vjp(ct))

    step = jax.jit(jax.shard_map(jax.vmap(one), mesh=mesh, in_specs=spec, out_specs=spec))
    laid = [cpg.to_cp_layout(x, ranks, seq_axis=2) for x in (*stacked, ids)]
    got = [np.asarray(cpg.from_cp_layout(g, ranks, seq_axis=2)) for g in step(*laid)]
    for i in range(slices):
        ref = ac.reference(*per_slice[i], causal=False, segment_ids=ids[i], local_window_size=(13, 2))
        for name, g in zip(ac.NAMES, got, strict=True):
            atol = F32_TOLERANCE * np.abs(ref[name]).max()
            np.testing.assert_allclose(g[i], ref[name], atol=atol, err_msg=name)


# -- the masked kernel's contract ------------------------------------------------------------


@pytest.mark.parametrize("impl", [k.name for k in kernels.KERNELS if k.takes_masks])
def test_masked_kernels_keep_the_contract(impl):
    """A masked call against jax.nn.dot_product_attention with the dense mask, on keys whose
    positions jump (the other ranks' chunks): rows that see no key have output 0, lse -inf and
    zero gradients, and keys that no row sees get zero gradients. (The Pallas kernels keep the
    same contract in tests/test_mosaic_*.py, at the shapes and on the devices they take.)"""
    why_not = kernels.by_name(impl).why_not(jnp.float32, 16, True)
    if why_not is not None:
        pytest.skip(f"implementation={impl!r} needs {why_not} (float32, head dim 16 here)")
    q, k, v, ct = (jnp.asarray(x) for x in ac.random_inputs(12, batch=2, heads=4, kv_heads=2, seed=1))
    q, ct = q[:, :6], ct[:, :6]
    q_pos = jnp.array([0, 1, 2, 13, 14, 15], jnp.int32)
    k_pos = jnp.array([3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 20, 21], jnp.int32)
    runs = jnp.array([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 1, 1]], jnp.int32)
    k_runs = jnp.array([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2], [0] * 10 + [1, 1]], jnp.int32)
    mask = masks.Mask(causal=True, window=(9, 0))
    vis = masks.visibility(mask, q_pos, k_pos, runs, k_runs)
    dense = np.asarray(vis.dense())
    out, lse = kernels.masked_forward(impl, q, k, v, vis, scale=0.25)
    dq, dk, dv = kernels.masked_backward(impl, q, k, v, out, lse, ct, vis, scale=0.25)
    empty, unseen = ~dense.any(-1), ~dense.any(-2)  # [B, T], [B, L]
    assert empty.any() and (~empty).any() and unseen.any()
    assert np.all(np.asarray(out)[empty] == 0) and np.all(
        np.isneginf(np.asarray(lse).transpose(0, 2, 1)[empty])
    )
    for grad, where in ((dq, empty), (dk, unseen), (dv, unseen)):
        assert not np.any(np.asarray(grad)[where])
    attend = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, scale=0.25, mask=jnp.asarray(dense)[:, None]
    )
    ref_out, vjp = jax.vjp(attend, q, k, v)
    # jax.nn gives empty rows the mean of V and gradients: compare where a row sees a key
    ct_seen = jnp.where(jnp.asarray(~empty)[:, :, None, None], ct, 0)
    np.testing.assert_allclose(np.asarray(out)[~empty], np.asarray(ref_out)[~empty], atol=1e-6)
    for got, want in zip((dq, dk, dv), vjp(ct_seen), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


# -- what travels ------------------------------------------------------------------------------


def _lowered(ranks: int, **kw) -> str:
    """The lowered text of the layer's forward and backward on the XLA transport."""
    spec = jax.sharding.PartitionSpec(None, "cp")

    def body(q, k, v, ids):
        attend = lambda q, k, v: cpg.dot_product_attention(q, k, v, axis_name="cp", segment_ids=ids, **kw)
        out, vjp = jax.vjp(attend, q, k, v)
        return vjp(out)

    step = jax.jit(jax.shard_map(body, mesh=cp_mesh(ranks), in_specs=spec, out_specs=spec))
    q = jax.ShapeDtypeStruct((1, 32, 4, 16), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, 32, 2, 16), jnp.float32)
    ids = jax.ShapeDtypeStruct((1, 32), jnp.int32)
    return step.trace(q, kv, kv, ids).lower().as_text()


def test_what_travels_with_masks():
    """Documents: the ids (one float32 word per token) are gathered before K/V; a window that
    keeps each query to itself moves no K/V (and no dK/dV); R = 1 moves nothing."""
    gathers = lambda text: re.findall(r"all_gather.*?-> tensor<([\dx]+)xf32>", text)
    assert gathers(_lowered(4)) == ["1x32x1", "1x32x2x16", "1x32x2x16"]  # the ids, then K and V
    alone = _lowered(4, local_window_size=0)
    assert gathers(alone) == ["1x32x1"] and "reduce_scatter" not in alone
    single = _lowered(1, local_window_size=3)
    assert "all_gather" not in single and "reduce_scatter" not in single


# -- bad input: a ValueError before anything runs -----------------------------------------------


def _trace(*, ids_shape=(1, 16), ids_dtype=jnp.int32, dtype=jnp.float32, **kw):
    spec = jax.sharding.PartitionSpec(None, "cp")
    body = lambda q, k, v, ids: cpg.dot_product_attention(q, k, v, axis_name="cp", segment_ids=ids, **kw)
    q = jax.ShapeDtypeStruct((1, 16, 4, 8), dtype)
    kv = jax.ShapeDtypeStruct((1, 16, 2, 8), dtype)
    shard = jax.shard_map(body, mesh=cp_mesh(2), in_specs=spec, out_specs=spec)
    jax.jit(shard).trace(q, kv, kv, jax.ShapeDtypeStruct(ids_shape, ids_dtype))


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"is_causal": "False"}, "is_causal must be a Python bool (static), got 'False'"),
        ({"is_causal": 1}, "is_causal must be a Python bool"),
        ({"is_causal": np.array(True)}, "is_causal must be a Python bool (static), got ndarray"),
        ({"ids_shape": (1, 16, 1)}, "segment_ids must be [B, T] = [1, 8]"),
        ({"ids_shape": (2, 16)}, "segment_ids must be [B, T] = [1, 8]"),
        ({"ids_dtype": jnp.float32}, "segment_ids must have an integer dtype, got float32"),
        ({"ids_dtype": jnp.bool_}, "segment_ids must have an integer dtype, got bool"),
        ({"local_window_size": -1}, "local_window_size: both sides must be ints >= 0"),
        ({"local_window_size": (1, 2, 3)}, "local_window_size must be None, an int w"),
        ({"local_window_size": 2.5}, "local_window_size must be None, an int w"),
        ({"local_window_size": (4, None)}, "local_window_size: both sides must be ints >= 0"),
        ({"local_window_size": True}, "local_window_size must be None, an int w"),
        ({"max_document_length": 0}, "max_document_length must be None or an int >= 1, got 0"),
        ({"max_document_length": True}, "max_document_length must be None or an int >= 1, got True"),
        ({"max_document_length": 4.0}, "max_document_length must be None or an int >= 1, got 4.0"),
        (
            {"implementation": "cudnn", "dtype": jnp.bfloat16},
            "implementation='cudnn' takes no documents (segment_ids), and a local window only with "
            "is_causal=True (a left side only; any length); use implementation='mosaic' (on sm_90 "
            "GPUs) or 'xla' (or None)",
        ),
        (
            {"implementation": "flash"},
            "implementation must be None, 'cudnn' or 'mosaic' or 'xla', got 'flash'",
        ),
    ],
    ids=str,
)
def test_bad_input_is_a_value_error(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _trace(**kw)


def test_a_bound_without_documents_is_a_value_error():
    q = jnp.zeros((1, 16, 2, 8))
    with pytest.raises(ValueError, match="max_document_length bounds the documents of segment_ids"):
        cpg.dot_product_attention(q, q, q, axis_name="cp", max_document_length=8)


def test_segment_ids_that_are_not_an_array():
    q = jnp.zeros((1, 16, 2, 8))
    with pytest.raises(ValueError, match="segment_ids is not an array: list"):
        cpg.dot_product_attention(q, q, q, axis_name="cp", segment_ids=[[0] * 16])
