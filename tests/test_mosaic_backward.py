"""The Mosaic GPU backward kernels (``jax_cpgrad.attention.mosaic_gpu.backward``) without a GPU.

- **Interpret mode** (``plgpu.force_gpu_interpret_mode``: SMEM, TMA, barriers and wgmma simulated
  on the CPU): dq, dk, dv against ``jax.vjp`` of ``jax.nn.dot_product_attention`` in float32
  with ``mask=vis.dense()``, for the masks a CP rank meets, GQA 1 and 4, bf16 and f16, lengths
  that are not a multiple of the tile and rows that see nothing; the tolerance is twice the
  reference's own error in the input dtype. And the merge property: the backward of two key
  parts, each given the merged out and lse, sums to the backward of the whole.
- **Lowering for CUDA** (``jax.export`` with ``platforms=["cuda"]``, the whole Mosaic GPU
  lowering on the CPU): the same configurations and head dim 128, in the GPU form (operands in
  registers) and the interpret form (through shared memory).

Both skip with a reason where this jax lacks interpret mode or the CUDA plugin
(``JAX_CPGRAD_REQUIRE_LOWERING=1``: a missing plugin fails instead).
"""

from __future__ import annotations

import importlib.util
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_cpgrad.attention import blockwise, masks

# The module (the package re-exports its function under the same name).
mb = importlib.import_module("jax_cpgrad.attention.mosaic_gpu.backward")

F32 = jnp.float32
HAS_INTERPRET = hasattr(plgpu, "force_gpu_interpret_mode") and hasattr(plgpu, "InterpretGPUParams")
HAS_CUDA_PLUGIN = any(importlib.util.find_spec(m) for m in ("jax_cuda13_plugin", "jax_cuda12_plugin"))
needs_interpret = pytest.mark.skipif(
    not HAS_INTERPRET, reason=f"jax {jax.__version__}: no GPU interpret mode (plgpu.force_gpu_interpret_mode)"
)
# JAX_CPGRAD_REQUIRE_LOWERING=1 (scripts/test_mosaic_lowering.sh): a missing plugin fails, not skips.
needs_cuda_lowering = pytest.mark.skipif(
    not HAS_CUDA_PLUGIN and os.environ.get("JAX_CPGRAD_REQUIRE_LOWERING") != "1",
    reason="no jax CUDA plugin (jax-cuda13-plugin): Pallas has no Mosaic GPU lowering without it",
)


# -- cases -----------------------------------------------------------------------------------------


def _cp_rank_positions(rank: int, ranks: int, chunk: int):
    """A CP rank's queries (chunks rank and 2R-1-rank) against the natural order of 2R chunks."""
    last = 2 * ranks - 1 - rank
    q_pos = np.concatenate(
        [np.arange(rank * chunk, (rank + 1) * chunk), np.arange(last * chunk, (last + 1) * chunk)]
    )
    return q_pos, np.arange(2 * ranks * chunk)


