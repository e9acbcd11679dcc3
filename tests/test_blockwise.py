"""The blockwise XLA path against ``jax.nn.dot_product_attention`` with the dense mask.

Each case is one ``jax.jit`` (blockwise forward and backward, the reference and its VJP), small
enough for the CPU: lengths up to 300, that are not multiples of the tiles, 4 query heads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_cpgrad.attention import blockwise, masks

F32 = jnp.float32
TOL_F32 = 2e-5


def visibility_of(seen) -> masks.Visibility:
    """The Visibility of a dense relation ``[Bp, T, L]`` whose rows and columns are intervals."""
    seen = np.asarray(seen, bool)

    def intervals(x):
        any_seen = x.any(-1)
        lo = np.where(any_seen, x.argmax(-1), 0)
        hi = np.where(any_seen, x.shape[-1] - x[..., ::-1].argmax(-1), 0)
        return jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)

    vis = masks.Visibility(*intervals(seen), *intervals(seen.transpose(0, 2, 1)))
    assert (np.asarray(vis.dense()) == seen).all(), "a row is not one interval"
    return vis


def documents(seg, q_pos, k_pos, mask):
    """Dense relation with documents: segment ids ``seg [B, S]`` of the whole sequence."""
    seg = np.asarray(seg)
    return np.asarray(masks.visible(mask, q_pos, k_pos, seg[:, q_pos], seg[:, k_pos]))


def inputs(b, t, l_len, n, kh, h, dtype=F32, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, t, n, h), F32)
    k = jax.random.normal(keys[1], (b, l_len, kh, h), F32)
    v = jax.random.normal(keys[2], (b, l_len, kh, h), F32)
    do = jax.random.normal(keys[3], (b, t, n, h), F32)
    return tuple(x.astype(dtype) for x in (q, k, v, do))


def reference(q, k, v, seen, scale):
    """jax.nn.dot_product_attention with the dense mask; rows that see nothing are 0 (jax gives
    them the mean of all values)."""
    out = jax.nn.dot_product_attention(q, k, v, mask=seen[:, None], scale=scale)
    empty = ~seen.any(-1)  # [Bp, T]
    return jnp.where(empty[:, :, None, None], jnp.zeros((), out.dtype), out)


def reference_lse(q, k, seen, scale):
    """float64 numpy ``[B, N, T]``: natural log of the summed exponentials, -inf for empty rows."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    g = q.shape[2] // k.shape[2]
    s = np.einsum("btnh,bsnh->bnts", q, np.repeat(k, g, axis=2)) * scale
    s = np.where(seen[:, None], s, -np.inf)
    m = s.max(-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (
            np.log(np.exp(s - np.where(np.isfinite(m), m, 0)).sum(-1))
            + np.where(np.isfinite(m), m, 0)[..., 0]
        )


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_k"))
def run_all(q, k, v, do, vis, seen, *, scale, block_q, block_k):
    """Blockwise (out, lse, dq, dk, dv) and the reference's (out, dq, dk, dv)."""
    out, lse = blockwise.forward(q, k, v, vis, scale=scale, block_q=block_q, block_k=block_k)
    grads = blockwise.backward(q, k, v, out, lse, do, vis, scale=scale, block_q=block_q, block_k=block_k)
    ref_out, vjp = jax.vjp(lambda q, k, v: reference(q, k, v, seen, scale), q, k, v)
    return (out, lse, *grads), (ref_out, *vjp(do))


def rel_err(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(x - ref).max() / max(np.abs(ref).max(), 1e-30))


def check_f32(q, k, v, do, seen, *, block_q=64, block_k=32, vis=None):
    vis = visibility_of(seen) if vis is None else vis
    scale = q.shape[-1] ** -0.5
    (out, lse, *grads), (ref_out, *ref_grads) = run_all(
        q, k, v, do, vis, jnp.asarray(seen), scale=scale, block_q=block_q, block_k=block_k
    )
    assert out.dtype == q.dtype and lse.dtype == F32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    for x in (out, lse, *grads):
        assert not np.isnan(np.asarray(x)).any()
    errors = {
        name: rel_err(x, r)
        for name, x, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads), strict=True)
    }
    ref_lse = np.broadcast_to(reference_lse(q, k, seen, scale), lse.shape)
    finite = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)  # -inf exactly where nothing is seen
    assert (np.asarray(lse)[~finite] == -np.inf).all()
    errors["lse"] = rel_err(np.asarray(lse)[finite], ref_lse[finite])
    assert max(errors.values()) <= TOL_F32, errors
    return out, lse, grads