def _documents(b: int, length: int, seed: int):
    """Run ids [b, length] of random document lengths (every row different)."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((b, length), np.int32)
    for row in range(b):
        cuts = np.sort(rng.choice(np.arange(8, length - 8), size=3, replace=False))
        for cut in cuts:
            ids[row, cut:] += 1
    return ids


CAUSAL = masks.Mask(causal=True)
BF16, F16 = jnp.bfloat16, jnp.float16
ar = np.arange
# fmt: off
CASES = {
    # name: (B, N, K, dtype, mask, q_pos, k_pos, documents)
    "causal_cp_rank0_gqa4": (1, 4, 1, BF16, CAUSAL, *_cp_rank_positions(0, 2, 48), False),  # T 96, L 192
    "causal_cp_rank1_f16": (1, 2, 2, F16, CAUSAL, *_cp_rank_positions(1, 2, 32), False),
    "full_f16": (2, 2, 2, F16, masks.Mask(), ar(64), ar(128), False),  # B 2 sharing one plan
    "window_causal_gqa2": (1, 2, 1, BF16, masks.Mask(True, (40, None)), ar(160), ar(160), False),
    "window_two_sided": (1, 1, 1, BF16, masks.Mask(window=(30, 20)), ar(128), ar(128), False),
    "documents_causal_gqa4": (2, 4, 1, BF16, CAUSAL, ar(128), ar(128), True),  # a plan per batch entry
    "rows_see_nothing_f16": (1, 1, 1, F16, CAUSAL, ar(100), ar(40, 168), False),  # queries 0..39
}
# fmt: on


def _inputs(name: str, head_dim: int = 64):
    b, n, kh, dtype, mask, q_pos, k_pos, documents = CASES[name]
    t, l_len = len(q_pos), len(k_pos)
    runs = (None, None)
    if documents:  # self-attention here: the same run ids for queries and keys
        ids = jnp.asarray(_documents(b, t, seed=t))
        runs = (masks.run_ids(ids), masks.run_ids(ids))
    vis = masks.visibility(mask, jnp.asarray(q_pos, jnp.int32), jnp.asarray(k_pos, jnp.int32), *runs)
    keys = jax.random.split(jax.random.key(len(name)), 4)
    q = jax.random.normal(keys[0], (b, t, n, head_dim), F32).astype(dtype)
    k = jax.random.normal(keys[1], (b, l_len, kh, head_dim), F32).astype(dtype)
    v = jax.random.normal(keys[2], (b, l_len, kh, head_dim), F32).astype(dtype)
    d_out = jax.random.normal(keys[3], (b, t, n, head_dim), F32).astype(dtype)
    return q, k, v, d_out, vis


# -- the reference -----------------------------------------------------------------------------


def _attention(q, k, v, vis, scale):
    """``jax.nn.dot_product_attention`` with ``mask=vis.dense()``; a row that sees nothing gets 0
    (dot_product_attention would average all values there)."""
    dense = vis.dense()[:, None]  # [Bp, 1, T, L]
    out = jax.nn.dot_product_attention(q, k, v, mask=dense, scale=scale, implementation="xla")
    sees = jnp.any(vis.dense(), axis=-1)[:, :, None, None]
    return jnp.where(sees, out, jnp.zeros_like(out))


def _lse(q, k, vis, scale):
    """float32 [B, N, T] natural-log log-sum-exp (-inf where a row sees nothing)."""
    n, kh = q.shape[2], k.shape[2]
    kf = jnp.repeat(k.astype(F32), n // kh, axis=2)
    s = jnp.einsum("btnh,blnh->bntl", q.astype(F32), kf, precision="highest") * scale
    return jax.nn.logsumexp(jnp.where(vis.dense()[:, None], s, -jnp.inf), axis=-1)


def _reference_grads(q, k, v, d_out, vis, scale, dtype):
    """(out, (dq, dk, dv)) of the reference, computed in ``dtype`` (float32: the exact one)."""
    cast = lambda x: x.astype(dtype)
    with jax.default_matmul_precision("highest"):
        out, vjp = jax.vjp(lambda q, k, v: _attention(q, k, v, vis, scale), cast(q), cast(k), cast(v))
        return out, vjp(cast(d_out))


def _max_err(a, b):
    return float(jnp.max(jnp.abs(jnp.asarray(a, F32) - jnp.asarray(b, F32))))


def _interpret_backward(q, k, v, out, lse, d_out, vis, scale, consumers=2):
    config = mb.default_config(q.shape[-1], interpret=True).replace(
        consumers=consumers, narrow_small_grids=False
    )  # these grids are small: with narrowing, 2 would run 1
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        return jax.block_until_ready(mb.backward(q, k, v, out, lse, d_out, vis, scale=scale, config=config))


# -- interpret mode ------------------------------------------------------------------------------


@needs_interpret
@pytest.mark.parametrize("consumers", [1, 2])
@pytest.mark.parametrize("name", list(CASES))
def test_interpret_matches_reference(name, consumers):
    q, k, v, d_out, vis = _inputs(name)
    scale = q.shape[-1] ** -0.5
    out32, exact = _reference_grads(q, k, v, d_out, vis, scale, F32)
    _, low = _reference_grads(q, k, v, d_out, vis, scale, q.dtype)
    lse = _lse(q, k, vis, scale)
    # out in float32: delta = rowsum(d_out * out) is then the reference's (a 16-bit out adds its
    # own rounding to delta, the same for every flash backward: test_interpret_rounded_out).
    got = _interpret_backward(q, k, v, out32, lse, d_out, vis, scale, consumers)
    for what, g, x, r, ref_in in zip(("dq", "dk", "dv"), got, exact, low, (q, k, v), strict=True):
        assert g.dtype == ref_in.dtype and g.shape == ref_in.shape, (what, g.dtype, g.shape)
        assert bool(jnp.all(jnp.isfinite(g.astype(F32)))), what
        ref_err = _max_err(r, x)  # the reference's own error in the input dtype
        err = _max_err(g, x)
        assert err <= 2 * ref_err, f"{name} {what}: error {err:.3g} > 2 x the reference's {ref_err:.3g}"
    # Rows that see nothing have dq = 0 exactly; keys seen by nobody have dk = dv = 0 exactly.
    sees = np.asarray(jnp.any(vis.dense(), axis=-1))  # [Bp, T]
    seen = np.asarray(jnp.any(vis.dense(), axis=-2))  # [Bp, L]
    dq, dk, dv = (np.asarray(g.astype(F32)) for g in got)
    assert np.all(np.broadcast_to(~sees, dq.shape[:2])[..., None, None] <= (dq == 0))
    assert np.all(np.broadcast_to(~seen, dk.shape[:2])[..., None, None] <= ((dk == 0) & (dv == 0)))
    if name == "rows_see_nothing_f16":
        assert (~sees).sum() == 40 and not seen.all()


@needs_interpret
@pytest.mark.timeout(300)  # turns that do not pair up hang the interpreter (as they would a GPU)
@pytest.mark.parametrize("name", ["documents_causal_gqa4", "window_two_sided", "rows_see_nothing_f16"])
def test_interpret_pingpong_gives_the_same_bits(name, monkeypatch):
    """The consumers taking turns (``pingpong``) change only the order of the issues: dq, dk, dv
    are bitwise those without turns. Both kernels run two consumers here and take turns."""
    q, k, v, d_out, vis = _inputs(name)
    scale = q.shape[-1] ** -0.5
    out32, _ = _reference_grads(q, k, v, d_out, vis, scale, F32)
    lse = _lse(q, k, vis, scale)
    config = mb.default_config(q.shape[-1], interpret=True).replace(narrow_small_grids=False)
    turns = []

    class Spy(mb.Turns):  # records whether each kernel built takes turns
        def __init__(self, barrier, wg):
            turns.append(barrier is not None)
            super().__init__(barrier, wg)

    monkeypatch.setattr(mb, "Turns", Spy)
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        run = lambda c: jax.block_until_ready(
            mb.backward(q, k, v, out32, lse, d_out, vis, scale=scale, config=c)
        )
        plain = run(config)
        assert turns == [False, False]
        taking_turns = run(config.replace(pingpong=True))
        assert turns[2:] == [True, True]  # the dQ kernel's and the dK/dV kernel's
    for what, got, want in zip(("dq", "dk", "dv"), taking_turns, plain, strict=True):
        np.testing.assert_array_equal(np.asarray(got.astype(F32)), np.asarray(want.astype(F32)), err_msg=what)


@needs_interpret
@pytest.mark.parametrize("name", ["documents_causal_gqa4"])
def test_interpret_rounded_out(name):
    """With out rounded to q's dtype (what the layer passes), against the plain-jnp blockwise
    backward given the same out and lse (float32 throughout): only the kernel's 16-bit P and dS
    and its output rounding differ, so the tolerance is twice the reference's error plus one
    ulp of the largest gradient (the two round on either side of a midpoint)."""
    q, k, v, d_out, vis = _inputs(name)
    scale = q.shape[-1] ** -0.5
    out32, exact = _reference_grads(q, k, v, d_out, vis, scale, F32)
    _, low = _reference_grads(q, k, v, d_out, vis, scale, q.dtype)
    out, lse = out32.astype(q.dtype), _lse(q, k, vis, scale)
    config = mb.default_config(q.shape[-1], interpret=True)
    want = blockwise.backward(
        q.astype(F32), k.astype(F32), v.astype(F32), out, lse, d_out.astype(F32), vis,
        scale=scale, block_q=config.block_q, block_k=config.block_k,
    )  # fmt: skip
    got = _interpret_backward(q, k, v, out, lse, d_out, vis, scale)
    for what, g, w, x, r in zip(("dq", "dk", "dv"), got, want, exact, low, strict=True):
        ulp = float(jnp.finfo(q.dtype).eps) * 2.0 ** np.floor(np.log2(float(jnp.max(jnp.abs(w)))))
        tol = 2 * _max_err(r, x) + ulp
        err = _max_err(g, w)
        assert err <= tol, f"{name} {what}: error {err:.3g} > {tol:.3g}"


@needs_interpret
@pytest.mark.parametrize("extra", [150, 20], ids=["in_place", "under_a_tile"])
def test_interpret_reads_the_first_rows_of_longer_inputs(extra):
    """q, out and d_out with more rows than the mask (the layer's halo call on each chunk's
    first rows): the same bits as the call on their first T rows, whether they hold the padded
    tiles (read in place) or not; the rows after T hold large values and change nothing."""
    name = "window_causal_gqa2"  # T = 160: its last tile is partial
    q, k, v, d_out, vis = _inputs(name)
    scale = q.shape[-1] ** -0.5
    out = _reference_grads(q, k, v, d_out, vis, scale, F32)[0].astype(q.dtype)
    lse = _lse(q, k, vis, scale)
    tails = jax.random.split(jax.random.key(3), 3)
    tail = lambda x, key: (100 * jax.random.normal(key, (x.shape[0], extra, *x.shape[2:]))).astype(x.dtype)
    longer = [jnp.concatenate([x, tail(x, key)], 1) for x, key in zip((q, out, d_out), tails, strict=True)]
    want = _interpret_backward(q, k, v, out, lse, d_out, vis, scale)
    got = _interpret_backward(longer[0], k, v, longer[1], lse, longer[2], vis, scale)
    assert got[0].shape == q.shape
    for what, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g.astype(F32)), np.asarray(w.astype(F32)), err_msg=what)


@needs_interpret
def test_interpret_merge_property():
    """Keys split in two parts, each part's backward given the MERGED out and lse: dq sums to the
    whole's, dk/dv of the parts are the whole's pieces."""
    name = "causal_cp_rank0_gqa4"
    q, k, v, d_out, vis = _inputs(name)
    _, _, _, _, mask, q_pos, k_pos, _ = CASES[name]
    scale = q.shape[-1] ** -0.5
    out32, exact = _reference_grads(q, k, v, d_out, vis, scale, F32)
    _, low = _reference_grads(q, k, v, d_out, vis, scale, q.dtype)
    out, lse = out32, _lse(q, k, vis, scale)
    cut = 96  # the first part is chunk 0 and 1 of four: the rank's first chunk sees only it
    parts = []
    for sl in (slice(0, cut), slice(cut, None)):
        vis_p = masks.visibility(mask, jnp.asarray(q_pos, jnp.int32), jnp.asarray(k_pos[sl], jnp.int32))
        parts.append(_interpret_backward(q, k[:, sl], v[:, sl], out, lse, d_out, vis_p, scale))
    dq = parts[0][0].astype(F32) + parts[1][0].astype(F32)
    dk = jnp.concatenate([parts[0][1], parts[1][1]], axis=1)
    dv = jnp.concatenate([parts[0][2], parts[1][2]], axis=1)
    for what, g, x, r in zip(("dq", "dk", "dv"), (dq, dk, dv), exact, low, strict=True):
        ref_err = _max_err(r, x)
        err = _max_err(g, x)
        assert err <= 2 * ref_err, f"merge {what}: error {err:.3g} > 2 x the reference's {ref_err:.3g}"


@needs_interpret
def test_interpret_adds_a_given_dq_and_skips_what_nothing_sees():
    """A rank's two key parts (its first chunk's keys, the rest): the second part's backward given
    the first's dQ (``dq_add``) returns their float32 sum rounded once, the bits of the sum in
    XLA, and the same dK/dV as without it; programs that nothing sees (the first chunk's rows
    against the rest; keys past every query) load nothing and give exact zeros."""
    q_pos, k_pos = _cp_rank_positions(0, 2, 64)  # rows 0..63 and 192..255
    k_pos = np.arange(320)  # keys 256..319: seen by no query
    vis = masks.visibility(CAUSAL, jnp.asarray(q_pos, jnp.int32), jnp.asarray(k_pos, jnp.int32))
    keys = jax.random.split(jax.random.key(5), 4)
    q, d_out = (jax.random.normal(key, (1, 128, 2, 64), F32).astype(BF16) for key in keys[:2])
    k, v = (jax.random.normal(key, (1, 320, 1, 64), F32).astype(BF16) for key in keys[2:])
    scale = 0.125
    out, lse = _reference_grads(q, k, v, d_out, vis, scale, F32)[0], _lse(q, k, vis, scale)
    config = mb.default_config(64, interpret=True).replace(consumers=1)
    part = lambda sl: (
        k[:, sl],
        v[:, sl],
        masks.visibility(CAUSAL, jnp.asarray(q_pos), jnp.asarray(k_pos[sl])),
    )
    first, rest = part(slice(0, 64)), part(slice(64, None))
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        run = lambda ks, dq_add=None: jax.block_until_ready(
            mb.backward(q, ks[0], ks[1], out, lse, d_out, ks[2], scale=scale, config=config, dq_add=dq_add)
        )
        dq_first = run(first)[0]
        alone, added = run(rest), run(rest, dq_first)
    f32 = lambda x: np.asarray(x.astype(F32))
    np.testing.assert_array_equal(
        f32(added[0]), f32((dq_first.astype(F32) + alone[0].astype(F32)).astype(BF16))
    )
    for g, w in zip(added[1:], alone[1:], strict=True):
        np.testing.assert_array_equal(f32(g), f32(w))
    assert (f32(alone[0])[:, :64] == 0).all()  # the first chunk's rows see none of the rest
    assert (f32(alone[1])[:, 192:] == 0).all() and (f32(alone[2])[:, 192:] == 0).all()  # keys 256..
    exact = _reference_grads(q, k, v, d_out, vis, scale, F32)[1]
    low = _reference_grads(q, k, v, d_out, vis, scale, BF16)[1]
    assert _max_err(added[0], exact[0]) <= 2 * _max_err(low[0], exact[0])


# -- checks (no kernel run) ----------------------------------------------------------------------


def test_config_and_input_checks():
    with pytest.raises(ValueError, match="block_q"):
        mb.BackwardConfig(block_q=96)
    with pytest.raises(ValueError, match="num_stages"):
        mb.BackwardConfig(num_stages=1)
    with pytest.raises(ValueError, match="pingpong needs consumers=2"):
        mb.BackwardConfig(consumers=1, pingpong=True)
    q, k, v, d_out, vis = _inputs("full_f16")
    out, lse = q, jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), F32)
    with pytest.raises(ValueError, match="lse"):
        mb.backward(q, k, v, out, lse[:, :, :-1], d_out, vis, scale=0.125)
    with pytest.raises(ValueError, match="d_out"):
        mb.backward(q, k, v, out, lse, d_out[:, :-1], vis, scale=0.125)
    with pytest.raises(ValueError, match="scale"):
        mb.backward(q, k, v, out, lse, d_out, vis, scale=0)
    with pytest.raises(ValueError, match="float32"):
        mb.backward(q.astype(F32), k.astype(F32), v.astype(F32), out, lse, d_out, vis, scale=0.125)
    with pytest.raises(ValueError, match="out must be in q's dtype or float32"):
        mb.backward(q, k, v, out.astype(BF16), lse, d_out, vis, scale=0.125)
    with pytest.raises(ValueError, match="shared memory"):
        mb.backward(q, k, v, out, lse, d_out, vis, scale=0.125, config=mb.BackwardConfig(num_stages=40))
    for bad in (q.astype(BF16), q[:, :-1]):  # another dtype, another row count
        with pytest.raises(ValueError, match=r"dq_add must be \[B, T, N, H\]"):
            mb.backward(q, k, v, out, lse, d_out, vis, scale=0.125, dq_add=bad)
    q256, k256 = jnp.zeros(q.shape[:3] + (256,), q.dtype), jnp.zeros(k.shape[:3] + (256,), k.dtype)
    with pytest.raises(ValueError, match="head dimensions 64, 128"):
        mb.backward(q256, k256, k256, q256, lse, q256, vis, scale=0.125)


def test_kernel_consumers_narrow_only_grids_under_a_wave():
    two = mb.BackwardConfig()
    assert mb.kernel_consumers(two, programs=132, sm_count=132) == 1  # 66 programs with two
    assert mb.kernel_consumers(two, programs=133, sm_count=132) == 2
    assert mb.kernel_consumers(two.replace(narrow_small_grids=False), programs=8, sm_count=132) == 2
    assert mb.kernel_consumers(two.replace(consumers=1), programs=10_000, sm_count=132) == 1


def _consumers_launched(monkeypatch, q, k, v, d_out, vis, config=None):
    """The consumers the dQ and dK/dV kernels are built with (abstract evaluation, no run)."""
    seen = []
    real = mb.registers
    monkeypatch.setattr(mb, "registers", lambda c: seen.append(c) or real(c))
    lse = jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), F32)
    jax.eval_shape(lambda *a: mb.backward(*a, vis, scale=0.125, config=config), q, k, v, q, lse, d_out)
    return seen


def test_small_grids_run_one_consumer(monkeypatch):
    """A halo-sized call (keys and rows under a wave of programs) runs both kernels with one
    consumer by default; a grid past a wave keeps two; ``narrow_small_grids=False`` keeps two."""
    B, T, L, N, K, H = 2, 512, 512, 32, 8, 128
    vis = masks.visibility(CAUSAL, jnp.arange(L, L + T, dtype=jnp.int32), jnp.arange(L, dtype=jnp.int32))
    z = lambda *shape: jnp.zeros(shape, BF16)
    q, k = z(B, T, N, H), z(B, L, K, H)
    # dQ: 32 heads x 2 x 8 tiles of 64 rows = 512 programs with one: two; dK/dV: 8 x 2 x 8 = 128: one
    assert _consumers_launched(monkeypatch, q, k, k, q, vis) == [2, 1]
    keep = mb.default_config(H).replace(narrow_small_grids=False)
    assert _consumers_launched(monkeypatch, q, k, k, q, vis, keep) == [2, 2]
    q4, k1 = z(B, T, 4, H), z(B, L, 1, H)  # 4 query heads: the dQ grid fits a wave too
    assert _consumers_launched(monkeypatch, q4, k1, k1, q4, vis) == [1, 1]


# -- lowering for CUDA ---------------------------------------------------------------------------


def _export(
    name: str, head_dim: int, operands_via_smem: bool, consumers: int = 2, out_dtype=None, adds: bool = False,
    pingpong: bool = False,
):  # fmt: skip
    q, k, v, d_out, vis = _inputs(name, head_dim)
    lse = jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), F32)
    out = q if out_dtype is None else q.astype(out_dtype)
    config = mb.default_config(head_dim, interpret=operands_via_smem).replace(
        consumers=consumers, narrow_small_grids=False, pingpong=pingpong
    )
    f = lambda *a: mb.backward(*a[:7], scale=head_dim**-0.5, config=config, dq_add=a[7] if adds else None)
    operands = (q, k, v, out, lse, d_out, vis, q)
    args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), operands)
    return jax.export.export(jax.jit(f), platforms=["cuda"])(*args)


@needs_cuda_lowering
@pytest.mark.parametrize("consumers", [1, 2])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", list(CASES))
def test_lowers_for_cuda(name, head_dim, consumers):
    exported = _export(name, head_dim, operands_via_smem=False, consumers=consumers)
    text = exported.mlir_module()
    calls = re.findall(r"custom_call @(mosaic_gpu\w*)", text)
    assert len(calls) == 2, calls  # the dQ kernel and the dK/dV kernel
    q, k, *_ = _inputs(name, head_dim)
    assert [o.shape for o in exported.out_avals] == [q.shape, k.shape, k.shape]
    assert [o.dtype for o in exported.out_avals] == [q.dtype, k.dtype, k.dtype]


@needs_cuda_lowering
@pytest.mark.parametrize("consumers", [1, 2])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_interpret_form_lowers_for_cuda(head_dim, consumers):
    text = _export(
        "documents_causal_gqa4", head_dim, operands_via_smem=True, consumers=consumers
    ).mlir_module()
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 2


@needs_cuda_lowering
@pytest.mark.parametrize("adds", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_pingpong_lowers_for_cuda(head_dim, adds):
    """Both kernels with their consumers taking turns, in the GPU form (operands in registers)."""
    text = _export("documents_causal_gqa4", head_dim, False, adds=adds, pingpong=True).mlir_module()
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 2


@needs_cuda_lowering
@pytest.mark.parametrize("consumers", [1, 2])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_adding_a_given_dq_lowers_for_cuda(head_dim, consumers):
    """The dQ kernel with ``dq_add`` (a rank's local backward adding its remote part's dQ)."""
    text = _export("documents_causal_gqa4", head_dim, False, consumers=consumers, adds=True).mlir_module()
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 2


@needs_cuda_lowering
@pytest.mark.parametrize("head_dim", [64, 128])
def test_float32_out_lowers_for_cuda(head_dim):
    """The dQ kernel reads the given out in its own dtype for delta: a float32 out (a merged one
    kept wide) takes float32 tiles in shared memory, and still fits."""
    text = _export("window_causal_gqa2", head_dim, operands_via_smem=False, out_dtype=F32).mlir_module()
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 2