def natural(mask, t, l_len=None, q_offset=0):
    """Dense ``[1, T, L]``: queries at positions q_offset.. against keys 0..L."""
    q_pos = np.arange(t, dtype=np.int32) + q_offset
    k_pos = np.arange(t if l_len is None else l_len, dtype=np.int32)
    return np.asarray(masks.visible(mask, q_pos, k_pos))


def random_documents(rng, s, n_docs):
    """Sorted segment ids ``[1, s]`` of about n_docs documents (they start anywhere in a tile)."""
    return np.sort(rng.randint(0, n_docs, size=(1, s)), axis=1)


# Cases share shapes, so that one compiled program serves several masks (they are data).
# GQA: queries at positions 40..190 against keys 0..190 (a causal mask has an offset), B = 2, and
# a relation per batch entry (Bp = B).
GQA = dict(b=2, t=150, l_len=190, n=4, kh=2, h=16, block_q=32, block_k=64)
Q_POS, K_POS = np.arange(150, dtype=np.int32) + 40, np.arange(190, dtype=np.int32)


def gqa_relations():
    rng = np.random.RandomState(0)
    causal = masks.Mask(causal=True)
    offset = lambda mask, off=40: natural(mask, 150, 190, off)
    docs = lambda seg, mask: documents(seg, Q_POS, K_POS, mask)
    one_token = random_documents(rng, 190, 12)
    one_token[0, 100:120] = np.arange(1000, 1020)  # twenty one-token documents
    padded = docs(random_documents(rng, 190, 5), causal).copy()
    padded[:, 130:] = False  # the last rows are padding: they see nothing
    return {
        "causal_offset/asym_window": [offset(causal), offset(masks.Mask(window=(7, 40)))],
        "many_docs/one_token_docs": [
            docs(random_documents(rng, 190, 40), causal),
            docs(np.sort(one_token, axis=1), masks.Mask(causal=True, window=(20, None))),
        ],
        "one_doc/windowed_docs": [
            docs(np.zeros((1, 190), np.int64), causal),
            docs(random_documents(rng, 190, 6), masks.Mask(window=(20, 9))),
        ],
        "rows_see_nothing": [offset(causal, -60), padded],  # rows 0..59 are before every key
        "full/nothing": [offset(masks.Mask()), np.zeros((1, 150, 190), bool)],
    }


GQA_RELATIONS = gqa_relations()


@pytest.mark.parametrize("name", GQA_RELATIONS)
def test_gqa_masks(name):
    seen = np.concatenate(GQA_RELATIONS[name])
    dims = {k: GQA[k] for k in ("b", "t", "l_len", "n", "kh", "h")}
    q, k, v, do = inputs(**dims, seed=len(name))
    out, lse, grads = check_f32(q, k, v, do, seen, block_q=GQA["block_q"], block_k=GQA["block_k"])
    empty = ~seen.any(-1)  # [B, T]
    if empty.any():  # out 0, lse -inf, dq 0 (not NaN) where a row sees nothing
        assert (np.asarray(out)[empty] == 0).all() and (np.asarray(grads[0])[empty] == 0).all()
        assert (np.asarray(lse).transpose(0, 2, 1)[empty] == -np.inf).all()
    if name == "rows_see_nothing":
        assert empty[0].sum() == 60 and empty[1].sum() == 20
    if name == "full/nothing":
        assert all((np.asarray(g)[1] == 0).all() for g in grads)  # an entry that sees nothing


def test_mha_causal_and_cp_own_chunks():
    """MHA, Bp = 1 shared by B = 2: causal self-attention, then a CP rank's two chunks (r = 0 of
    R = 2, c = 100: not a multiple of the 64-row tile) against its own keys."""
    q, k, v, do = inputs(2, 200, 200, 2, 2, 32, seed=1)
    check_f32(q, k, v, do, natural(masks.Mask(causal=True), 200), block_q=64, block_k=32)
    pos = np.concatenate([np.arange(0, 100), np.arange(300, 400)])
    seen = np.asarray(masks.visible(masks.Mask(causal=True), pos, pos))
    check_f32(q, k, v, do, seen, block_q=64, block_k=32)


def test_mqa_windows():
    """MQA, 257 rows (not a multiple of the tiles): a causal sliding window, and one smaller than
    a tile."""
    q, k, v, do = inputs(1, 257, 257, 4, 1, 16, seed=2)
    for window in ((30, None), (3, 0)):
        check_f32(q, k, v, do, natural(masks.Mask(causal=True, window=window), 257), block_q=64, block_k=64)


def test_cp_rank_against_whole_sequence():
    """A CP rank's queries (chunks r and 2R-1-r of c = 45 rows) against the whole sequence of
    2Rc = 180 keys, causal, for both ranks of R = 2 (tiles of 32 straddle the chunks)."""
    q, k, v, do = inputs(1, 90, 180, 4, 2, 16, seed=3)
    for r in (0, 1):
        q_pos = np.concatenate([np.arange(r * 45, (r + 1) * 45), np.arange((3 - r) * 45, (4 - r) * 45)])
        seen = np.asarray(masks.visible(masks.Mask(causal=True), q_pos, np.arange(180)))
        check_f32(q, k, v, do, seen, block_q=32, block_k=32)


def test_visibility_from_masks():
    """The Visibility that masks.visibility builds (documents through run ids) gives the same."""
    rng = np.random.RandomState(4)
    seg = np.concatenate([random_documents(rng, 190, 30), random_documents(rng, 190, 4)])
    runs = np.asarray(masks.run_ids(seg))
    mask = masks.Mask(causal=True, window=(50, None))
    vis = masks.visibility(mask, Q_POS, K_POS, runs[:, Q_POS], runs[:, K_POS])
    seen = documents(seg, Q_POS, K_POS, mask)
    dims = {k: GQA[k] for k in ("b", "t", "l_len", "n", "kh", "h")}
    q, k, v, do = inputs(**dims, seed=5)
    check_f32(q, k, v, do, seen, block_q=GQA["block_q"], block_k=GQA["block_k"], vis=vis)


@pytest.mark.parametrize("case", ["gqa", "mqa"])
def test_bfloat16(case):
    """In bfloat16, no farther from the float32 truth than twice the reference's own bf16 error
    (both from the same bf16 inputs)."""
    if case == "gqa":
        dims = {k: GQA[k] for k in ("b", "t", "l_len", "n", "kh", "h")}
        seen, bq, bk = (
            np.concatenate(GQA_RELATIONS["many_docs/one_token_docs"]),
            GQA["block_q"],
            GQA["block_k"],
        )
    else:
        dims = dict(b=1, t=257, l_len=257, n=4, kh=1, h=16)
        seen, bq, bk = natural(masks.Mask(causal=True, window=(30, None)), 257), 64, 64
    q, k, v, do = inputs(**dims, dtype=jnp.bfloat16, seed=6)
    vis, scale, seen = visibility_of(seen), dims["h"] ** -0.5, jnp.asarray(seen)
    ours, ref16 = run_all(q, k, v, do, vis, seen, scale=scale, block_q=bq, block_k=bk)
    up = lambda x: x.astype(F32)
    _, truth = run_all(up(q), up(k), up(v), up(do), vis, seen, scale=scale, block_q=bq, block_k=bk)
    for name, x, r16, r32 in zip(("out", "dq", "dk", "dv"), (ours[0], *ours[2:]), ref16, truth, strict=True):
        assert x.dtype == jnp.bfloat16
        ours_err, ref_err = rel_err(x, r32), rel_err(r16, r32)
        assert ours_err <= 2 * ref_err + 1e-3, (name, ours_err, ref_err)


def merge(parts):
    """(out, lse) of parts of the same rows' attention; rows empty in every part stay 0, -inf."""
    lse = functools.reduce(jnp.logaddexp, [lp for _, lp in parts])
    safe = jnp.where(lse == -jnp.inf, 0.0, lse)
    weight = lambda lp: jnp.swapaxes(jnp.exp(lp - safe), -1, -2)[..., None]
    return sum(weight(lp) * op.astype(F32) for op, lp in parts), lse


def test_backward_from_merged_parts():
    """Two key parts' backwards, each from the MERGED (out, lse), give the whole's gradients:
    the merge property the layer's exact backward rests on."""
    t, l_len, split = 160, 200, 100  # the split is not on a tile boundary
    seen = natural(masks.Mask(causal=True, window=(90, None)), t, l_len, 40)
    q, k, v, do = inputs(1, t, l_len, 4, 2, 16, seed=7)
    kw = dict(scale=0.25, block_q=32, block_k=32)
    cuts = (slice(0, split), slice(split, None))

    @jax.jit
    def by_parts(q, k, v, do, parts_vis):
        outs = [
            blockwise.forward(q, k[:, c], v[:, c], vis, **kw) for c, vis in zip(cuts, parts_vis, strict=True)
        ]
        out, lse = merge(outs)
        grads = [
            blockwise.backward(q, k[:, c], v[:, c], out, lse, do, vis, **kw)
            for c, vis in zip(cuts, parts_vis, strict=True)
        ]
        dq = sum(g[0].astype(F32) for g in grads)
        return out, lse, dq, *(jnp.concatenate([g[i] for g in grads], axis=1) for i in (1, 2))

    @jax.jit
    def whole(q, k, v, do, vis):
        out, lse = blockwise.forward(q, k, v, vis, **kw)
        return out, lse, *blockwise.backward(q, k, v, out, lse, do, vis, **kw)

    got = by_parts(q, k, v, do, [visibility_of(seen[:, :, c]) for c in cuts])
    want = whole(q, k, v, do, visibility_of(seen))
    for x, y in zip(got, want, strict=True):
        assert rel_err(x, y) <= TOL_F32


def test_same_bits_every_run():
    seen = np.concatenate(GQA_RELATIONS["causal_offset/asym_window"])
    dims = {k: GQA[k] for k in ("b", "t", "l_len", "n", "kh", "h")}
    q, k, v, do = inputs(**dims, seed=8)
    args = (q, k, v, do, visibility_of(seen), jnp.asarray(seen))
    kw = dict(scale=GQA["h"] ** -0.5, block_q=GQA["block_q"], block_k=GQA["block_k"])
    first, second = (run_all(*args, **kw)[0] for _ in range(2))
    for x, y in zip(first, second, strict=True):
        np.testing.assert_array_equal(np.asarray(x).view(np.uint32), np.asarray(y).view(np.uint32))


def test_rejects_bad_shapes():
    vis = lambda t, l_len: masks.Visibility(*(np.zeros((1, n), np.int32) for n in (t, t, l_len, l_len)))
    x = lambda *shape: np.zeros(shape, np.float32)
    with pytest.raises(ValueError, match="K dividing N"):
        blockwise.forward(x(1, 8, 3, 16), x(1, 8, 2, 16), x(1, 8, 2, 16), vis(8, 8), scale=1.0)
    with pytest.raises(ValueError, match="visibility"):
        blockwise.forward(x(1, 8, 2, 16), x(1, 8, 2, 16), x(1, 8, 2, 16), vis(8, 9), scale=1.0)
